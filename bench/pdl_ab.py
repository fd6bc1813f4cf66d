"""Programmatic dependent launch in the fast forward, by mode: `off`, `all` (every kernel of every batch) and
`small` (the shipped default: the batches of the small-tile regime, up to kernels/tuning.json's small_m tokens),
each engine with its kernels built that way (the fast backend's `pdl` option, $LAYA_FLEET_PDL), on the same rows
in one process, round by round in rotating order.

With it, each kernel of the forward's CUDA graph launches while the one before it finishes and waits for it
(griddepcontrol.wait) before touching memory, so launch and set-up overlap the previous kernel's tail; a small
forward is a chain of ~250 short kernels. Per workload of bench/fast_path.py (1 state x 1 question, 1 x 3, 10 x 3
at 512 tokens, the offline rows in one backend call): predict's and the forward's median ms, or forward tokens/s,
per round; every engine's outputs compared with the first's (the same kernels' arithmetic: they should agree
exactly); captures after warm-up. Prints a table, writes JSON and a PNG beside it.

    python3 bench/pdl_ab.py --checkpoint /tmp/ck_large --out $OUT/pdl_ab.json
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

from bench.fastpath.common import timed  # noqa: E402
from bench.fastpath.workloads import rows_of, short_words, workloads  # noqa: E402

VARIANTS = (("off", "off"), ("all", "all"), ("small (shipped)", "small"))
LATENCY = ("1x1", "1x3", "10x3@512")


def load(ckpt: str, mode: str, device: str, max_tokens: int):
    """A warmed fast engine in PDL `mode`."""
    import model

    extra = {"ops": "torch"} if device == "cpu" else {"pdl": mode}
    t = time.perf_counter()
    eng = model.load(ckpt, device=device, backend="fast", max_batch_tokens=max_tokens, **extra)
    w = eng.warmup(max_tokens)
    return eng, {"load_s": time.perf_counter() - t - w, "warmup_s": w}


def measure(eng, wl: dict, offline_rows: list) -> dict:
    """One round of every workload on one engine."""
    out = {}
    for name in LATENCY:
        states, qs = wl[name]
        rows, _ = rows_of(eng, [(states, qs)])
        if len(states) == 1:
            e2e = timed(lambda s=states[0], qs=qs: eng.predict(s, qs), iters=40)
        else:
            e2e = timed(lambda s=states, qs=qs: eng.predict_batch(s, qs), iters=40)
        fwd = timed(lambda rows=rows: eng.backend.forward(rows), iters=40)
        out[name] = {"e2e_ms": e2e["ms"], "fwd_ms": fwd["ms"], "tokens": sum(len(r) for r in rows)}
    tok = sum(len(r) for r in offline_rows)
    eng.backend.forward(offline_rows[:256])
    t = time.perf_counter()
    eng.backend.forward(offline_rows)
    out["offline"] = {"fwd_tok_s": tok / (time.perf_counter() - t), "tokens": tok}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--offline-states", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=65536, help="the engines' largest bucket")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script on the fast path's torch ops")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pdl_ab.json"))
    a = p.parse_args(argv)
    if a.rounds < 1 or a.offline_states < 1:
        p.error("--rounds and --offline-states must be at least 1")
    if a.max_tokens < 1024:
        p.error("--max-tokens must be at least 1024 (the 1 x 3 rows and an offline state's rows fit one bucket)")
    import numpy as np

    res = {"checkpoint": a.checkpoint, "commit": os.environ.get("LAYA_FLEET_COMMIT"), "rounds": [],
           "engines": {}}
    engines = {}
    for name, mode in VARIANTS:
        engines[name], info = load(a.checkpoint, mode, a.device, a.max_tokens)
        res["engines"][name] = info
        print("%s: loaded in %.1f s, warm-up %.1f s" % (name, info["load_s"], info["warmup_s"]), flush=True)
    first = engines[VARIANTS[0][0]]
    # the 1 x 1 row as long as bench/fast_path.py's (calibrated to the tokenizer), so the two scripts time one row
    wl = workloads(offline_states=a.offline_states, short=short_words(first))
    offline_rows = sorted(rows_of(first, [wl["offline"]])[0], key=len)
    # the same rows through every engine: the kernels differ only in how they are launched
    agree = {}
    for wname, rows in (("10x3@512", rows_of(first, [wl["10x3@512"]])[0]), ("offline", offline_rows)):
        outs = [engines[n].backend.forward(rows) for n, _ in VARIANTS]
        agree[wname] = {"max_abs_logit_diff": max(float(np.max(np.abs(outs[0][0] - o[0]))) for o in outs[1:]),
                        "max_abs_p0_diff": max(float(np.max(np.abs(outs[0][1] - o[1]))) for o in outs[1:])}
    res["agreement"] = agree
    print("agreement: %s" % agree, flush=True)
    for r in range(a.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
        rnd = {}
        for name, _ in order:
            rnd[name] = measure(engines[name], wl, offline_rows)
            print("round %d %s: %s" % (r, name, json.dumps(rnd[name])), flush=True)
        res["rounds"].append(rnd)
    for name, _ in VARIANTS:
        st = engines[name].backend.stats.as_dict()
        res["engines"][name].update(captures_after_warmup=st.get("captures_after_warmup"),
                                    pdl=getattr(engines[name].backend.engine, "pdl", None))
    res["summary"] = summary(res)
    print(table(res))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, os.path.splitext(a.out)[0] + ".png")
    return 0


def summary(res: dict) -> dict:
    """Medians over rounds per variant: e2e and forward ms per latency workload, offline forward tokens/s."""
    out = {}
    for name, _ in VARIANTS:
        rs = [r[name] for r in res["rounds"]]
        s = {w: {k: statistics.median(r[w][k] for r in rs) for k in ("e2e_ms", "fwd_ms")} for w in LATENCY}
        s["offline"] = {"fwd_tok_s": statistics.median(r["offline"]["fwd_tok_s"] for r in rs)}
        out[name] = s
    return out


def table(res: dict) -> str:
    s = res["summary"]
    names = [n for n, _ in VARIANTS]
    base = s[names[0]]
    lines = ["| workload (median of %d rounds) | %s | %s |" % (
                 len(res["rounds"]), " | ".join(names), " | ".join("%s / %s" % (n, names[0]) for n in names[1:])),
             "|---" * (2 * len(names)) + "|"]
    for w in LATENCY:
        for k, label in (("e2e_ms", "predict ms"), ("fwd_ms", "forward ms")):
            lines.append("| %s %s | %s | %s |" % (w, label, " | ".join("%.3f" % s[n][w][k] for n in names),
                                                  " | ".join("%.3f" % (s[n][w][k] / base[w][k]) for n in names[1:])))
    tok = [s[n]["offline"]["fwd_tok_s"] for n in names]
    lines.append("| offline forward tokens/s | %s | %s |" % (" | ".join("%.0f" % t for t in tok),
                                                            " | ".join("%.3f" % (t / tok[0]) for t in tok[1:])))
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    s = res["summary"]
    labels = ["%s %s" % (w, k.split("_")[0]) for w in LATENCY for k in ("e2e_ms", "fwd_ms")] + ["offline tok/s"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    base = s[VARIANTS[0][0]]
    width = 0.8 / len(VARIANTS)
    for i, (name, _) in enumerate(VARIANTS):
        v = s[name]
        ratio = [v[w][k] / base[w][k] for w in LATENCY for k in ("e2e_ms", "fwd_ms")]
        ratio.append(v["offline"]["fwd_tok_s"] / base["offline"]["fwd_tok_s"])
        ax.bar([x + width * i for x in range(len(labels))], ratio, width=width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("relative to off (ms: lower is better; tok/s: higher)")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
