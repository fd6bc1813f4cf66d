"""Where the small GEMM tiles should end: the fast forward's time per token bucket with the small tiles and with
the large-M kernels, on the same rows, and the `small_m` (kernels/tuning.json) that picks the faster per bucket.

Token buckets up to `small_m` rows run 64 x 64 tiles (many blocks for few tokens); larger ones the persistent
warp-specialised kernels with 128-row tiles, which leave most SMs idle at a few hundred tokens. Rows are the
serving benchmark's request (1 state x the 3 questions of configs/example_questions.json), repeated to each size.
Prints a table and the proposed small_m, writes JSON and a PNG beside it.

    python3 bench/small_tiles.py --checkpoint /tmp/ck_large --out $OUT/small_tiles.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.lone_request import QUESTIONS, STATE  # noqa: E402

REQUESTS = (1, 2, 3, 4, 6, 8, 11, 16, 22, 32)   # 1 state x 3 questions each: about 280 to 9,000 tokens


def time_forward(eng, rows, reps: int = 40) -> float:
    """Median ms of the backend forward over rows (it returns host arrays: synchronised)."""
    for _ in range(3):
        eng.backend.forward(rows)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        eng.backend.forward(rows)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--requests", default=",".join(map(str, REQUESTS)), help="request counts per batch")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "small_tiles.json"))
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the fast path's torch ops")
    a = p.parse_args(argv)

    import model
    from kernels.tuning import TABLE

    counts = [int(x) for x in a.requests.split(",")]
    qs = json.load(open(QUESTIONS))
    res = {"checkpoint": a.checkpoint, "commit": os.environ.get("LAYA_FLEET_COMMIT"),
           "shipped_small_m": TABLE.small_m, "rows": []}
    engines = {}
    for name, small_m in (("small tiles", 1 << 16), ("large-M kernels", 64)):
        t = time.perf_counter()
        extra = {"ops": "torch"} if a.device == "cpu" else {}
        cap = 16384 if a.device != "cpu" else 2048
        eng = model.load(a.checkpoint, device=a.device, backend="fast", max_batch_tokens=cap,
                         tuning=dataclasses.replace(TABLE, small_m=small_m), **extra)
        eng.warmup(cap)
        engines[name] = eng
        print("%s: loaded and warmed in %.1f s" % (name, time.perf_counter() - t), flush=True)
    one = [r for enc in engines["small tiles"].encode_many([STATE], engines["small tiles"].prepare(qs))
           for r in enc.rows]
    for n in counts:
        rows = one * n
        tokens = sum(len(r) for r in rows)
        bucket = engines["small tiles"].backend.engine.bucket_for(tokens, len(rows))
        ms = {name: time_forward(eng, rows) for name, eng in engines.items()}
        row = {"requests": n, "rows": len(rows), "tokens": tokens, "bucket": bucket, **ms}
        res["rows"].append(row)
        print("%2d requests, %5d tokens (bucket %5d): small %.3f ms, large %.3f ms" % (
            n, tokens, bucket, ms["small tiles"], ms["large-M kernels"]), flush=True)
    # the proposal: the largest bucket up to which the small tiles are never slower
    small_m = 0
    for r in res["rows"]:
        if r["small tiles"] <= r["large-M kernels"]:
            small_m = r["bucket"]
        else:
            break
    res["proposed_small_m"] = max(64, small_m)
    print(table(res))
    print('proposed kernels/tuning.json: "small_m": %d (shipped %d)' % (res["proposed_small_m"], TABLE.small_m))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    return 0


def table(res: dict) -> str:
    lines = ["| requests | tokens | bucket | small tiles ms | large-M kernels ms | large / small |",
             "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        small, large = r["small tiles"], r["large-M kernels"]
        lines.append("| %d | %d | %d | %.3f | %.3f | %.2f |" % (r["requests"], r["tokens"], r["bucket"], small, large,
                                                                large / small))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = [r["tokens"] for r in res["rows"]]
    for name in ("small tiles", "large-M kernels"):
        ax.plot(x, [r[name] for r in res["rows"]], marker="o", label=name)
    ax.axvline(res["proposed_small_m"], color="grey", ls="--", label="proposed small_m %d" % res["proposed_small_m"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the batch")
    ax.set_ylabel("forward ms (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
