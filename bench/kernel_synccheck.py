"""The fast forward's kernels under compute-sanitizer: barrier misuse that hangs only now and then.

A barrier that not every thread it counts can reach (a `__syncthreads` in one role's branch, a named barrier
with the wrong count) may pass on one run and wedge a block on another; `compute-sanitizer --tool synccheck`
reports each such barrier. This loads a checkpoint on the fast backend without CUDA graphs (each kernel is an
ordinary launch the tool can patch) and runs forwards of 1, 4 and 32 requests of 1 state x the 3 example
questions: 282 tokens (the small tiles), 1,128 and 9,024 (the hand-warp-specialised GEMMs, with and without
2-CTA clusters). Run it under the tool; it prints a table and writes JSON, and the tool's exit status says
whether it found anything:

    compute-sanitizer --tool synccheck --error-exitcode 3 --log-file $OUT/synccheck.log \
        python3 bench/kernel_synccheck.py --checkpoint /tmp/ck_large --out $OUT/kernel_synccheck.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.lone_request import QUESTIONS, STATE  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--requests", default="1,4,32", help="request counts per forward")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the fast path's torch ops")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "kernel_synccheck.json"))
    a = p.parse_args(argv)

    import model

    t = time.perf_counter()
    extra = {"ops": "torch"} if a.device == "cpu" else {}
    eng = model.load(a.checkpoint, device=a.device, backend="fast", use_graphs=False, **extra)
    load_s = time.perf_counter() - t
    one = eng.encode(STATE, eng.prepare(json.load(open(QUESTIONS)))).rows
    res = {"checkpoint": a.checkpoint, "commit": os.environ.get("LAYA_FLEET_COMMIT"), "load_s": round(load_s, 1),
           "forwards": []}
    print("| requests | tokens | seconds under the tool |")
    print("|---|---|---|")
    for n in (int(x) for x in a.requests.split(",")):
        rows = one * n
        t = time.perf_counter()
        eng.backend.forward(rows)
        s = time.perf_counter() - t
        tokens = sum(len(r) for r in rows)
        res["forwards"].append({"requests": n, "tokens": tokens, "s": round(s, 2)})
        print("| %d | %d | %.2f |" % (n, tokens, s), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
