"""Online serving on Ray Serve: the app builder, the HTTP ingress (split and fused), the scorer deployment
with its token-budget batch queue, call coalescing, autoscaling, metrics, and the deployment tooling
(HAProxy launcher, KubeRay manifests)."""
