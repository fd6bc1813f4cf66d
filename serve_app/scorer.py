"""The scorer: one loaded Engine per process (one per GPU), used by Serve replicas and Ray Data actors.

All forward work runs on one dedicated thread (CUDA graphs and compiled graphs are not thread-safe,
and the asyncio loop must never block on the GPU). Rows are sorted by length and cut into micro-batches
whose cost (`batch_cost`: what the backend computes, padding included unless it packs) stays under one
token budget (`plan`); a CUDA out-of-memory halves the budget and retries, so no row is lost.

The budget is measured at warm-up for one of two goals: `latency` (Serve replicas: the smallest budget near
the best throughput, so batches and queues stay short) or `throughput` (offline actors: the forward's best).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model import settings
from model.sequence import Row

from .planning import batch_cost, pick_budget, plan, probe_rows

log = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 8192
MIN_BUDGET = 64
BUDGET_CANDIDATES = (4096, 8192, 16384, 32768, 65536, 131072)
# throughput: no queue to keep short, and chunks under 16384 tokens leave a large GPU idle between launches
THROUGHPUT_CANDIDATES = (16384, 32768, 65536, 131072)
THROUGHPUT_WITHIN = 0.01   # about the noise of one probe step: closer than this to the best counts as the best
GOALS = ("latency", "throughput")


POLL_ENV = "LAYA_FLEET_POLL_FORWARD"  # "0": every async forward goes through the forward thread


def is_oom(exc: BaseException) -> bool:
    """Whether an exception is a device out-of-memory (CUDA or allocator)."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:  # pragma: no cover
        pass
    return isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower()


def select_device(device: str | None = "auto") -> str:
    """The device a scorer should use: `auto`/None = CUDA when torch can use it, else CPU.

    A Ray actor with `num_gpus` gets `CUDA_VISIBLE_DEVICES` even when the GPUs are only logical (a CPU
    machine started with `--num-gpus`) or torch is a CPU build; `auto` then runs on CPU and says so.
    An explicit `cuda` that is not usable raises ValueError instead of failing later in a forward.
    """
    import torch

    want = "auto" if device in (None, "", "auto") else str(device)
    usable = torch.cuda.is_available()
    if want == "auto":
        if usable:
            return "cuda"
        if os.environ.get("CUDA_VISIBLE_DEVICES"):
            log.warning("GPUs %s assigned but torch cannot use CUDA (torch %s); scoring on CPU",
                        os.environ["CUDA_VISIBLE_DEVICES"], torch.__version__)
        return "cpu"
    if want.startswith("cuda") and not usable:
        raise ValueError("device %r requested but torch cannot use CUDA here (CUDA_VISIBLE_DEVICES=%r); "
                         "use device 'auto' or 'cpu'" % (want, os.environ.get("CUDA_VISIBLE_DEVICES")))
    return want


@dataclass
class ScorerStats:
    """Counters a scorer exposes (metrics and the offline summary read them)."""

    rows: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    forward_s: float = 0.0
    oom_retries: int = 0
    warmup_s: float = 0.0
    budget_history: list[int] = field(default_factory=list)
    budget_probe: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return dict(self.__dict__, budget_history=list(self.budget_history), budget_probe=dict(self.budget_probe))


class Scorer:
    """A checkpoint loaded on this process's device, scoring rows under a token budget."""

    def __init__(self, checkpoint: str, backend: str = "auto", device: str | None = None,
                 cache_dir: str | None = None, max_batch_tokens: int | None = None,
                 max_batch_rows: int | None = None, warmup: bool = True, backend_options: dict | None = None,
                 budget_goal: str = "latency", probe_budget: bool | None = None,
                 budget_candidates: Sequence[int] | None = None, probe_lengths: Sequence[int] | None = None,
                 cuda_graphs: bool | None = None):
        """`budget_goal`: `latency` or `throughput` (see the module docstring). `probe_budget`: measure the budget
        at warm-up (default: on CUDA, without `max_batch_tokens`); `budget_candidates` the budgets it measures
        (default by goal); `probe_lengths` row lengths of the job (a sample) the throughput probe of a packed
        backend scores instead of rows of max_len. `cuda_graphs`: whether the fast backend captures its token
        buckets' CUDA graphs at warm-up (None: the backend's default, on; other backends ignore it)."""
        if budget_goal not in GOALS:
            raise ValueError("budget_goal must be one of %s, got %r" % (GOALS, budget_goal))
        t0 = time.perf_counter()
        self.poll_forward = bool(settings.get(POLL_ENV))  # score_rows_async: launch one micro-batch and poll
        self.budget_goal = budget_goal
        self.budget_candidates = tuple(int(b) for b in budget_candidates or ()) or (
            THROUGHPUT_CANDIDATES if budget_goal == "throughput" else BUDGET_CANDIDATES)
        self.probe_lengths = [int(n) for n in probe_lengths] if probe_lengths else None
        self._explicit_budget = bool(max_batch_tokens)
        self.engine = self._load(checkpoint, backend, device, cache_dir, dict(backend_options or {}),
                                 warmup and (probe_budget is not False), probe_budget, cuda_graphs)
        self.packed = bool(self.engine.backend.packed)
        self.max_batch_rows = max_batch_rows
        self.stats = ScorerStats()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="laya-forward")
        self.poll_on_cpu = False  # tests: take the polled path on CPU too (a CPU launch has finished when queued)
        self._budget_lock = threading.Lock()
        self._probe = ((self.engine.device.type == "cuda" if probe_budget is None else bool(probe_budget))
                       and not self._explicit_budget)
        self.budget = int(max_batch_tokens) if max_batch_tokens else self._default_budget()
        self.stats.budget_history.append(self.budget)
        self.load_s = time.perf_counter() - t0
        kernels = getattr(getattr(self.engine.backend, "stats", None), "compile_s", None)
        self.timings: dict[str, float | None] = {"load_s": self.load_s, "kernels_s": kernels, "probe_s": 0.0,
                                                 "warmup_s": 0.0, "capture_s": None}
        if warmup:
            self.stats.warmup_s = self._executor.submit(self._warmup).result()
        self.ready_s = time.perf_counter() - t0
        log.info("scorer ready: %s backend on %s, budget %d tokens, load %.1fs, warm-up %.1fs",
                 self.engine.backend_name, self.engine.device, self.budget, self.load_s, self.stats.warmup_s)

    def _load(self, checkpoint: str, backend: str, device: str | None, cache_dir: str | None, options: dict,
              may_probe: bool, probe: bool | None, cuda_graphs: bool | None):
        """`model.load`; a throughput probe on the fast backend first sizes its buffers for the largest candidate
        (otherwise every candidate above its default chunk would measure that chunk), halving it on OOM."""
        import model
        from model.backends import ALIASES
        from model.engine import resolve_device

        name = ALIASES.get(backend, backend)
        dev = resolve_device(device)
        fast = name == "fast" or (name == "auto" and dev.type == "cuda")
        if fast and cuda_graphs is not None:
            options.setdefault("use_graphs", bool(cuda_graphs))
        sized = (self.budget_goal == "throughput" and fast and may_probe and not self._explicit_budget
                 and "max_batch_tokens" not in options and (probe or (probe is None and dev.type == "cuda")))
        if sized:
            options["max_batch_tokens"] = max(self.budget_candidates)
        while True:
            try:
                # an explicit cache_dir wins over $LAYA_FLEET_CACHE_DIR (model.load falls back to the variable)
                return model.load(checkpoint, device=device, backend=backend, cache_dir=cache_dir, **options)
            except Exception as e:
                if not (sized and is_oom(e)) or options["max_batch_tokens"] <= min(self.budget_candidates):
                    raise
            # outside the except block, so the traceback no longer holds the failed engine's tensors
            gc.collect()
            self._release_memory()
            options["max_batch_tokens"] //= 2
            log.warning("out of memory sizing the fast backend; trying %d tokens", options["max_batch_tokens"])

    # -- facts --------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """The device this scorer runs on, as text."""
        return str(self.engine.device)

    @property
    def gpu_lock(self):
        """The backend's cross-process GPU lock (model/backends/gpu_lock.py), or None when it has none."""
        return getattr(getattr(self.engine.backend, "engine", None), "gpu_lock", None)

    def gpu_lock_counts(self) -> dict[str, Any] | None:
        """The GPU lock's file and this process's counters: acquisitions, waits (acquisitions that found another
        process holding it), seconds waited and seconds held; None without a lock."""
        lock = self.gpu_lock
        if lock is None:
            return None
        return {"path": lock.path, "acquisitions": lock.acquisitions, "waits": lock.waits,
                "wait_s": round(lock.wait_s, 6), "held_s": round(lock.held_s, 6)}

    def info(self) -> dict[str, Any]:
        """What this scorer is: backend, device, budget, timings, counters, visible GPUs, GPU lock counters."""
        return {"backend": self.engine.backend_name, "device": self.device, "budget": self.budget,
                "gpu_lock": self.gpu_lock_counts(),
                "budget_goal": self.budget_goal, "load_s": round(self.load_s, 3), "ready_s": round(self.ready_s, 3),
                "startup": {k: None if v is None else round(v, 3) for k, v in self.timings.items()},
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
                "stats": self.stats.as_dict(), "cache": self._cache_report()}

    def _cache_report(self) -> dict[str, Any] | None:
        """Where this process's compiler caches are and what was seeded from / published to the shared one."""
        session = getattr(self.engine, "cache", None)
        return session.report() if session is not None else None

    def _default_budget(self) -> int:
        if self.engine.device.type != "cuda":
            return DEFAULT_CPU_BUDGET
        return 65536

    def _warmup(self) -> float:
        t = time.perf_counter()
        if self._probe:
            self.budget = self._choose_budget()
            self.stats.budget_history.append(self.budget)
        t_probe = time.perf_counter()
        self.engine.warmup(self.budget)
        t_end = time.perf_counter()
        be = self.engine.backend
        capture = getattr(getattr(be, "stats", None), "warmup_s", None)
        if not isinstance(capture, (int, float)):
            capture = getattr(be, "warmup_s", None)
        self.timings.update(probe_s=t_probe - t, warmup_s=t_end - t_probe,
                            capture_s=float(capture) if isinstance(capture, (int, float)) else None)
        return t_end - t

    def _choose_budget(self) -> int:
        """The budget `pick_budget` chooses from throughput measured over the candidates that fit.

        `latency`: candidates in increasing order until one runs out of memory, peaks above 80% of the device or
        falls 10% below the best so far (a small or noisy step does not stop the search); the smallest budget
        within 5% of the best keeps batches, and so queueing latency, short when a bigger one would not pay.
        `throughput`: candidates in decreasing order (the graph pool is sized once), each scored as calls of two
        chunks of `probe_lengths` rows on a backend that cuts its own chunks, as an offline call runs; an
        out-of-memory skips to the next smaller; the smallest within noise (1%) of the best is the forward's best,
        and the search stops at the first budget below that.
        """
        throughput = self.budget_goal == "throughput"
        chunked = self.engine.backend.chunk_tokens is not None
        cap = self.engine.backend.chunk_tokens if chunked else None
        cuda, dev = self._cuda(), self.engine.device
        total = cuda.get_device_properties(dev).total_memory if cuda else None
        measured: list[tuple[int, float]] = []
        for budget in sorted(self.budget_candidates, reverse=throughput):
            if throughput and cap is not None and budget > cap:
                continue  # chunks are cut at the backend's buffers: this budget would measure a smaller one
            try:
                if cuda:
                    cuda.reset_peak_memory_stats(dev)
                tps = self._probe_rate(budget, throughput and chunked)
                peak = cuda.max_memory_allocated(dev) if cuda else None
            except Exception as e:
                if not is_oom(e):
                    raise
                self._release_memory()
                if throughput:
                    continue
                break
            log.info("budget %d: %.0f tokens/s, peak %s", budget, tps,
                     "%.1f GiB" % (peak / 2**30) if peak is not None else "n/a")
            measured.append((budget, tps))
            near_limit = bool(peak and total and peak > 0.8 * total)
            best = max(t for _, t in measured)
            if tps < 0.9 * best or (near_limit and not throughput):
                break  # past the peak, or near the memory limit: further budgets only cost warm-up time
            if throughput and tps < (1.0 - THROUGHPUT_WITHIN) * best:
                break  # smaller chunks only leave the GPU idler: none of them would be picked
        self.stats.budget_probe = {str(b): round(t) for b, t in measured}
        return pick_budget(measured, MIN_BUDGET * 8, THROUGHPUT_WITHIN if throughput else 0.05)

    def _probe_rate(self, budget: int, chunked: bool) -> float:
        """Tokens/s of the forward at `budget`: one untimed call (compile, capture, allocate), then timed calls."""
        L = self.engine.bundle.max_len
        pad = self.engine.builder.pad_id
        if chunked:  # two chunks a call: staging the second overlaps the first, as in an offline call
            rows = probe_rows(self.probe_lengths or [L], 2 * budget, pad, arrays=self.packed)

            def call():
                return self.engine.score(rows, max_tokens=budget)
            reps = 2
        else:  # one micro-batch of full rows: the padded batch the budget admits
            rows = [Row([pad] * L, [1, 2, 3], 0) for _ in range(max(1, budget // L))]

            def call():
                return self.engine.score(rows)
            reps = 3
        tokens = sum(len(r) for r in rows)
        cuda = self._cuda()
        call()
        if cuda:
            cuda.synchronize(self.engine.device)
        n, t = 0, time.perf_counter()
        while n < reps or time.perf_counter() - t < 0.2:
            call()
            n += 1
        if cuda:
            cuda.synchronize(self.engine.device)
        return n * tokens / (time.perf_counter() - t)

    def _cuda(self):
        """`torch.cuda` when this scorer runs on CUDA (memory stats, synchronize), else None."""
        if self.engine.device.type != "cuda":
            return None
        import torch

        return torch.cuda

    # -- budget -------------------------------------------------------------------------------
    def set_budget(self, tokens: int) -> None:
        """Change the token budget (from `reconfigure`); takes effect on the next micro-batch."""
        if tokens < MIN_BUDGET:
            raise ValueError("max_batch_tokens must be at least %d, got %r" % (MIN_BUDGET, tokens))
        with self._budget_lock:
            self.budget = int(tokens)
            self.stats.budget_history.append(self.budget)

    def _halve_budget(self, failed_cost: int) -> int:
        with self._budget_lock:
            self.budget = max(MIN_BUDGET, min(self.budget, failed_cost) // 2)
            self.stats.budget_history.append(self.budget)
            self.stats.oom_retries += 1
            return self.budget

    # -- scoring ------------------------------------------------------------------------------
    def score_rows(self, rows: Sequence[Row]) -> tuple[np.ndarray, np.ndarray]:
        """Score rows on the forward thread and return (logits [N, kmax], P(action 0) [N]) in input order."""
        return self._executor.submit(self._score_rows, list(rows)).result()

    async def score_rows_async(self, rows: Sequence[Row]) -> tuple[np.ndarray, np.ndarray]:
        """`score_rows` without blocking the event loop.

        Rows that make one micro-batch on a backend that can queue its forward without waiting (the fast
        backend) are launched from the event loop, which then polls for the result between its other callbacks:
        a lone request wakes no forward thread and the loop is woken by nobody (each hand-off costs a thread
        wake-up from idle, 0.3 ms a round trip on an H200 host). Everything else runs on the forward thread."""
        rows = list(rows)
        out = await self._score_polled(rows)
        if out is not None:
            return out
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._score_rows, rows)

    async def _score_polled(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray] | None:
        """`_score_rows(rows)` launched here and polled, or None (nothing run) when it cannot be: more than one
        micro-batch, a backend that cannot queue, a forward already running, or any error while queueing (the
        forward thread's path then runs the rows and meets the error with its own handling)."""
        if not rows or not self.poll_forward or (self.engine.device.type != "cuda" and not self.poll_on_cpu):
            return None
        pending = plan([len(r) for r in rows], self.budget, self.packed, self.max_batch_rows)
        if len(pending) != 1:
            return None
        (order,) = pending
        sub = [rows[i] for i in order]
        t = time.perf_counter()
        try:
            launched = self.engine.launch(sub)
        except Exception:  # noqa: BLE001 - out of memory or bad rows: the forward thread's path handles them
            return None
        if launched is None:
            return None
        try:
            while not launched.ready():
                await asyncio.sleep(0)  # one pass of the loop: its sockets and other callbacks, then look again
        finally:  # also when cancelled: the launch holds the forward's lock until collected
            lg, ap = launched.collect()
        self.stats.forward_s += time.perf_counter() - t
        self._count([len(r) for r in sub])
        kmax = max((len(r.markers) for r in rows), default=1)
        logits = np.full((len(rows), kmax), -1e4, dtype=np.float32)
        act = np.zeros(len(rows), dtype=np.float32)
        logits[order, :lg.shape[1]] = lg[:, :kmax]
        act[order] = ap
        return logits, act

    def _score_rows(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray]:
        n = len(rows)
        kmax = max((len(r.markers) for r in rows), default=1)
        logits = np.full((n, kmax), -1e4, dtype=np.float32)
        act = np.zeros(n, dtype=np.float32)
        pending = plan([len(r) for r in rows], self.budget, self.packed, self.max_batch_rows)
        # a row cap (max_batch_rows) binds micro-batches only: the backend's chunks count tokens, so under a cap
        # each micro-batch keeps its own call
        chunking = self.engine.backend.chunk_tokens is not None and not self.max_batch_rows
        if len(pending) > 1 and chunking and self._score_in_one_call(rows, pending, logits, act):
            return logits, act
        while pending:
            idx = pending.pop(0)
            sub = [rows[i] for i in idx]
            lengths = [len(r) for r in sub]
            cost = batch_cost(lengths, self.packed)
            t = time.perf_counter()
            try:
                lg, ap = self.engine.score(sub)
            except Exception as e:
                if not is_oom(e):
                    raise
                self._release_memory()
                if len(sub) == 1:
                    if self.budget <= MIN_BUDGET:
                        raise
                    self._halve_budget(cost)
                    pending.insert(0, idx)  # retry alone after freeing memory
                    continue
                budget = self._halve_budget(cost)
                log.warning("out of memory on %d rows / %d tokens; token budget now %d", len(sub), cost, budget)
                pending[:0] = [[idx[j] for j in b] for b in plan(lengths, budget, self.packed, self.max_batch_rows)]
                continue
            self.stats.forward_s += time.perf_counter() - t
            self._count(lengths)
            logits[idx, :lg.shape[1]] = lg[:, :kmax]
            act[idx] = ap
        return logits, act

    def _score_in_one_call(self, rows: list[Row], pending: list[list[int]], logits: np.ndarray,
                           act: np.ndarray) -> bool:
        """Every micro-batch in one call of a backend that cuts its own chunks (at most the budget each) and
        pipelines them: the fast backend stages chunk k + 1 on the host while the GPU runs chunk k, where one call
        a micro-batch leaves the GPU idle while each is staged and read back. Fills logits / act in input order
        and returns True; False after an out-of-memory error (the caller then goes micro-batch by micro-batch,
        halving the budget as usual)."""
        order = [i for b in pending for i in b]
        t = time.perf_counter()
        try:
            lg, ap = self.engine.score([rows[i] for i in order], max_tokens=self.budget)
        except Exception as e:
            if not is_oom(e):
                raise
            self._release_memory()
            return False
        self.stats.forward_s += time.perf_counter() - t
        for b in pending:
            self._count([len(rows[i]) for i in b])
        kmax = logits.shape[1]
        logits[order, :lg.shape[1]] = lg[:, :kmax]
        act[order] = ap
        return True

    def _count(self, lengths: list[int]) -> None:
        """Add one scored micro-batch of rows of these lengths to the counters."""
        self.stats.batches += 1
        self.stats.rows += len(lengths)
        self.stats.tokens += sum(lengths)
        self.stats.padded_tokens += len(lengths) * max(lengths)

    def _release_memory(self) -> None:
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - best effort
            pass

    def close(self) -> None:
        """Stop the forward thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)
