"""`topology: fused`: the ingress with its scorer in the same replica, one deployment serving HTTP and the model.

`LocalScorer` gives the in-process scorer the handle interface the ingress calls (`score_many`, `stats`,
`info`); `FusedIngress` scores a request for the default checkpoint straight into that scorer's token batcher
(`LocalServed`), and a request routed to another checkpoint through that checkpoint's scorer deployment.
"""

import asyncio
import time
from typing import Any

from ray import serve

from . import ray_compat
from .ingress import Ingress
from .request_checks import HTTPError
from .served import ServedCheckpoint


class _LocalMethod:
    """`handle.method.remote(*args)` for an object in this process: an asyncio task on the running loop (it
    can be awaited, given a timeout and cancelled like a DeploymentResponse)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            out = self.fn(*args)
            return (await out) if asyncio.iscoroutine(out) else out

        return asyncio.get_running_loop().create_task(call())


class LocalScorer:
    """The handle interface the ingress uses (`score_many`, `stats`, `info`), served by a scorer in this process."""

    def __init__(self, scorer):
        self.impl = scorer
        self.score_many = _LocalMethod(scorer.score_many)
        self.stats = _LocalMethod(scorer.stats)
        self.info = _LocalMethod(scorer.info)


class LocalServed(ServedCheckpoint):
    """The default checkpoint of a fused replica: a request's rows go straight into the in-process scorer's
    token batcher, which batches concurrent requests itself (no call slots to share: nothing crosses a process)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._direct = {"scorer_calls": 0, "inflight": 0}

    async def score(self, rows: list) -> tuple:
        """The in-process scorer's (logits, act) for one request's rows."""
        self._direct["scorer_calls"] += 1
        self._direct["inflight"] += 1
        try:
            async with asyncio.timeout(self.limits.scorer_timeout_s):
                out = await self.scorer.impl.score(rows)
        except TimeoutError:
            raise HTTPError(504, "scoring timed out") from None
        except Exception:  # noqa: BLE001 - this request failed in its batch (the scorer logged why)
            raise HTTPError(500, "inference failed") from None
        finally:
            self._direct["inflight"] -= 1
        self.last_ok = time.monotonic()
        return out

    async def is_warm(self) -> bool:
        return True

    def counters(self) -> dict[str, int]:
        """Requests scored straight into this replica's batcher: each is one call and one request."""
        d = self._direct
        return {"scorer_calls": d["scorer_calls"], "requests": d["scorer_calls"], "waiting": 0,
                "inflight": d["inflight"]}


@serve.deployment(name="Ingress", max_ongoing_requests=512, health_check_period_s=10,
                  graceful_shutdown_timeout_s=20)
class FusedIngress(Ingress.func_or_class):
    """The ingress with its scorer in the same replica (`topology: fused`): each replica (one per GPU, or
    several sharing one: configs/prod.yaml runs three) serves HTTP, tokenizes, batches and runs the model, so a
    request crosses no process after Serve's HTTP entry (see BENCHMARKS.md, "HTTP serving"). The scorer is the
    same `ScorerDeployment` class as in the split topology, built here, over the default checkpoint; this
    replica takes its `user_config` (`reconfigure`), health check and autoscaling metric. The other served
    checkpoints have scorer deployments of their own (`Scorer-<name>`), called through handles. The price:
    tokenizing shares the replica's GIL with the forward thread, and HTTP handling scales with GPUs rather than
    with CPU replicas."""

    topology = "fused"

    async def __init__(self, scorer_kwargs: dict, checkpoint: str, **ingress_kwargs):
        from .scorer_deployment import ScorerDeployment

        ray_compat.loopback_replica_grpc()  # before Serve starts this replica's gRPC server (a loopback Ray)
        ray_compat.check()  # before the scorer's warm-up
        self._local = ScorerDeployment.func_or_class(**scorer_kwargs)
        await super().__init__(LocalScorer(self._local), checkpoint, **ingress_kwargs)

    def _served(self, name: str, path: str, scorer) -> ServedCheckpoint:
        """The default checkpoint scored in this replica (`LocalServed`); the others as in the split topology."""
        if isinstance(scorer, LocalScorer):
            return LocalServed(name, path, scorer, self.limits, self._err, backend=self._served_kw["backend"])
        return super()._served(name, path, scorer)

    def _in_process(self) -> str | None:
        return self.default.name

    def reconfigure(self, user_config: dict | None) -> None:
        """The scorer's batching policy, applied live (see `ScorerDeployment.reconfigure`)."""
        self._local.reconfigure(user_config)

    def check_health(self) -> None:
        """Unhealthy after a fatal device error in the scorer (Serve then replaces the replica)."""
        self._local.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The scorer's `pending_requests` (autoscale.py)."""
        return self._local.record_autoscaling_stats()

    def info(self) -> dict[str, Any]:
        """This replica's scorer facts, counters and GPU ids (`ScorerDeployment.info`), through its handle."""
        return self._local.info()

    async def __del__(self):  # pragma: no cover - replica shutdown: stop the scorer's batcher and forward thread
        await self._local.__del__()
