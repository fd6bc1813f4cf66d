"""The Serve application builder (`import_path: serve_app.app:build_app`) with typed `args`.

    Ingress (FastAPI, CPU)  --DeploymentHandle, rows-->  Scorer (one per GPU, token-budget batching)
                            --DeploymentHandle, rows-->  Scorer-<name> (one deployment per other checkpoint)

or, with `topology: fused`, one deployment whose replicas (one per GPU) serve HTTP and hold the default
checkpoint's scorer (fused_ingress.py), calling the other checkpoints' `Scorer-<name>` deployments.

Several checkpoints: `checkpoint` is the default's directory, `checkpoints` adds {served name: directory}
(checkpoints.py names the deployments); each scorer deployment is sized and autoscaled on its own by its
`deployments:` entry, `min_replicas: 0` included (scale to zero: the first request waits for the warm-up).

`args` (an `AppArgs`) fix what a replica is built from (checkpoint, backend, resources, limits, auth);
changing them restarts replicas. The scorer's batching policy is its `user_config`
(`deployments: [{name: Scorer, user_config: {...}}]` in the config file), applied live by
`reconfigure`; `args.batching` is only its default when the config file sets none.
"""

import logging
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.serve import Application

from . import ray_compat
from .checkpoints import deployment_name, served
from .ingress import Ingress
from .routing import canonical_name
from .schemas import Limits
from .scorer_deployment import BatchingPolicy, ScorerDeployment

log = logging.getLogger(__name__)

HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"


class ScorerOptions(BaseModel):
    """Resources and threads of each scorer replica (one replica per GPU in production)."""

    model_config = ConfigDict(extra="forbid")

    num_gpus: float = Field(0, ge=0, description="GPUs per replica: 1 in production, 0 on CPU")
    num_cpus: float = Field(1, ge=0, description="logical CPUs per replica")
    memory: int | None = Field(None, ge=0, description="bytes of memory to reserve per replica")
    accelerator_type: str | None = Field(None, description="e.g. H100; None = any")
    torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads (CPU forwards)")
    gil_switch_interval_s: float | None = Field(
        None, gt=0, le=0.1,
        description="sys.setswitchinterval for the replica; None = Python's 0.005. The forward thread must win "
                    "the GIL back from the replica's event-loop threads after every device wait")
    forward_stall_s: float = Field(
        60.0, gt=0, description="a replica whose forward has run longer than this per token budget it scores "
                                "fails its health check and Serve replaces it (a stuck GPU answers nothing and "
                                "raises nothing)")


class IngressOptions(BaseModel):
    """Resources of each ingress replica (tokenization and decoding run here)."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(0.5, ge=0)
    cpu_threads: int = Field(2, ge=1, description="threads for tokenizing / decoding large requests")
    max_inflight_calls: int = Field(4, ge=1, description="scorer calls outstanding per ingress replica; requests "
                                                         "arriving while all are busy share the next call")
    max_call_tokens: int = Field(65536, ge=1, description="tokens per shared scorer call (one request may exceed)")


class AppArgs(BaseModel):
    """Typed builder arguments (the `args:` block of a Serve config file)."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str | None = Field(None, description="the default checkpoint's directory (upstream Laya bundle); "
                                                     "relative = from the cwd")
    checkpoints: dict[str, str] = Field(
        default_factory=dict,
        description="more checkpoints, {served name: directory}: upstream's names (english, multilingual, "
                    "typed-decisions, or an alias such as ml) or any other name; each gets the scorer deployment "
                    "Scorer-<name>, the default's is Scorer")
    default_checkpoint: str = Field("english", description="served name of the default checkpoint (`checkpoint`, "
                                                           "deployment Scorer)")
    routing_default: str | None = Field(
        None, description="served name that answers states with no language evidence (upstream's "
                          "LAYA_DEFAULT_MODEL); None = upstream's rule: multilingual when served, else the default")
    auto_task: bool = Field(False, description="route question sets that are a typed-decisions workflow to "
                                               "typed-decisions when served (upstream's LAYA_AUTO_TASK)")
    backend: str = Field("auto", description="auto | eager | fast | compile | aot")
    device: str = Field("auto", description="auto (CUDA when usable, else CPU) | cpu | cuda")
    cache_dir: str | None = Field(None, description="shared compile-cache root; None = $LAYA_FLEET_CACHE_DIR")
    api_key_env: str | None = Field(None, description="NAME of the env var holding the bearer key (it must be set); "
                                                      "None = LAYA_API_KEY when set and non-empty, else no auth")
    docs: bool = Field(True, description="serve /docs, /redoc and /openapi.json while no bearer key is set (with a key "
                                         "they are 404, as upstream)")
    warmup: bool = True
    limits: Limits = Field(default_factory=Limits)
    batching: BatchingPolicy = Field(default_factory=BatchingPolicy,
                                     description="default scorer user_config when the config file sets none")
    scorer: ScorerOptions = Field(default_factory=ScorerOptions)
    ingress: IngressOptions = Field(default_factory=IngressOptions)
    backend_wrapper: str | None = Field(None, description="'module:callable' wrapping the scorer's backend "
                                                          "(fault injection in tests, instrumentation)")
    haproxy: bool = Field(
        False, description="the cluster is expected to run Ray's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1 in "
                           "its environment); when it does not, the app still serves through Serve's proxy and "
                           "the builder logs one warning")
    topology: Literal["split", "fused"] = Field(
        "split", description="split: CPU ingress replicas call GPU scorer replicas through a DeploymentHandle; "
                             "fused: one deployment ('Ingress') whose replicas hold the scorer (one per GPU, "
                             "no process hop; its config entry takes the scorer's user_config and autoscaling)")

    @model_validator(mode="after")
    def _served_checkpoints(self) -> "AppArgs":
        self.served()  # ValueError (a validation error) for a clash, a bad name or no default directory
        return self

    def served(self) -> dict[str, str]:
        """{served name: directory} of every checkpoint, the default first (checkpoints.py)."""
        out = served(self.checkpoint, self.checkpoints, self.default_checkpoint)
        if self.routing_default is not None and canonical_name(self.routing_default) not in out:
            raise ValueError("routing_default %r is not a served checkpoint (%s)" % (self.routing_default, list(out)))
        return out


def _checkpoint_path(path: str) -> str:
    if os.path.isabs(path):
        return path
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        log.warning("checkpoint %r not found from %s; replicas will resolve it from their own cwd", path, os.getcwd())
        return path
    return full


def _device_preference(args: AppArgs) -> str:
    """The device `/health` reports while no checkpoint is loaded: the configured one, or where `auto` lands."""
    if args.device != "auto":
        return args.device
    return "cuda" if args.scorer.num_gpus > 0 else "cpu"


def _row_backend(args: AppArgs) -> str:
    """The scorers' backend as far as the builder can tell: `auto` on the CPU is eager; elsewhere `auto` stays
    `auto` (fast when it builds, else eager), bounding a row by the checkpoint's own max_len."""
    if args.backend == "auto" and _device_preference(args) == "cpu":
        return "eager"
    return args.backend


def build_app(args: AppArgs) -> Application:
    """The Serve application (Ingress bound to one Scorer handle per served checkpoint) for these arguments."""
    if isinstance(args, dict):  # called directly rather than through Serve's builder machinery
        args = AppArgs.model_validate(args)
    ray_compat.check()  # `serve run` / `serve deploy` stop here on a Ray without the APIs the replicas use
    paths = {name: _checkpoint_path(path) for name, path in args.served().items()}
    default, checkpoint = next(iter(paths.items()))
    if args.haproxy and os.environ.get(HAPROXY_ENV) != "1":
        log.warning("this app expects Ray's HAProxy ingress, but %s=1 is not in the cluster's environment: it "
                    "serves through Serve's Python proxy on the HTTP port, at a fraction of the throughput. Start "
                    "Ray (ray start / serve run / the pod spec) with %s=1 and RAY_SERVE_HAPROXY_BINARY_PATH set to "
                    "laya-fleet-haproxy (docs/serving.md, Production)", HAPROXY_ENV, HAPROXY_ENV)
    actor = {"num_cpus": args.scorer.num_cpus, "num_gpus": args.scorer.num_gpus}
    if args.scorer.memory:
        actor["memory"] = args.scorer.memory
    if args.scorer.accelerator_type:
        actor["accelerator_type"] = args.scorer.accelerator_type
    common = dict(backend=args.backend, device=args.device, cache_dir=args.cache_dir, warmup=args.warmup,
                  torch_threads=args.scorer.torch_threads, backend_wrapper=args.backend_wrapper,
                  gil_switch_interval_s=args.scorer.gil_switch_interval_s,
                  forward_stall_s=args.scorer.forward_stall_s, batching=args.batching.model_dump())

    def scorer(name: str):
        return ScorerDeployment.options(name=deployment_name(name, default), ray_actor_options=actor,
                                        user_config=args.batching.model_dump()).bind(checkpoint=paths[name], **common)

    others = {name: {"checkpoint": path, "scorer": scorer(name)} for name, path in paths.items() if name != default}
    ingress_kwargs = dict(limits=args.limits.model_dump(), api_key_env=args.api_key_env, docs=args.docs,
                          cpu_threads=args.ingress.cpu_threads, max_inflight_calls=args.ingress.max_inflight_calls,
                          max_call_tokens=args.ingress.max_call_tokens, default=default, others=others,
                          device_preference=_device_preference(args), routing_default=args.routing_default,
                          auto_task=args.auto_task, scorer_backend=_row_backend(args))
    if args.topology == "fused":  # the default's scorer inside each ingress replica: the scorer's resources
        from .fused_ingress import FusedIngress

        fused_actor = dict(actor, num_cpus=args.scorer.num_cpus + args.ingress.num_cpus)
        app = FusedIngress.options(ray_actor_options=fused_actor, user_config=args.batching.model_dump()).bind(
            dict(checkpoint=checkpoint, **common), checkpoint, **ingress_kwargs)
        log.info("built laya-fleet app (fused): checkpoints %s (default %s), backend %s, replica %s", list(paths),
                 default, args.backend, fused_actor)
        return app
    ingress = Ingress.options(ray_actor_options={"num_cpus": args.ingress.num_cpus}).bind(
        scorer(default), checkpoint, **ingress_kwargs)
    log.info("built laya-fleet app: checkpoints %s (default %s), backend %s, scorer %s, ingress %s", list(paths),
             default, args.backend, actor, args.ingress.model_dump())
    return ingress
