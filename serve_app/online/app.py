"""The Serve application builder (`import_path: serve_app.app:build_app`) with typed `args`.

    Ingress (FastAPI, CPU)  --DeploymentHandle, rows-->  Scorer (one per GPU, token-budget batching)

or, with `topology: fused`, one deployment whose replicas (one per GPU) do both (fused_ingress.py).

`args` (an `AppArgs`) fix what a replica is built from (checkpoint, backend, resources, limits, auth);
changing them restarts replicas. The scorer's batching policy is its `user_config`
(`deployments: [{name: Scorer, user_config: {...}}]` in the config file), applied live by
`reconfigure`; `args.batching` is only its default when the config file sets none.
"""

import logging
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from ray.serve import Application

from . import ray_compat
from .ingress import Ingress
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

    checkpoint: str = Field(description="checkpoint directory (upstream Laya bundle); relative = from the cwd")
    backend: str = Field("auto", description="auto | eager | fast | compile | aot")
    device: str = Field("auto", description="auto (CUDA when usable, else CPU) | cpu | cuda")
    cache_dir: str | None = Field(None, description="shared compile-cache root; None = $LAYA_FLEET_CACHE_DIR")
    api_key_env: str | None = Field(None, description="NAME of the env var holding the bearer key; None = no auth")
    docs: bool = Field(True, description="serve /docs, /redoc and /openapi.json")
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


def _checkpoint_path(path: str) -> str:
    if os.path.isabs(path):
        return path
    full = os.path.abspath(path)
    if not os.path.isdir(full):
        log.warning("checkpoint %r not found from %s; replicas will resolve it from their own cwd", path, os.getcwd())
        return path
    return full


def build_app(args: AppArgs) -> Application:
    """The Serve application (Ingress bound to a Scorer handle) for these arguments."""
    if isinstance(args, dict):  # called directly rather than through Serve's builder machinery
        args = AppArgs.model_validate(args)
    ray_compat.check()  # `serve run` / `serve deploy` stop here on a Ray without the APIs the replicas use
    checkpoint = _checkpoint_path(args.checkpoint)
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
    scorer_kwargs = dict(checkpoint=checkpoint, backend=args.backend, device=args.device, cache_dir=args.cache_dir,
                         warmup=args.warmup, torch_threads=args.scorer.torch_threads,
                         backend_wrapper=args.backend_wrapper,
                         gil_switch_interval_s=args.scorer.gil_switch_interval_s, batching=args.batching.model_dump())
    ingress_kwargs = dict(limits=args.limits.model_dump(), api_key_env=args.api_key_env, docs=args.docs,
                          cpu_threads=args.ingress.cpu_threads, max_inflight_calls=args.ingress.max_inflight_calls,
                          max_call_tokens=args.ingress.max_call_tokens)
    if args.topology == "fused":  # the scorer inside each ingress replica: the scorer's resources
        from .fused_ingress import FusedIngress

        fused_actor = dict(actor, num_cpus=args.scorer.num_cpus + args.ingress.num_cpus)
        app = FusedIngress.options(ray_actor_options=fused_actor, user_config=args.batching.model_dump()).bind(
            scorer_kwargs, checkpoint, **ingress_kwargs)
        log.info("built laya-fleet app (fused): checkpoint %s, backend %s, replica %s", checkpoint, args.backend,
                 fused_actor)
        return app
    scorer = ScorerDeployment.options(ray_actor_options=actor, user_config=args.batching.model_dump()).bind(
        **scorer_kwargs)
    ingress = Ingress.options(ray_actor_options={"num_cpus": args.ingress.num_cpus}).bind(
        scorer, checkpoint, **ingress_kwargs)
    log.info("built laya-fleet app: checkpoint %s, backend %s, scorer %s, ingress %s", checkpoint, args.backend,
             actor, args.ingress.model_dump())
    return ingress
