"""What every section of bench/fast_path.py shares: the repository root, this run's proposed tuning table, the
device, the time budget, progress logging and the wall-clock and GPU timers."""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRY = os.path.join(ROOT, "bench", "fast_path.py")   # the script; the attention sweep runs it as its child
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, the MFU denominator
T0 = time.perf_counter()
DEVICE = "cuda"   # bench/fast_path.py sets it from --device before any section runs
_PROPOSAL: dict = {}   # {"table": kernels.tuning.Tuning}: this run's winners over the committed table


def proposal():
    """The tuning table this run proposes: the committed one plus every winner measured so far."""
    from kernels.tuning import TABLE

    return _PROPOSAL.setdefault("table", TABLE)


def propose(op: str, key: str, cfg) -> None:
    """Record a measured winner in this run's proposed table (the engines built after it run it)."""
    _PROPOSAL["table"] = proposal().with_entry(op, key, cfg)



def log(msg: str) -> None:
    """Progress to stderr (the table goes to stdout last)."""
    print("[%7.1fs] %s" % (time.perf_counter() - T0, msg), file=sys.stderr, flush=True)



class Budget:
    """A wall-clock budget for the whole run; sections check `left()` before starting."""

    def __init__(self, seconds: float):
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        """Seconds remaining."""
        return self.end - time.perf_counter()


def timed(fn, warm: int = 3, iters: int = 20, max_s: float = 8.0) -> dict:
    """Median / p90 wall milliseconds of fn() (which must return host data, i.e. synchronise)."""
    for _ in range(warm):
        fn()
    ts = []
    t_end = time.perf_counter() + max_s
    while len(ts) < iters and (len(ts) < 3 or time.perf_counter() < t_end):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    ts.sort()
    return {"ms": statistics.median(ts), "p90_ms": ts[int(0.9 * (len(ts) - 1))], "n": len(ts)}


def bench_gpu(fn, reps: int = 30) -> float:
    """Median milliseconds of a GPU callable (CUDA events, after warm-up)."""
    import torch

    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    except ImportError:
        pass
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)
