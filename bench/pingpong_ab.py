"""The hand-warp-specialised GEMMs' two schedules side by side: cooperative (shipped: both consumer warpgroups on one
tile's two row halves at once, so their epilogues stall the tensor cores together) against ping-pong (the consumers
take the halves in turn, one's epilogue under the other's products; kernels/gemm_manual.py, `pingpong`).
`--compile-only` also builds what bench/fast_path.py's `pingpong` / `foldpp` / `fast8pp` engines add to the
shipped / fold / FP8 forwards' kernels.

Every encoder product of a modernbert-large layer (Wqkv with its RoPE, Wo, Wi with its GeGLU, MLP Wo) at the
offline chunk's and the 10 x 3 batch's token counts, in bf16, with e4m3 operands (the FP8 precision's kernels) and
in the add+LayerNorm fold's forms (folded Wqkv / Wi, residual Wo / MLP Wo). Each variant is checked against the
shipped kernel's output (the same k order and wgmma shapes: equal bits expected) and timed beside torch.matmul.
Prints a table, writes JSON and draws a PNG. A variant that faults the GPU takes the process's CUDA context with
it: the JSON keeps the rows before it.

    python3 bench/pingpong_ab.py --out $OUT/pingpong_ab.json
    python3 bench/pingpong_ab.py --compile-only --pack .gpu/pingpong-tl-cache.tar.xz   (CPU: build the kernels)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

D, INTER = 1024, 2624
TOKENS = (65536, 15360)
# (name, N, K, RoPE columns, GeGLU, LayerNorm form): the forward's products, each called once a layer, then the
# forms the add+LayerNorm fold runs instead (kernels/ln_fold.py: bf16 only)
PRODUCTS = (("wqkv", 3 * D, D, 2 * D, False, ""), ("wo", D, D, 0, False, ""), ("wi_geglu", INTER, D, 0, True, ""),
            ("mlp_wo", D, INTER, 0, False, ""))
FOLD = (("wqkv+ln", 3 * D, D, 2 * D, False, "fold"), ("wo+add", D, D, 0, False, "residual"),
        ("wi_geglu+ln", INTER, D, 0, True, "fold"), ("mlp_wo+add", D, INTER, 0, False, "residual"))
FORMS = ((False, PRODUCTS), (True, PRODUCTS), (False, FOLD))   # (e4m3 operands, products)


def variants(base):
    """(tag, config): the shipped config, then its ping-pong forms (with and without the 2-CTA cluster)."""
    out = [("shipped", base), ("pingpong", replace(base, inflight=1, pingpong=True))]
    if base.cluster > 1:
        out.append(("pingpong_c1", replace(base, inflight=1, pingpong=True, cluster=1)))
    return out


def product_configs(fp8: bool, sms: int):
    """{name: [(tag, config)]} for every product (e4m3 operands when `fp8`), the shipped config from
    kernels/tuning.py's pick first."""
    import torch

    from kernels.tuning import pick_gemm_ws, pick_gemm_ws8

    out = {}
    for name, N, K, _, g, _ in PRODUCTS + FOLD:
        if fp8:
            base = pick_gemm_ws8(TOKENS[0], N, g, arch="sm_90a", sms=sms)
        else:
            base = pick_gemm_ws(TOKENS[0], N, torch.bfloat16, torch.bfloat16, g, K, arch="sm_90a", sms=sms)
        out[name] = variants(base)
    return out


def specs(sms: int = 132) -> list[tuple[str, tuple]]:
    """The kernels this benchmark runs, as model/backends/fast/specs.py's (kind, args) for `compile_specs`."""
    import torch

    out = []
    for fp8, prods in FORMS:
        cfgs = product_configs(fp8, sms)
        for name, N, K, rope, g, ln in prods:
            for _, cfg in cfgs[name]:
                out.append(("gemm_ws", (N, K, cfg, False, "none", rope, g, torch.bfloat16, fp8)
                            + ((ln, 1e-5) if ln else ())))
    return list(dict.fromkeys(out + engine_specs(sms)))


def engine_specs(sms: int = 132) -> list[tuple[str, tuple]]:
    """The hand-warp-specialised GEMMs bench/fast_path.py's `pingpong`, `foldpp` and `fast8pp` engines run on a
    modernbert-large checkpoint in place of the shipped, fold and FP8 forwards' (the head's products too): their
    other kernels are those forwards'."""
    from bench.fastpath.workloads import FOLD_M, pingpong_table
    from kernels.tuning import TABLE
    from model.backends.fast import fp8
    from model.backends.fast.precompile import shape_dims
    from model.backends.fast.specs import kernel_specs

    dims = shape_dims("modernbert-large")
    table = pingpong_table(TABLE, dims["d"], dims["inter"], dims["ffn"], sms)
    out = []
    for t in (table, replace(table, ln_fold_m=max(FOLD_M, table.small_m + 64))):   # pingpong, foldpp
        out += [sp for sp in kernel_specs(**dims, table=t, arch="sm_90a", sms=sms, pdl="small", ln_fold=True)
                if sp[0] == "gemm_ws"]
    out += [sp for sp in fp8.kernel_specs(dims["d"], dims["inter"], arch="sm_90a", sms=sms, table=table)
            if sp[0] == "gemm_ws"]   # fast8pp
    return list(dict.fromkeys(out))


def run(out_path: str) -> dict:
    import torch

    from bench.fastpath.common import bench_gpu as _time
    from kernels import _tl, quant
    from kernels import gemm_manual as GM
    from kernels import rope as RP
    from model.backends.fast import configure_tilelang
    from model.backends.fast.specs import sm_count

    configure_tilelang()
    sms = sm_count()
    dev = "cuda"
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "sms": sms, "tokens": list(TOKENS),
           "commit": os.environ.get("LAYA_FLEET_COMMIT", ""), "rows": []}
    Mx = max(TOKENS)
    cos, sin = RP.rope_tables(160000.0, 8192, dev)
    pos = torch.randint(0, 8192, (Mx,), device=dev, dtype=torch.int32)
    zero = torch.zeros(3 * D, device=dev)
    for fp8, prods in FORMS:
        cfgs = product_configs(fp8, sms)
        for name, N, K, rope, g, ln in prods:
            nw = 2 * N if g else N
            w_cs = torch.randn(nw, device=dev) if ln == "fold" else None
            x0 = torch.randn(Mx, N, device=dev) if ln == "residual" else None
            a_full = torch.randn(Mx, K, device=dev).bfloat16()
            w = (torch.randn(nw, K, device=dev) * K ** -0.5)
            if fp8:
                qa_full, sa_full = quant.quant(a_full, False)
                qw, sw = quant.quant_rows_ref(w)
            wb = w.bfloat16()
            for M in TOKENS:
                rec = {"name": name, "fp8": fp8, "ln": ln, "M": M, "N": N, "K": K, "flops": 2.0 * M * nw * K}
                a = a_full[:M]
                rec["torch_bf16_ms"] = _time(lambda a=a, wb=wb: torch.matmul(a, wb.t()))
                outs, ref = {}, None
                for tag, cfg in cfgs[name]:
                    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
                    try:
                        with _tl.pdl_scope(False):   # the large-M builds the forward runs
                            k = GM.gemm_manual_kernel(N, K, cfg, False, "none", rope, g, torch.bfloat16, fp8=fp8,
                                                      ln=ln)
                        x = None
                        if ln == "fold":   # main(A, W, Bias, Cs, C, ...) / GeGLU main(A, Wi, Cs, C)
                            ops = (a, wb, w_cs) if g else (a, wb, zero[:N], w_cs)
                            tail = ()
                        elif ln == "residual":   # main(A, W, Bias, X, C): X += the product, C = X rounded
                            x = x0[:M].clone()
                            ops, tail = (a, wb, zero[:N], x), ()
                        elif fp8:
                            ops = (qa_full[:M], qw) if g else (qa_full[:M], qw, zero[:N])
                            tail = (sa_full[:M], sw)
                        else:
                            ops = (a, wb) if g else (a, wb, zero[:N])
                            tail = ()
                        args = ops + (out,) + ((pos[:M], cos, sin) if rope else ()) + tail
                        out.fill_(float("nan"))
                        k(*args)
                        torch.cuda.synchronize()
                        if ref is None:
                            ref = out.clone()
                        # checked on the first call: the residual form's stream grows with every timed one
                        diff, nan = float((out.float() - ref.float()).abs().max()), bool(out.isnan().any())
                        ms = _time(lambda k=k, args=args: k(*args))
                        outs[tag] = {"cfg": cfg.tag(), "ms": ms, "tflops": rec["flops"] / ms / 1e9,
                                     "max_diff_vs_shipped": diff, "nan": nan}
                    except Exception as e:  # noqa: BLE001 - recorded, the other variants still run
                        outs[tag] = {"cfg": cfg.tag(), "error": "%s: %s" % (type(e).__name__, str(e)[:300])}
                rec["variants"] = outs
                res["rows"].append(rec)
                print(line(rec), flush=True)
                with open(out_path, "w") as fh:
                    json.dump(res, fh, indent=1)
    return res


def line(rec: dict) -> str:
    parts = []
    for tag, v in rec["variants"].items():
        if "error" in v:
            parts.append("%s failed (%s)" % (tag, v["error"][:80]))
        else:
            parts.append("%s %.3f ms %.0f TF/s%s" % (tag, v["ms"], v["tflops"],
                                                      "" if v["max_diff_vs_shipped"] == 0 and not v["nan"] else
                                                      " DIFF %.3g%s" % (v["max_diff_vs_shipped"],
                                                                        " NaN" if v["nan"] else "")))
    return "%-11s %-4s M=%-6d torch bf16 %.3f ms | %s" % (rec["name"], "fp8" if rec["fp8"] else "bf16", rec["M"],
                                                          rec["torch_bf16_ms"], " | ".join(parts))


def report(res: dict) -> str:
    """The table, and what each schedule costs a forward's 28 layers (one call of each product a layer)."""
    lines = [line(r) for r in res["rows"]]
    for fp8, fold in ((False, False), (True, False), (False, True)):
        for M in res["tokens"]:
            rows = [r for r in res["rows"] if r["fp8"] == fp8 and bool(r.get("ln")) == fold and r["M"] == M]
            tot = {}
            for r in rows:
                for tag, v in r["variants"].items():
                    if "ms" in v:
                        tot.setdefault(tag, 0.0)
                        tot[tag] += 28 * v["ms"]
            lines.append("%s%s M=%d, 28 layers of the four products: %s" % (
                "fp8" if fp8 else "bf16", " fold" if fold else "", M,
                ", ".join("%s %.2f ms" % kv for kv in tot.items())))
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in res["rows"] if r["M"] == res["tokens"][0]]
    tags = ["shipped", "pingpong", "pingpong_c1"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = 0.8 / (len(tags) + 1)
    for i, tag in enumerate(["torch"] + tags):
        ys = [(r["flops"] / r["torch_bf16_ms"] / 1e9) if tag == "torch" else
              r["variants"].get(tag, {}).get("tflops", 0) for r in rows]
        ax.bar([j + i * w for j in range(len(rows))], ys, w, label="torch.matmul bf16" if tag == "torch" else tag)
    ax.set_xticks([j + 0.4 for j in range(len(rows))])
    ax.set_xticklabels(["%s %s" % (r["name"], "fp8" if r["fp8"] else "bf16") for r in rows], rotation=30,
                       fontsize=7)
    ax.set_ylabel("TFLOP/s at M = %d" % res["tokens"][0])
    ax.set_title("%s: cooperative (shipped) vs ping-pong consumers" % res["gpu"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pingpong_ab.json"))
    ap.add_argument("--compile-only", action="store_true", help="build the kernels into the cache (no GPU needed)")
    ap.add_argument("--pack", default=None, help="with --compile-only: pack the kernel cache into this tar.xz")
    a = ap.parse_args(argv)
    if a.pack and not a.compile_only:   # packing is what --compile-only fills; alone it would be ignored
        ap.error("--pack goes with --compile-only")
    if a.compile_only:
        from model.backends.fast import configure_tilelang
        from model.backends.fast.precompile import pack_cache
        from model.backends.fast.specs import compile_specs

        configure_tilelang()
        print("%d kernels in %.1fs" % (len(specs()), compile_specs(specs())))
        if a.pack:
            print("packed %s (%.1f MB)" % (a.pack, pack_cache(a.pack) / 1e6))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    res = run(a.out)
    print(report(res))
    if plot(res, a.out.replace(".json", ".png")):
        print("plot", a.out.replace(".json", ".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
