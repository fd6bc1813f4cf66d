"""The scorer deployment: one `Scorer` per replica (one replica per GPU), batching rows across requests.

The constructor loads the checkpoint and warms up before Serve routes any traffic to the replica.
`score(rows)` queues the rows in a `TokenBatcher`; batches run on the Scorer's one forward thread.
`user_config` (a `BatchingPolicy`) is applied by `reconfigure` without a restart.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
from collections import Counter as _Counter
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve

from model.sequence import Row

from ..scorer import MIN_BUDGET, Scorer, is_oom, select_device
from . import gc_pauses, metrics, ray_compat
from .batch_queue import BatchRecord, TokenBatcher

log = logging.getLogger(__name__)


class BatchingPolicy(BaseModel):
    """The scorer's `user_config`: token budget, row cap and wait window (changed live by `reconfigure`)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_tokens: int | None = Field(
        default=None, ge=MIN_BUDGET,
        description="token budget per forward micro-batch and per cross-request batch; "
                    "None = the scorer's default (8192 on CPU, measured at warm-up on GPU)")
    max_batch_rows: int | None = Field(default=None, ge=1, description="row cap per batch; None = no cap")
    batch_wait_timeout_s: float = Field(
        default=0.0, ge=0.0, le=1.0,
        description="how long the oldest queued request may wait for others to join its batch (0: a request "
                    "that finds the replica idle runs at once; under load batches fill during the forward)")


def _import(path: str):
    mod, _, attr = path.partition(":")
    if not mod or not attr:
        raise ValueError("backend_wrapper must look like 'package.module:callable', got %r" % path)
    return getattr(importlib.import_module(mod), attr)


def _precision(engine: Any) -> str:
    """The dtype an engine's forward computes in ("bfloat16", "float16", "float32", or the fast backend's
    "fp8-e4m3"): the backend's own word for it, else its autocast or compute dtype, else its weights' dtype; an AOT
    package on CUDA is built in the checkpoint's half dtype."""
    import torch

    backend = engine.backend
    if isinstance(getattr(backend, "precision", None), str):
        return backend.precision
    dt = getattr(backend, "dtype", None) or getattr(backend, "autocast", None)
    model = getattr(backend, "model", None)
    if dt is None and isinstance(model, torch.nn.Module):
        dt = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dt is None and engine.device.type == "cuda":
        from model.backends import cuda_amp_dtype

        dt = cuda_amp_dtype(engine.bundle.cfg, engine.device)
    return str(dt or torch.float32).removeprefix("torch.")


def _is_fatal_device_error(exc: BaseException) -> bool:
    text = str(exc)
    return not is_oom(exc) and ("CUDA error" in text or "device-side assert" in text
                                or type(exc).__name__ == "AcceleratorError")


@serve.deployment(name="Scorer", max_ongoing_requests=256, health_check_period_s=10,
                  graceful_shutdown_timeout_s=20)
class ScorerDeployment:
    """Serve replica around one `Scorer`: token-budget batching across concurrent requests."""

    def __init__(self, checkpoint: str, backend: str = "auto", device: str = "auto", cache_dir: str | None = None,
                 warmup: bool = True, torch_threads: int | None = None, backend_wrapper: str | None = None,
                 gil_switch_interval_s: float | None = None, forward_stall_s: float = 60.0,
                 batching: dict | None = None):
        ray_compat.loopback_replica_grpc()  # before Serve starts this replica's gRPC server (a loopback Ray)
        t0 = time.perf_counter()
        if gil_switch_interval_s:
            import sys

            sys.setswitchinterval(float(gil_switch_interval_s))
        if torch_threads:
            import torch

            torch.set_num_threads(int(torch_threads))
        policy = BatchingPolicy.model_validate(batching or {})
        dev = select_device(device)
        self.scorer = Scorer(checkpoint, backend=backend, device=dev, cache_dir=cache_dir,
                             max_batch_tokens=policy.max_batch_tokens, max_batch_rows=policy.max_batch_rows,
                             warmup=warmup)
        self._default_budget = self.scorer.budget
        if backend_wrapper:  # fault injection / instrumentation around the real forward
            self.scorer.engine.backend = _import(backend_wrapper)(self.scorer.engine.backend, self.scorer.engine)
            log.warning("backend wrapped by %s", backend_wrapper)
        self.policy = policy
        engine = self.scorer.engine
        # what /info reports, fixed at start (the hash reads the checkpoint's files: not on the event loop later)
        self._facts = {"checkpoint": metrics.checkpoint_label(engine.path),
                       "checkpoint_hash": engine.checkpoint_hash, "dtype": _precision(engine),
                       "max_len": engine.bundle.max_len, "head_max_len": engine.bundle.head_max_len}
        self.batcher = TokenBatcher(self.scorer.score_rows_async, lambda: self.scorer.budget,
                                    max_wait_s=policy.batch_wait_timeout_s, max_rows=policy.max_batch_rows,
                                    on_batch=self._on_batch)
        self._broken: str | None = None
        self.forward_stall_s = float(forward_stall_s)
        self._batch_sizes: _Counter[int] = _Counter()
        self._counts = {"requests": 0, "rows": 0, "batches": 0, "fallback_batches": 0, "errors": 0}
        self._wait_s_sum = 0.0
        self._forward_s_sum = 0.0
        self._oom_seen = self.scorer.stats.oom_retries
        labels = {"checkpoint": self._facts["checkpoint"], "backend": engine.backend_name}
        self._m = {n: metrics.make(n, **labels) for n in (
            "laya_fleet_queue_wait_seconds", "laya_fleet_batch_requests", "laya_fleet_batch_rows",
            "laya_fleet_batch_tokens", "laya_fleet_forward_seconds", "laya_fleet_batch_fallbacks",
            "laya_fleet_scorer_errors", "laya_fleet_oom_retries", "laya_fleet_queue_depth",
            "laya_fleet_token_budget", "laya_fleet_warmup_seconds")}
        self.ready_s = time.perf_counter() - t0
        self._set_gauges()
        self._gauges = metrics.Refresher(self._set_gauges)
        gc_pauses.watch()
        log.info("scorer replica ready in %.1fs on %s (CUDA_VISIBLE_DEVICES=%s)", self.ready_s, self.scorer.device,
                 os.environ.get("CUDA_VISIBLE_DEVICES"))

    # -- Serve hooks --------------------------------------------------------------------------
    def reconfigure(self, user_config: dict | None) -> None:
        """Apply a `BatchingPolicy` live: budget, row cap and wait window (unknown keys are refused)."""
        policy = BatchingPolicy.model_validate(user_config or {})
        self.scorer.set_budget(policy.max_batch_tokens or self._default_budget)
        self.scorer.max_batch_rows = policy.max_batch_rows
        self.batcher.configure(max_wait_s=policy.batch_wait_timeout_s, max_rows=policy.max_batch_rows)
        self.policy = policy
        self._m["laya_fleet_token_budget"].set(self.scorer.budget)
        log.info("reconfigured: %s (budget now %d)", policy.model_dump(), self.scorer.budget)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (autoscale.py): requests queued here plus those running."""
        return {"pending_requests": float(self.batcher.queued + self.batcher.in_flight)}

    def check_health(self) -> None:
        """Raise (so Serve replaces this replica) after a fatal device error, or while a forward has run for
        longer than `forward_stall_s` per token budget it scores (a wedged GPU answers nothing and raises
        nothing; a healthy one scores a budget in well under a second), counted from when it took the GPU lock
        (a forward waiting for another process's is not stuck); otherwise a no-op."""
        since = self.batcher.in_flight_since
        lock = self.scorer.gpu_lock
        if since is not None and lock is not None:
            # a forward waiting for another process's to leave the GPU is not stuck: its time counts from the lock
            since = None if lock.held_since is None else max(since, lock.held_since)
        if not self._broken and since is not None:
            budgets = -(-self.batcher.in_flight_tokens // max(1, self.scorer.budget))
            limit = self.forward_stall_s * max(1, budgets)
            if time.monotonic() - since > limit:
                self._broken = "a forward of %d tokens has run for %.0f s (limit %g s): the device is stuck" % (
                    self.batcher.in_flight_tokens, time.monotonic() - since, limit)
                log.error("scorer unhealthy: %s", self._broken)
        if self._broken:
            raise RuntimeError("scorer unhealthy: %s" % self._broken)

    # -- requests -----------------------------------------------------------------------------
    async def score(self, rows: Sequence[Row]):
        """(logits [N, kmax], P(action 0) [N]) for one request's rows, batched with concurrent requests."""
        self._m["laya_fleet_queue_depth"].set(self.batcher.queued + 1)
        try:
            return await self.batcher.submit(rows)
        except Exception as e:
            self._failed(e, len(rows))
            raise

    async def score_many(self, requests: Sequence[Sequence[Row]]) -> list:
        """One result per request: (logits, P(action 0)), or {"failed": error type} for a request that failed.

        Each request is its own item in the token batcher (so a poison request fails alone and the
        batching counters count requests); the ingress sends concurrent requests together this way.
        """
        self._m["laya_fleet_queue_depth"].set(self.batcher.queued + len(requests))
        outs = await asyncio.gather(*(self.batcher.submit(r) for r in requests), return_exceptions=True)
        results: list = []
        for rows, out in zip(requests, outs):
            if isinstance(out, asyncio.CancelledError):
                raise out
            if isinstance(out, BaseException):
                self._failed(out, len(rows))
                out = {"failed": type(out).__name__}
            results.append(out)
        return results

    def _failed(self, e: BaseException, n_rows: int) -> None:
        self._counts["errors"] += 1
        self._m["laya_fleet_scorer_errors"].inc()
        if _is_fatal_device_error(e):
            self._broken = type(e).__name__
        log.error("scoring failed for a request of %d rows: %s", n_rows, type(e).__name__)

    def _on_batch(self, rec: BatchRecord) -> None:
        self._counts["requests"] += rec.requests
        self._counts["rows"] += rec.rows
        self._counts["batches"] += 1
        self._counts["fallback_batches"] += int(rec.fallback)
        self._batch_sizes[rec.requests] += 1
        self._wait_s_sum += sum(rec.waits_s)
        self._forward_s_sum += rec.forward_s
        m = self._m
        for w in rec.waits_s:
            m["laya_fleet_queue_wait_seconds"].observe(w)
        m["laya_fleet_batch_requests"].observe(rec.requests)
        m["laya_fleet_batch_rows"].observe(rec.rows)
        m["laya_fleet_batch_tokens"].observe(rec.tokens)
        m["laya_fleet_forward_seconds"].observe(rec.forward_s)
        m["laya_fleet_queue_depth"].set(self.batcher.queued)
        if rec.fallback:
            m["laya_fleet_batch_fallbacks"].inc()
        ooms = self.scorer.stats.oom_retries
        if ooms > self._oom_seen:
            m["laya_fleet_oom_retries"].inc(ooms - self._oom_seen)
            self._oom_seen = ooms
        m["laya_fleet_token_budget"].set(self.scorer.budget)

    def _set_gauges(self) -> None:
        self._m["laya_fleet_warmup_seconds"].set(self.ready_s)
        self._m["laya_fleet_token_budget"].set(self.scorer.budget)
        self._m["laya_fleet_queue_depth"].set(self.batcher.queued)

    # -- facts --------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Batching counters of this replica: requests, batches, requests-per-batch histogram, waits."""
        n = max(1, self._counts["requests"])
        return dict(self._counts, batch_sizes={str(k): v for k, v in sorted(self._batch_sizes.items())},
                    max_batch_requests=max(self._batch_sizes, default=0),
                    mean_queue_wait_ms=round(1000.0 * self._wait_s_sum / n, 3),
                    # forward_s: batches as the event loop waited for them (thread hand-off and wake-up included);
                    # engine_s: the model calls alone, on the forward thread. The gap is time lost between them.
                    forward_s=round(self._forward_s_sum, 6), engine_s=round(self.scorer.stats.forward_s, 6),
                    budget=self.scorer.budget, oom_retries=self.scorer.stats.oom_retries,
                    gc=gc_pauses.watch().snapshot(), gpu_lock=self.scorer.gpu_lock_counts())

    def info(self) -> dict[str, Any]:
        """This replica: scorer facts (backend, device, checkpoint name and content hash, dtype, token lengths),
        batching policy and counters, actor name, assigned GPU ids."""
        import ray

        ctx = ray.get_runtime_context()
        try:
            gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        except Exception:  # noqa: BLE001 - outside a Ray worker
            gpu_ids = []
        import sys

        return dict(self.scorer.info(), **self._facts, policy=self.policy.model_dump(), batching=self.stats(),
                    gil_switch_interval_s=sys.getswitchinterval(), forward_stall_s=self.forward_stall_s,
                    actor_name=ctx.get_actor_name(), gpu_ids=gpu_ids, ready_s=round(self.ready_s, 3),
                    healthy=self._broken is None)

    async def __del__(self):  # pragma: no cover - replica shutdown
        self._gauges.stop()
        try:
            await self.batcher.close()
        finally:
            self.scorer.close()
