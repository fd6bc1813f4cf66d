"""Where the 10 x 3 workload's tokenising time goes on this host: `Engine.encode_many` for 10 states of 700 words,
timed before CUDA is touched, after a CUDA matmul, after a CPU torch op (torch's OpenMP pool awake) and with
torch's CPU threads set to 1; plus the tokenizer's batch call alone and one text alone. Prints a table last,
writes JSON and draws a bar chart next to it.

    python3 bench/tokenize_probe.py [--ckpt DIR] [--out results.json]
    python3 bench/tokenize_probe.py --replot results.json     # the chart again from a saved run
"""

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def med_ms(fn, n: int = 30, pre=None) -> float:
    """Median wall time of fn in ms over n calls after one warm call; `pre` runs untimed before each call."""
    fn()
    ts = []
    for _ in range(n):
        if pre is not None:
            pre()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[n // 2]


def plot(res: dict, path: str) -> bool:
    """A horizontal bar per measurement (ms); False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names, ms = list(res["ms"]), list(res["ms"].values())
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(names) + 1))
    ax.barh(names[::-1], ms[::-1])
    ax.set_xlabel("ms (median)")
    ax.set_title("10 states x 700 words (%d tokens), %d CPUs" % (res["tokens"], res["cpus"]), fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    """CLI entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default="/tmp/ck_tok_probe")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", default=None, help="draw the chart of a saved JSON and exit")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot, encoding="utf-8") as fh:
            return 0 if plot(json.load(fh), os.path.splitext(a.replot)[0] + ".png") else 1
    from fast_path import Q3, text

    import model
    from model.make_checkpoint import make_checkpoint

    if not os.path.isdir(a.ckpt):
        make_checkpoint(a.ckpt, a.shape, seed=0)
    eng = model.load(a.ckpt, device="cpu", backend="eager")
    rng = random.Random(0)
    states = [text(rng, 700) for _ in range(10)]
    prep = eng.prepare(Q3)
    be = eng.builder._backend
    texts = [eng.builder._clean(s) for s in states]
    rows = {}

    def encode():
        return eng.encode_many(states, prep)

    rows["encode_many, before CUDA"] = med_ms(encode)
    rows["tokenizer batch (10 texts)"] = med_ms(lambda: be.encode_batch_fast(texts, add_special_tokens=False))
    rows["tokenizer, one text"] = med_ms(lambda: be.encode_batch_fast(texts[:1], add_special_tokens=False))
    import torch

    if torch.cuda.is_available():
        x = torch.randn(4096, 4096, device="cuda")
        (x @ x).sum().item()
        rows["encode_many, after a CUDA matmul"] = med_ms(encode)
    threads = torch.get_num_threads()

    def cpu_op():
        torch.randn(256, 256) @ torch.randn(256, 256)

    rows["encode_many, right after a CPU torch op"] = med_ms(encode, pre=cpu_op)
    torch.set_num_threads(1)
    rows["encode_many, torch threads 1, after a CPU torch op"] = med_ms(encode, pre=cpu_op)
    res = {"cpus": os.cpu_count(), "torch_threads_default": threads, "ms": rows,
           "tokens": sum(len(e.ids) for e in be.encode_batch_fast(texts, add_special_tokens=False))}
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1)
        plot(res, os.path.splitext(a.out)[0] + ".png")
    print("%d CPUs, %d state tokens" % (res["cpus"], res["tokens"]))
    for k, v in rows.items():
        print("%-52s %7.3f ms" % (k, v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
