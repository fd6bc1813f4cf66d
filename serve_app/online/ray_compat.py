"""The Ray APIs laya-fleet uses that Ray does not promise to keep, in one place, checked at start.

Private modules (`ray.serve._private.constants`: how Serve runs the request path), alpha and developer APIs
(the Serve and actor errors the ingress maps to statuses) and the custom autoscaling policy's context
(autoscale.py: pickled by value into the controller, so it imports nothing and is checked here) can
move in any Ray release. `check()` runs in the app builder and in each ingress replica's constructor: a Ray
without one of them fails there with a `RuntimeError` naming what is missing, the Ray found and the Ray
laya-fleet is tested with, instead of on the first request or the first autoscaling decision.
`loopback_replica_grpc()` keeps a local Ray's replicas off every interface but loopback.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType, SimpleNamespace

# pyproject.toml's pin of ray (tests/test_serve_info.py keeps the two equal)
TESTED_RAY = "2.60.0"

SERVE_CONSTANTS = "ray.serve._private.constants"
# module -> the attributes laya-fleet reads from it ("Class.attr": a class attribute; "Class(attr)": an instance
# attribute, as a parameter of the class's constructor)
REQUIRED: dict[str, tuple[str, ...]] = {
    SERVE_CONSTANTS: ("RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
                      "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "RAY_SERVE_ENABLE_DIRECT_INGRESS"),
    "ray.serve.exceptions": ("BackPressureError", "DeploymentUnavailableError", "RequestCancelledError"),
    "ray.exceptions": ("ActorDiedError", "ActorUnavailableError", "RayActorError", "RayTaskError"),
    "ray.serve._private.replica": ("add_port_to_grpc_server",),
    "ray.serve.config": ("AutoscalingContext(current_num_replicas)", "AutoscalingContext(target_num_replicas)",
                         "AutoscalingContext(config)", "AutoscalingContext.aggregated_metrics",
                         "AutoscalingContext.total_num_requests", "AutoscalingConfig.get_target_ongoing_requests"),
}


def ray_version() -> str:
    """The installed Ray's version ("not installed" without one)."""
    try:
        import ray

        return str(ray.__version__)
    except ImportError:
        return "not installed"


def _missing(what: str) -> RuntimeError:
    return RuntimeError(
        "laya-fleet needs %s, which the installed Ray %s does not have; laya-fleet is tested with ray==%s "
        "(pyproject.toml): install that version, or adapt serve_app/online/ray_compat.py to this one"
        % (what, ray_version(), TESTED_RAY))


def _takes(cls: object, param: str) -> bool:
    try:
        return inspect.isclass(cls) and param in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def require(module: str, names: tuple[str, ...] | None = None) -> ModuleType:
    """`module` once it has every one of `names` (default: its `REQUIRED` entry); RuntimeError naming the first
    missing one, the Ray found and the Ray laya-fleet is tested with."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        raise _missing("the module %s" % module) from None
    for name in REQUIRED.get(module, ()) if names is None else names:
        path, _, param = name.partition("(")
        obj: object = mod
        parts = path.split(".")
        for i, part in enumerate(parts):
            if not hasattr(obj, part):
                raise _missing("%s.%s" % (module, ".".join(parts[:i + 1])))
            obj = getattr(obj, part)
        if param and not _takes(obj, param.rstrip(")")):
            raise _missing("%s.%s (its constructor's %r)" % (module, path, param.rstrip(")")))
    return mod


def check() -> None:
    """Raise RuntimeError (see `require`) unless the installed Ray has everything in `REQUIRED`."""
    for module in REQUIRED:
        require(module)


def loopback_replica_grpc() -> bool:
    """On a node whose Ray address is loopback (`make serve`'s local Ray), make this replica's inter-deployment
    gRPC server bind 127.0.0.1 instead of Serve's fixed `[::]:0`; returns whether it does. Called in a replica's
    constructor, before Serve starts that server; elsewhere it changes nothing."""
    import ray

    if not ray.is_initialized() or not ray.util.get_node_ip_address().startswith("127."):
        return False
    replica = require("ray.serve._private.replica", REQUIRED["ray.serve._private.replica"])
    bind = replica.add_port_to_grpc_server
    if getattr(bind, "loopback", False):
        return True

    def add_port_to_grpc_server(server, address: str):
        return bind(server, "127.0.0.1:" + address[len("[::]:"):] if address.startswith("[::]:") else address)

    add_port_to_grpc_server.loopback = True
    replica.add_port_to_grpc_server = add_port_to_grpc_server
    return True


def serve_constants() -> ModuleType:
    """`ray.serve._private.constants`, checked (Serve's request-path settings as this process's env set them)."""
    return require(SERVE_CONSTANTS)


def errors() -> SimpleNamespace:
    """The Ray and Serve exception classes the ingress maps to HTTP statuses, by name."""
    return SimpleNamespace(**{n: getattr(require(m), n) for m in ("ray.serve.exceptions", "ray.exceptions")
                              for n in REQUIRED[m]})


__all__ = ["TESTED_RAY", "REQUIRED", "ray_version", "require", "check", "loopback_replica_grpc", "serve_constants",
           "errors"]
