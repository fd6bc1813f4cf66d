"""Where one fast 10 x 3 @ 512 call (10 states of 700 words x 3 questions, 30 rows, 15360 tokens) spends its time,
step by step: tokenising (long states whole, and in pieces: model/sequence.py), building rows, the host staging,
the H2D copy, the encoder graph, the tail, the copy back and the wait, each on the host clock and on CUDA events;
then `predict_batch` end to end with and without tokenising in pieces. Prints a table last, writes JSON and draws
a bar chart next to it.

    python3 bench/latency_probe.py --make modernbert-large --ckpt /tmp/ck --out $OUT/latency_probe.json
    python3 bench/latency_probe.py --replot results.json     # the chart again from a saved run

LAYA_FLEET_COMMIT=<hash> sets the commit the JSON records (the GPU machine's copy can carry stale git metadata).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def med(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


REPS = 30


def med_ms(fn, n: int | None = None) -> float:
    """Median wall time of fn in ms over n (default REPS) calls after two warm calls."""
    n = n or REPS
    fn()
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * med(ts)


def timeline(ff, rows, reps: int = 30) -> dict:
    """One chunk's forward as `FastForward._launch_chunk` + `_collect` run it, with a host stamp after each step and
    CUDA events around each GPU step; medians in ms."""
    import numpy as np
    import torch

    from kernels.forward import _pow2

    host: dict[str, list[float]] = {}
    gpu: dict[str, list[float]] = {}

    def note(d, k, v):
        d.setdefault(k, []).append(v)

    with ff._lock, torch.no_grad():
        for _ in range(reps + 2):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
            t = [time.perf_counter()]
            ff._check(rows)
            n, total = len(rows), sum(len(r.ids) for r in rows)
            Tb = ff.bucket_for(total, n)
            ints_host, tail_host = ff._slots[0]
            t.append(time.perf_counter())
            cu, gb = ff._stage(rows, Tb, ints_host)
            t.append(time.perf_counter())
            size = ff._int_size(Tb)
            ev[0].record()
            ff._ints[:size].copy_(ints_host[:size], non_blocking=True)
            ev[1].record()
            t.append(time.perf_counter())
            ff._encoder(Tb, gb)
            ev[2].record()
            t.append(time.perf_counter())
            kmax = max(len(r.markers) for r in rows)
            nb, kb = _pow2(n), _pow2(kmax, 2)
            m = nb * (kb + 1)
            ff._stage_tail(rows, cu, nb, kb, tail_host.numpy())
            ff._tail[:m].copy_(tail_host[:m], non_blocking=True)
            res = ff._tail_run(nb, kb)
            ev[3].record()
            t.append(time.perf_counter())
            out = torch.empty((n, res.shape[1]), dtype=res.dtype, pin_memory=True)
            out.copy_(res[:n], non_blocking=True)
            ev[4].record()
            t.append(time.perf_counter())
            ev[4].synchronize()
            t.append(time.perf_counter())
            o = out.numpy()
            np.ascontiguousarray(o[:, :kmax]), np.ascontiguousarray(o[:, kb])
            t.append(time.perf_counter())
            names = ["check+bucket", "stage", "h2d enqueue", "graph launch (cpu)", "tail stage+launch",
                     "out alloc+copy enqueue", "wait for gpu", "unpack"]
            for k, a, b in zip(names, t, t[1:]):
                note(host, k, 1e3 * (b - a))
            note(host, "total", 1e3 * (t[-1] - t[0]))
            for k, (a, b) in zip(["h2d", "encoder graph", "tail", "d2h"], zip(ev, ev[1:])):
                note(gpu, k, a.elapsed_time(b))
            note(gpu, "total (h2d..d2h)", ev[0].elapsed_time(ev[4]))
    cut = lambda d: {k: med(v[2:]) for k, v in d.items()}  # noqa: E731 - the first two calls warm up
    return {"host_ms": cut(host), "gpu_ms": cut(gpu), "bucket": Tb, "tokens": total, "rows": n}


def pipelined(eng, states, prep, first: int):
    """predict_batch's work with the first `first` states' rows on the GPU while the rest are tokenized: two chunks
    through FastForward's launch/collect (an experiment: the engine runs one chunk)."""
    ff = eng.backend.engine
    enc_a = eng.encode_many(states[:first], prep)
    rows_a = [r for e in enc_a for r in e.rows]
    ff._check(rows_a)
    with ff._lock:
        pa = ff._launch_chunk(rows_a, 0)
        enc_b = eng.encode_many(states[first:], prep)
        rows_b = [r for e in enc_b for r in e.rows]
        ff._check(rows_b)
        pb = ff._launch_chunk(rows_b, 1)
        parts = [ff._collect(pa), ff._collect(pb)]
    out = []
    for encs, (lg, p0) in zip((enc_a, enc_b), parts):
        for i, e in enumerate(encs):
            out.append(eng.decode(prep, e, lg[3 * i:3 * i + 3], p0[3 * i:3 * i + 3]))
    return out


def plot(res: dict, path: str) -> bool:
    """Bars: the host steps of one forward, the GPU steps, and end to end with/without pieces; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    items = [("host: " + k, v) for k, v in res["forward"]["host_ms"].items()]
    items += [("gpu: " + k, v) for k, v in res["forward"]["gpu_ms"].items()]
    items += list(res["ms"].items())
    fig, ax = plt.subplots(figsize=(9, 0.34 * len(items) + 1.2))
    ax.barh([k for k, _ in items][::-1], [v for _, v in items][::-1])
    ax.set_xlabel("ms (median)")
    ax.set_title("fast 10 x 3 @ 512: %d rows, %d tokens, %s, %d CPUs" % (
        res["forward"]["rows"], res["forward"]["tokens"], res["gpu"], res["cpus"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def table(res: dict) -> str:
    lines = ["%-44s %9s" % ("step", "ms")]
    for k, v in res["ms"].items():
        lines.append("%-44s %9.3f" % (k, v))
    for k, v in res["forward"]["host_ms"].items():
        lines.append("%-44s %9.3f" % ("forward host: " + k, v))
    for k, v in res["forward"]["gpu_ms"].items():
        lines.append("%-44s %9.3f" % ("forward gpu: " + k, v))
    return "\n".join(lines)


def main(argv=None) -> int:
    """CLI entry point; returns the exit status."""
    global REPS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ckpt", default="/tmp/ck")
    ap.add_argument("--make", default=None, help="make-checkpoint shape to build at --ckpt first")
    ap.add_argument("--out", default=None)
    ap.add_argument("--replot", default=None)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (no forward timeline)")
    ap.add_argument("--max-batch-tokens", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=REPS, help="timed calls per measurement (median)")
    ap.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads first (0: torch's default)")
    a = ap.parse_args(argv)
    if a.replot:
        with open(a.replot) as fh:
            res = json.load(fh)
        print(table(res))
        png = a.replot[:-5] + ".png"
        print("wrote %s" % png if plot(res, png) else "matplotlib missing")
        return 0
    REPS = a.reps
    import fast_path as FP
    import tokenizers
    import torch

    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    if a.make and not os.path.isdir(a.ckpt):
        from model.make_checkpoint import make_checkpoint

        make_checkpoint(a.ckpt, a.make, seed=0)
    eng, info = FP.make_engines(a.ckpt, ["fast"], a.max_batch_tokens, device=a.device)["fast"]
    states, qs = FP.workloads()["10x3@512"]
    prep = eng.prepare(qs)
    b = eng.builder
    pieces = b.piece_chars
    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (dry run)"
    res: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "cpus": b.cores,
                 "torch_threads": torch.get_num_threads(),
                 "tokenizers": tokenizers.__version__, "piece_chars": pieces,
                 "piece_length": b.piece_length([b._clean(s) for s in states]),
                 # LAYA_FLEET_COMMIT first: the GPU machine's copy of the checkout can carry stale git metadata
                 "commit": os.environ.get("LAYA_FLEET_COMMIT") or subprocess.run(
                     ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                     text=True).stdout.strip() or None, "ms": {}}
    ms = res["ms"]
    rows = [r for e in eng.encode_many(states, prep) for r in e.rows]
    for label, pc in (("whole", 0), ("pieces", pieces)):
        b.piece_chars = pc
        ms["tokenize 10 states (%s)" % label] = med_ms(lambda: b.states_ids(states))
        ms["encode_many (%s)" % label] = med_ms(lambda: eng.encode_many(states, prep))
        ms["predict_batch e2e (%s)" % label] = med_ms(lambda: eng.predict_batch(states, qs))
    b.piece_chars = pieces
    ids = b.states_ids(states)
    ms["rows from ids"] = med_ms(lambda: [eng.encode(s, prep, i) for s, i in zip(states, ids)])
    ms["backend.forward"] = med_ms(lambda: eng.backend.forward(rows))
    # the GPU cost of cutting the 30 rows into chunks (pipelined: the host stages chunk k + 1 during chunk k)
    if a.device == "cuda":
        for cap in (12288, 7680, 4608):
            ms["backend.forward, chunks of <= %d tokens" % cap] = med_ms(
                lambda cap=cap: eng.backend.forward(rows, max_chunk_tokens=cap))
        ref = eng.predict_batch(states, qs)
        for first in (1, 2, 3, 5):
            res.setdefault("pipelined_answers_equal", {})[first] = pipelined(eng, states, prep, first) == ref
            ms["e2e, first %d states on the GPU while the rest tokenize" % first] = med_ms(
                lambda first=first: pipelined(eng, states, prep, first))
    one = b._clean(states[0])
    for label, pc in (("whole", 0), ("pieces", pieces)):
        b.piece_chars = pc
        ms["tokenize 1 state (%s)" % label] = med_ms(lambda: b.state_ids(states[0]))
        ms["predict 1 long state x 3 (%s)" % label] = med_ms(lambda: eng.predict(states[0], qs))
    b.piece_chars = pieces
    res["one_state_chars"] = len(one)
    logits, p0 = eng.backend.forward(rows)
    encs = eng.encode_many(states, prep)
    ms["decode 10 states"] = med_ms(lambda: [eng.decode(prep, e, logits[3 * i:3 * i + 3], p0[3 * i:3 * i + 3])
                                             for i, e in enumerate(encs)])
    res["forward"] = timeline(eng.backend.engine, rows, REPS) if a.device == "cuda" else \
        {"host_ms": {}, "gpu_ms": {}, "rows": len(rows), "tokens": sum(len(r) for r in rows)}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
        plot(res, a.out[:-5] + ".png")
    print(json.dumps({k: v for k, v in res.items() if k not in ("ms", "forward")}))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
