"""Where a small forward's GPU time goes: each kernel of the fast forward's CUDA-graph replay, timed by the torch
profiler (CUPTI), for a lone request's sizes (1 state x 1 question, 1 state x 3 questions, 3 such requests).

Per size: the forward's wall time (host arrays back), the span of the replay on the GPU from its first kernel's
start to its last's end, the sum of kernel times by op kind, and the idle gaps between kernels (launch latency
inside the graph). Rows are the serving benchmark's request (configs/example_questions.json). Prints a table,
writes JSON and a PNG beside it.

    python3 bench/small_profile.py --checkpoint /tmp/ck_large --out $OUT/small_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.lone_request import QUESTIONS, STATE  # noqa: E402

SIZES = (("1 x 1", 1, 1), ("1 x 3", 1, 3), ("3 x 3", 3, 3))  # (label, states, questions)


def op_order(eng, rows) -> list[str]:
    """The forward's TileLang ops in launch order (one kernel each), from one eager run with the forward's own
    op marks: every TileLang kernel is named `main_kernel`, so a replay's kernels are labelled by position."""
    import torch

    fwd = eng.backend.engine
    with fwd._lock:
        Tb = fwd.bucket_for(sum(len(r.ids) for r in rows), len(rows))
        _, g = fwd._stage(rows, Tb)
        fwd._ints[:fwd._int_size(Tb)].copy_(fwd._ints_host[:fwd._int_size(Tb)])
        fwd._prof = []
        fwd._body(Tb, g)
        torch.cuda.synchronize()
        order = [k for k, _, _ in fwd._prof]
        fwd._prof = None
    return order


def label(name: str, op: str | None) -> str:
    """A kernel's op: its TileLang op by position, else its torch kernel's kind."""
    if op is not None:
        return op.split(" window")[0].split(" full")[0]
    n = name.lower()
    if "memcpy" in n or "memset" in n:
        return "copy"
    if "index" in n or "gather" in n or "scatter" in n:
        return "gather / scatter (torch)"
    return "other (torch)"


def profile_rows(eng, rows, reps: int = 20) -> dict:
    """Kernel times of `reps` forwards of rows; medians per forward, by op."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        eng.backend.forward(rows)
    walls = []
    for _ in range(30):
        t = time.perf_counter()
        eng.backend.forward(rows)
        walls.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            eng.backend.forward(rows)
            torch.cuda.synchronize()
            time.sleep(0.002)  # a clear gap on the GPU between forwards, which groups their kernels
    events = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start]
    events.sort(key=lambda e: e.time_range.start)
    # forwards are separated by 2 ms sleeps: a gap over 1 ms starts the next forward
    groups, cur = [], []
    for e in events:
        if cur and e.time_range.start - max(x.time_range.end for x in cur) > 1000:
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    common = statistics.mode(len(g) for g in groups)
    groups = [g for g in groups if len(g) == common]  # whole forwards only
    order = op_order(eng, rows)
    spans, busy, gaps, counts, by_kind = [], [], [], [], {}
    labelled = 0
    for g in groups:
        mains = [e for e in g if "main_kernel" in e.name]
        ops = dict(zip(map(id, mains), order)) if len(mains) == len(order) else {}
        labelled += bool(ops)
        start, end = g[0].time_range.start, max(e.time_range.end for e in g)
        spans.append((end - start) / 1e3)
        b = sum(e.time_range.end - e.time_range.start for e in g) / 1e3
        busy.append(b)
        gaps.append(spans[-1] - b)
        counts.append(len(g))
        for e in g:
            op = ops.get(id(e), "tilelang" if "main_kernel" in e.name else None)
            by_kind.setdefault(label(e.name, op), []).append((e.time_range.end - e.time_range.start) / 1e3)
    n = max(1, len(groups))
    return {"wall_ms": statistics.median(walls), "gpu_span_ms": statistics.median(spans),
            "kernel_ms": statistics.median(busy), "gap_ms": statistics.median(gaps),
            "kernels": int(statistics.median(counts)), "forwards_profiled": len(groups), "forwards_labelled": labelled,
            "tilelang_ops": len(order),
            "by_kind_ms": {k: round(sum(v) / n, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))},
            "by_kind_count": {k: round(len(v) / n, 1) for k, v in by_kind.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "small_profile.json"))
    a = p.parse_args(argv)

    import model

    eng = model.load(a.checkpoint, device="cuda", backend="fast", max_batch_tokens=16384)
    eng.warmup(16384)
    qs = json.load(open(QUESTIONS))
    res = {"checkpoint": a.checkpoint, "commit": os.environ.get("LAYA_FLEET_COMMIT"), "sizes": []}
    for label, states, nq in SIZES:
        prepared = eng.prepare(dict(list(qs.items())[:nq]))
        rows = [r for enc in eng.encode_many([STATE] * states, prepared) for r in enc.rows]
        tokens = sum(len(r) for r in rows)
        bucket = eng.backend.engine.bucket_for(tokens, len(rows))
        r = dict(label=label, rows=len(rows), tokens=tokens, bucket=bucket, **profile_rows(eng, rows))
        res["sizes"].append(r)
        print("%s: %d tokens (bucket %d): wall %.3f ms, GPU span %.3f, kernels %.3f in %d, gaps %.3f; %s" % (
            label, tokens, bucket, r["wall_ms"], r["gpu_span_ms"], r["kernel_ms"], r["kernels"], r["gap_ms"],
            ", ".join("%s %.3f" % kv for kv in r["by_kind_ms"].items())), flush=True)
    print(table(res))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    return 0


def table(res: dict) -> str:
    kinds = list(dict.fromkeys(k for r in res["sizes"] for k in r["by_kind_ms"]))
    lines = ["| size | tokens (bucket) | wall ms | GPU span | kernels (count) | gaps | %s |" % " | ".join(kinds),
             "|---|---|---|---|---|---|%s" % "---|" * len(kinds)]
    for r in res["sizes"]:
        lines.append("| %s | %d (%d) | %.3f | %.3f | %.3f (%d) | %.3f | %s |" % (
            r["label"], r["tokens"], r["bucket"], r["wall_ms"], r["gpu_span_ms"], r["kernel_ms"], r["kernels"],
            r["gap_ms"], " | ".join("%.3f" % r["by_kind_ms"].get(k, 0.0) for k in kinds)))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    kinds = list(dict.fromkeys(k for r in res["sizes"] for k in r["by_kind_ms"])) + ["gaps"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(res["sizes"])
    x = [r["label"] for r in res["sizes"]]
    for k in kinds:
        v = [r["gap_ms"] if k == "gaps" else r["by_kind_ms"].get(k, 0.0) for r in res["sizes"]]
        ax.bar(x, v, bottom=bottom, label=k)
        bottom = [b + y for b, y in zip(bottom, v)]
    ax.plot(x, [r["wall_ms"] for r in res["sizes"]], "ko-", label="forward wall")
    ax.set_ylabel("ms per forward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
