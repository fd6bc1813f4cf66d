"""The scorer: one loaded Engine per process (one per GPU), used by Serve replicas and Ray Data actors.

All forward work runs on one dedicated thread (CUDA graphs and compiled graphs are not thread-safe,
and the asyncio loop must never block on the GPU). Rows are sorted by length and cut into micro-batches
whose cost (`batch_cost`: what the backend computes, padding included unless it packs) stays under one
token budget (`plan`); a CUDA out-of-memory halves the budget and retries, so no row is lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from model.sequence import Row

log = logging.getLogger(__name__)

DEFAULT_CPU_BUDGET = 8192
MIN_BUDGET = 64
BUDGET_CANDIDATES = (4096, 8192, 16384, 32768, 65536, 131072)


def batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a backend computes for rows of these lengths (padding included unless packed)."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def plan(lengths: Sequence[int], max_batch_tokens: int, packed: bool = False,
         max_rows: int | None = None) -> list[list[int]]:
    """Indices of rows grouped into micro-batches, longest rows first, each under the budget.

    A row longer than the budget on its own still gets a micro-batch (of one): nothing is dropped.
    Every index appears exactly once.
    """
    if max_batch_tokens < 1:
        raise ValueError("max_batch_tokens must be positive, got %r" % max_batch_tokens)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_sum = cur_max = 0
    for i in order:
        n = lengths[i]
        new_sum, new_max = cur_sum + n, max(cur_max, n)
        cost = new_sum if packed else (len(cur) + 1) * new_max   # batch_cost of cur + [i], kept running
        if cur and (cost > max_batch_tokens or (max_rows and len(cur) >= max_rows)):
            batches.append(cur)
            cur, new_sum, new_max = [], n, n
        cur.append(i)
        cur_sum, cur_max = new_sum, new_max
    if cur:
        batches.append(cur)
    return batches


def pick_budget(measured: list[tuple[int, float]], fallback: int, within: float = 0.05) -> int:
    """The smallest budget whose tokens/s is within `within` of the best of `measured` [(budget, tokens/s)]."""
    if not measured:
        return fallback
    best = max(t for _, t in measured)
    return min(b for b, t in measured if t >= (1.0 - within) * best)


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
                 max_batch_rows: int | None = None, warmup: bool = True, backend_options: dict | None = None):
        import model

        t0 = time.perf_counter()
        # an explicit cache_dir wins over $LAYA_FLEET_CACHE_DIR (model.load falls back to the variable)
        self.engine = model.load(checkpoint, device=device, backend=backend, cache_dir=cache_dir,
                                 **(backend_options or {}))
        self.packed = bool(self.engine.backend.packed)
        self.max_batch_rows = max_batch_rows
        self.stats = ScorerStats()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="laya-forward")
        self._budget_lock = threading.Lock()
        self._explicit_budget = bool(max_batch_tokens)
        self.budget = int(max_batch_tokens) if max_batch_tokens else self._default_budget()
        self.stats.budget_history.append(self.budget)
        self.load_s = time.perf_counter() - t0
        if warmup:
            self.stats.warmup_s = self._executor.submit(self._warmup).result()
        self.ready_s = time.perf_counter() - t0
        log.info("scorer ready: %s backend on %s, budget %d tokens, load %.1fs, warm-up %.1fs",
                 self.engine.backend_name, self.engine.device, self.budget, self.load_s, self.stats.warmup_s)

    # -- facts --------------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """The device this scorer runs on, as text."""
        return str(self.engine.device)

    def info(self) -> dict[str, Any]:
        """What this scorer is: backend, device, budget, timings, counters, visible GPUs."""
        return {"backend": self.engine.backend_name, "device": self.device, "budget": self.budget,
                "load_s": round(self.load_s, 3), "ready_s": round(self.ready_s, 3),
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
        if self.engine.device.type == "cuda" and not self._explicit_budget:
            self.budget = self._choose_budget()
            self.stats.budget_history.append(self.budget)
        self.engine.warmup(self.budget)
        return time.perf_counter() - t

    def _choose_budget(self) -> int:
        """The smallest budget within 5% of the best throughput measured over every budget that fits.

        Candidates are measured (a small or noisy step does not stop the search) until one runs out of
        memory, peaks above 80% of the device or falls 10% below the best so far; the smallest budget close
        to the best keeps batches, and so queueing latency, short when a bigger one would not pay.
        """
        import torch

        L = self.engine.bundle.max_len
        pad = self.engine.builder.pad_id
        total = torch.cuda.get_device_properties(self.engine.device).total_memory
        measured: list[tuple[int, float]] = []
        for budget in BUDGET_CANDIDATES:
            rows = [Row([pad] * L, [1, 2, 3], 0) for _ in range(max(1, budget // L))]
            try:
                torch.cuda.reset_peak_memory_stats()
                self.engine.score(rows)  # compile / allocate
                torch.cuda.synchronize()
                n, t = 0, time.perf_counter()
                while n < 3 or time.perf_counter() - t < 0.2:
                    self.engine.score(rows)
                    n += 1
                torch.cuda.synchronize()
                tps = n * len(rows) * L / (time.perf_counter() - t)
                peak = torch.cuda.max_memory_allocated()
            except Exception as e:
                if not is_oom(e):
                    raise
                self._release_memory()
                break
            log.info("budget %d: %.0f tokens/s, peak %.1f GiB", budget, tps, peak / 2**30)
            measured.append((budget, tps))
            if peak > 0.8 * total or tps < 0.9 * max(t for _, t in measured):
                break  # near the memory limit, or clearly past the peak: larger budgets only cost warm-up time
        self.stats.budget_probe = {str(b): round(t) for b, t in measured}
        return pick_budget(measured, MIN_BUDGET * 8)

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
        """`score_rows` without blocking the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._score_rows, list(rows))

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
