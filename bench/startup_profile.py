"""Where an offline scorer's start-up goes inside one process: imports, load, budget probe, warm-up, by function.

    python3 bench/startup_profile.py --checkpoint /tmp/ck_large --out $OUT/startup_profile.json

Runs what an offline GPU scorer actor runs (`Scorer` with the throughput goal, the probe on rows of the lengths
bench/offline.py draws, no CUDA graphs) in this fresh process under cProfile, after timing the imports on their
own. Prints the pieces and the functions with the most cumulative time under each, writes JSON and a PNG of the
pieces. Run it twice in one call: the second run is the one with every cache (page cache, kernels) warm.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time

T_PROCESS = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def top(prof: cProfile.Profile, n: int) -> list[dict]:
    """The n functions with the most cumulative time, as rows."""
    st = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (fn, line, name), (_cc, nc, tt, ct, _callers) in st.stats.items():
        if fn.startswith("<frozen"):   # the import machinery: every import's time again under one name
            continue
        rows.append({"function": "%s:%d(%s)" % (os.path.relpath(fn, ROOT) if fn.startswith(ROOT) else
                                                 "/".join(fn.split("/")[-2:]), line, name),
                     "calls": nc, "self_s": round(tt, 3), "cum_s": round(ct, 3)})
    rows.sort(key=lambda r: -r["cum_s"])
    return rows[:n]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    pieces: dict[str, float] = {}
    t = time.perf_counter()
    import torch  # noqa: F401

    pieces["import torch"] = time.perf_counter() - t
    t = time.perf_counter()
    from serve_app.scorer import Scorer

    pieces["import the scorer"] = time.perf_counter() - t
    t = time.perf_counter()
    try:   # the fast path imports it while loading; timed apart here (absent on a CPU machine)
        from kernels import _tl

        _tl.tl()
        pieces["import tilelang"] = time.perf_counter() - t
    except ImportError:
        pass
    import random

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from offline import _bucket  # bench/offline.py's mix of lengths; about a token a word, plus the question

    rng = random.Random(0)
    lengths = [min(512, rng.randint(*_bucket(rng.random())) + 40) for _ in range(256)]
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    sc = Scorer(args.checkpoint, backend="auto", budget_goal="throughput", probe_lengths=lengths,
                cuda_graphs=False)
    prof.disable()
    pieces["Scorer()"] = time.perf_counter() - t
    for k in ("load_s", "kernels_s", "probe_s", "warmup_s"):
        pieces["  " + k] = sc.timings.get(k) or 0.0
    pieces["process to ready"] = time.perf_counter() - T_PROCESS
    funcs = top(prof, args.top)
    print("%-28s %8s" % ("piece", "s"))
    for k, v in pieces.items():
        print("%-28s %8.3f" % (k, v))
    print("\n%8s %8s %8s  %s" % ("cum s", "self s", "calls", "function (Scorer() under cProfile)"))
    for r in funcs:
        print("%8.3f %8.3f %8d  %s" % (r["cum_s"], r["self_s"], r["calls"], r["function"]))
    # LAYA_FLEET_COMMIT first: the GPU machine's copy of the checkout can carry stale git metadata
    commit = os.environ.get("LAYA_FLEET_COMMIT") or subprocess.run(
        ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"bench": "startup_profile", "date": time.strftime("%Y-%m-%d"), "commit": commit,
           "checkpoint": args.checkpoint,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "budget": sc.budget, "budget_probe": sc.stats.budget_probe,
           "pieces_s": {k.strip(): round(v, 3) for k, v in pieces.items()}, "top": funcs}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            keys = [k for k in pieces if k not in ("Scorer()", "process to ready")]
            fig, ax = plt.subplots(figsize=(7, 3.5))
            ax.barh([k.strip() for k in keys], [pieces[k] for k in keys])
            ax.set_xlabel("seconds")
            ax.set_title("offline scorer start-up in one process (%s)" % res["device"])
            fig.tight_layout()
            fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
        except ImportError:
            pass
        print("wrote", args.out)
    sc.close()


if __name__ == "__main__":
    main()
