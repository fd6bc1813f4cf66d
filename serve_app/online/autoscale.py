"""Scorer autoscaling on requests, not on handle calls.

Serve's default policy scales on ongoing handle calls per replica. The ingress coalesces concurrent
requests into shared scorer calls (coalescer.py), so under load a replica sees a few calls that
carry many requests, and a call count says little about how busy it is. Each scorer replica therefore
reports `pending_requests` (requests queued in its token batcher plus those in the batch running now)
through Serve's custom autoscaling metrics (`ScorerDeployment.record_autoscaling_stats`), and this policy
asks for `sum(pending_requests) / target_ongoing_requests` replicas: `target_ongoing_requests` in the
config keeps its meaning of requests per replica. Serve applies min/max replicas and the upscale and
downscale delays around it.

The function is pickled by value into the Serve controller, so it imports nothing from this project; the
parts of Ray's `AutoscalingContext` it reads are checked when the app is built (ray_compat.py).

    autoscaling_config:
      target_ongoing_requests: 64
      policy:
        policy_function: serve_app.autoscale:pending_requests_policy
"""

METRIC = "pending_requests"


def pending_requests_policy(ctx):
    """Desired replicas = requests pending on all replicas / target per replica (Serve's call count if none)."""
    n = ctx.current_num_replicas
    if n == 0:
        return ctx.target_num_replicas, {}
    per_replica = (ctx.aggregated_metrics or {}).get(METRIC) or {}
    total = float(sum(per_replica.values())) if per_replica else float(ctx.total_num_requests)
    target = float(ctx.config.get_target_ongoing_requests())
    return total / target, {"pending_requests": total}
