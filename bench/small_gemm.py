"""Small-tile GEMMs for few tokens: every product of the forward at the token counts of a lone request and a small
batch, each candidate tile checked against the reference and timed beside the shipped SMALL tile and torch.matmul.

Up to `small_m` rows (kernels/tuning.json) every product runs one 64 x 64 tile, so at 128 tokens Wo and MLP Wo
(N = 1024) launch 32 blocks on 132 SMs and stream their weights through a quarter of the GPU. The candidates trade
tile width, depth and pipelining for more blocks. The winner of each product (least time summed over the token
counts, correct within 2e-2) is proposed as a `gemm_small` / `geglu_small` entry of a tuning table, printed and,
with `--tuning-out FILE`, written in kernels/tuning.json's format: copying it over that file is what makes the
forward run it. Wqkv is timed with its RoPE epilogue where the tile allows it, as the forward runs it.

    python3 bench/small_gemm.py --out $OUT/small_gemm.json [--tokens 128,320,896] [--tuning-out FILE]
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

TOKENS = (128, 320, 896)   # a lone 1 x 1 request's bucket, a 1 x 3 request's, the last small-tile bucket


def candidates():
    """(kind, config) pairs: the shipped SMALL tiles first, then narrower, shallower and unspecialised ones."""
    from dataclasses import replace

    from kernels import geglu as G
    from kernels import gemm as K

    gemm = [K.SMALL, replace(K.SMALL, bn=32), replace(K.SMALL, bk=64), replace(K.SMALL, bn=32, bk=256, stages=3),
            replace(K.SMALL, bn=128, stages=3), replace(K.SMALL, ws=False), replace(K.SMALL, bn=32, ws=False),
            replace(K.SMALL, stages=2)]
    geglu = [G.SMALL, replace(G.SMALL, bn=32), replace(G.SMALL, bk=64, stages=4), replace(G.SMALL, ws=False),
             replace(G.SMALL, bn=32, ws=False)]
    return gemm, geglu


def products(d: int, inter: int, ffn: int, layers: int) -> list[tuple[str, int, int, bool, str, int]]:
    """(name, N, K, bias, act, calls a forward) of each distinct product the forward runs at few tokens
    ("wi_geglu": F, K); the head's two layers run on every token only up to their attention."""
    return [("wqkv", 3 * d, d, False, "none", layers), ("wo", d, d, False, "none", layers),
            ("wi_geglu", inter, d, False, "none", layers), ("wo_mlp", d, inter, False, "none", layers),
            ("head_ffn1", ffn, d, True, "relu", 1), ("head_ffn2", d, ffn, True, "none", 1)]


def small_specs(shape: str = "modernbert-large") -> list[tuple[str, tuple]]:
    """Every candidate kernel this benchmark builds for `shape` (`laya-fleet precompile --sweep` includes them)."""
    import torch

    from model.make_checkpoint import SHAPES

    s = SHAPES[shape]
    d = s["hidden"]
    gemm_c, geglu_c = candidates()
    out = []
    for name, N, Kd, bias, act, _ in products(d, s["ff"], 4 * d, s["layers"]):
        if name == "wi_geglu":
            out += [("geglu", (N, Kd, c)) for c in geglu_c]
            continue
        out += [("gemm", (N, Kd, bias, act, c, torch.bfloat16)) for c in gemm_c]
        if name == "wqkv":
            out += [("gemm", (N, Kd, False, "none", c, torch.bfloat16, torch.bfloat16, 2 * d)) for c in gemm_c
                    if c.bn % 64 == 0]
    return out


def _call(fn, *args):
    return lambda: fn(*args)


def _then(first, second) -> None:
    first()
    second()


def _total(c: dict) -> float:
    """A candidate's ms summed over the token counts (Wqkv's with its RoPE, as the forward runs it)."""
    return sum((c["rope_ms"] or c["ms"]).values())


def _time_candidate(name: str, cfg, w, bias, act: str, tokens: list[int], d: int) -> dict:
    """One tile config of one product at each token count: its largest error against the reference (NaN-filled
    output, every row checked) and its median ms (and with the RoPE epilogue for Wqkv where bn allows it)."""
    import torch

    from bench.fastpath.common import bench_gpu
    from kernels import geglu as G
    from kernels import gemm as K
    from kernels import rope as RP

    geglu = name == "wi_geglu"
    N, Kd = (w.shape[0] // 2 if geglu else w.shape[0]), w.shape[1]
    row = {"cfg": cfg.tag(), "ms": {}, "rope_ms": {}, "rel_err": 0.0}
    b = bias if bias is not None else torch.zeros(N, device=w.device)
    try:
        k = G.geglu_kernel(N, Kd, cfg) if geglu else K.gemm_kernel(N, Kd, bias is not None, act, cfg)
        kr = K.gemm_kernel(N, Kd, False, "none", cfg, rope_cols=2 * d) if name == "wqkv" and cfg.bn % 64 == 0 \
            else None
        cos, sin = RP.rope_tables(160000.0, 512, w.device)
        for M in tokens:
            x = torch.randn(M, Kd, device=w.device).bfloat16()
            out = torch.full((M, N), float("nan"), device=w.device, dtype=torch.bfloat16)
            call = _call(k, x, w, out) if geglu else _call(k, x, w, b, out)
            call()
            ref = G.geglu_ref(x, w) if geglu else K.gemm_ref(x, w, bias, act)
            row["rel_err"] = max(row["rel_err"], float((out.float() - ref.float()).norm() / ref.float().norm()))
            row["ms"][M] = bench_gpu(call)
            if name == "wqkv":   # as the forward runs it: RoPE in the epilogue, else the RoPE kernel after
                pos = torch.randint(0, 512, (M,), device=w.device, dtype=torch.int32)
                row["rope_ms"][M] = bench_gpu(_call(kr, x, w, b, out, pos, cos, sin)) if kr is not None else \
                    bench_gpu(_call(_then, call, _call(RP.rope, out, pos, cos, sin, d // 64)))
    except Exception as e:  # noqa: BLE001 - a config that does not build or run is reported, not fatal
        row["error"] = "%s: %s" % (type(e).__name__, str(e)[:300])
    return row


def run(a: argparse.Namespace) -> dict:
    import torch

    from bench.fastpath.common import bench_gpu
    from kernels.tuning import TABLE
    from model.backends.fast import configure_tilelang
    from model.make_checkpoint import SHAPES

    configure_tilelang()
    s = SHAPES[a.shape]
    d, inter = s["hidden"], s["ff"]
    dev = "cuda"
    tokens = [int(x) for x in a.tokens.split(",")]
    gemm_c, geglu_c = candidates()
    table = TABLE
    res = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "shape": a.shape,
           "commit": os.environ.get("LAYA_FLEET_COMMIT"), "tokens": tokens, "products": []}
    for name, N, Kd, bias, act, calls in products(d, inter, 4 * d, s["layers"]):
        geglu = name == "wi_geglu"
        nw = 2 * N if geglu else N
        w = (torch.randn(nw, Kd, device=dev) * Kd ** -0.5).bfloat16()
        b = torch.randn(N, device=dev) if bias else torch.zeros(N, device=dev)
        rec = {"name": name, "N": N, "K": Kd, "calls": calls, "candidates": []}
        for cfg in (geglu_c if geglu else gemm_c):
            rec["candidates"].append(_time_candidate(name, cfg, w, b if bias else None, act, tokens, d))
        rec["torch_ms"] = {M: bench_gpu(_call(torch.matmul, torch.randn(M, Kd, device=dev).bfloat16(), w.t()))
                           for M in tokens}

        ok = [c for c in rec["candidates"] if "error" not in c and c["rel_err"] < 2e-2 and c["ms"]]
        best = min(ok, key=_total) if ok else None
        rec["best"] = best and best["cfg"]
        rec["shipped_total_ms"] = _total(rec["candidates"][0]) if rec["candidates"][0]["ms"] else None
        rec["best_total_ms"] = best and _total(best)
        if best is not None and best is not rec["candidates"][0]:
            cfg = (geglu_c if geglu else gemm_c)[rec["candidates"].index(best)]
            table = table.with_entry("geglu_small" if geglu else "gemm_small", "%dx%d" % (N, Kd), cfg)
        res["products"].append(rec)
    res["proposal"] = table.as_dict()
    return res


def report(res: dict) -> str:
    lines = ["%-10s %-5s %-5s %s" % ("product", "N", "K", "  ".join("%dtok" % m for m in res["tokens"]))]
    for p in res["products"]:
        for c in p["candidates"]:
            if "error" in c:
                lines.append("%-10s %-5d %-5d %-22s failed: %s" % (p["name"], p["N"], p["K"], c["cfg"],
                                                                    c["error"][:60]))
                continue
            ms = c["rope_ms"] or c["ms"]
            lines.append("%-10s %-5d %-5d %-22s %s  err %.1e%s%s" % (
                p["name"], p["N"], p["K"], c["cfg"], "  ".join("%.4f" % ms[m] for m in res["tokens"]),
                c["rel_err"], " (+RoPE)" if c["rope_ms"] else "", "  <- best" if c["cfg"] == p["best"] else ""))
        lines.append("%-10s torch.matmul %s" % ("", "  ".join("%.4f" % p["torch_ms"][m] for m in res["tokens"])))
    saved = []
    for m in res["tokens"]:   # a forward calls each encoder product once a layer
        tot = 0.0
        for p in res["products"]:
            cands = {c["cfg"]: c for c in p["candidates"] if "error" not in c and c["ms"]}
            if p["best"] and p["candidates"][0]["cfg"] in cands:
                ship, best = cands[p["candidates"][0]["cfg"]], cands[p["best"]]
                tot += p["calls"] * ((ship["rope_ms"] or ship["ms"])[m] - (best["rope_ms"] or best["ms"])[m])
        saved.append("%d tokens %.3f ms" % (m, tot))
    lines.append("a forward's GEMMs with the best tiles against SMALL, saved: " + ", ".join(saved))
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(10, 4.5))
    names = [p["name"] for p in res["products"]]
    shipped = [p["shipped_total_ms"] or 0 for p in res["products"]]
    best = [p["best_total_ms"] or 0 for p in res["products"]]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], shipped, 0.4, label="SMALL (shipped)")
    ax.bar([x + 0.2 for x in xs], best, 0.4, label="best candidate")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("ms, summed over %s tokens" % ",".join(map(str, res["tokens"])))
    ax.legend()
    ax.set_title("small-tile GEMMs, %s" % res["gpu"])
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "small_gemm.json"))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--shape", default="modernbert-large")
    p.add_argument("--tuning-out", default=None, metavar="FILE")
    a = p.parse_args(argv)
    res = run(a)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    res["png"] = a.out[:-5] + ".png" if plot(res, a.out[:-5] + ".png") else None
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    print(report(res))
    print("proposed kernels/tuning.json:\n" + json.dumps(res["proposal"], indent=1))
    if a.tuning_out:
        with open(a.tuning_out, "w") as fh:
            json.dump(res["proposal"], fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
