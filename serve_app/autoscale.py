"""The import path configs and KubeRay manifests name for the scorer's autoscaling policy
(`policy_function: serve_app.autoscale:pending_requests_policy`); see serve_app/online/autoscale.py."""

from .online.autoscale import pending_requests_policy

__all__ = ["pending_requests_policy"]
