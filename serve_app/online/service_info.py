"""Facts the ingress reports under `/info` and `/stats`: installed versions and how Serve runs the request path."""

from importlib import metadata

from . import ray_compat

VERSIONED = ("laya-fleet", "torch", "ray", "tilelang")  # the distributions `/info` reports


def package_versions(names: tuple[str, ...] = VERSIONED) -> dict[str, str | None]:
    """The installed version of each distribution in `names` (None for one not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def serve_request_path() -> dict[str, bool]:
    """How Ray Serve runs this replica's request path, as its environment set it (the app's runtime_env in
    configs/*.yaml): gRPC calls between deployments, user code and the handle's router on the replica's own
    event loop, direct ingress."""
    c = ray_compat.serve_constants()
    return {"grpc_between_deployments": bool(c.RAY_SERVE_USE_GRPC_BY_DEFAULT),
            "user_code_on_replica_loop": not c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
            "router_on_replica_loop": not c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
            "direct_ingress": bool(c.RAY_SERVE_ENABLE_DIRECT_INGRESS)}
