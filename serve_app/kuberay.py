"""`python -m serve_app.kuberay [--check]`: writes (or checks) deploy/kuberay/ from configs/; the generator is
serve_app/online/kuberay_manifests.py."""

from .online.kuberay_manifests import HAPROXY_BINARY, OUT_DIR, ROOT, main, ray_version, render

__all__ = ["HAPROXY_BINARY", "OUT_DIR", "ROOT", "main", "ray_version", "render"]

if __name__ == "__main__":
    raise SystemExit(main())
