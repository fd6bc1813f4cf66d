"""The report of a run: the side-by-side table printed last, the PNG of latency and offline throughput, and the
proposed kernels/tuning.json."""

from __future__ import annotations

import json

from bench.fastpath import gemm8
from bench.fastpath.common import proposal
from bench.fastpath.model_sections import group_ops
from bench.fastpath.workloads import FAST


def table(res: dict) -> str:
    """The side-by-side table as text."""
    lines = []
    lat = res.get("latency", {})
    systems = ["ours_" + n for n in FAST + ("eager",)] + ["upstream_eager", "upstream_tilelang"]
    lines.append("%-10s %s" % ("workload", " ".join("%18s" % s for s in systems)))
    for w in ("1x1", "1x3", "10x3@512"):
        cells = []
        for s in systems:
            r = lat.get(w, {}).get(s)
            cells.append("%18s" % ("-" if not r else "%.2f ms" % r["e2e_ms"] +
                                   (" (f %.2f)" % r["fwd_ms"] if "fwd_ms" in r else "")))
        lines.append("%-10s %s" % (w, " ".join(cells)))
    off = res.get("offline", {})
    cells = []
    for s in systems:
        r = off.get(s)
        if not r:
            cells.append("%18s" % "-")
        elif "fwd_tok_s" in r:
            cells.append("%18s" % ("%.0fk f/%.0fk e" % (r["fwd_tok_s"] / 1e3, r.get("e2e_tok_s", 0) / 1e3)))
        else:
            cells.append("%18s" % ("%.0fk e" % (r["e2e_tok_s"] / 1e3)))
    lines.append("%-10s %s" % ("offline", " ".join(cells)))
    hf = res.get("hf")
    if hf:
        lines.append("transformers ModernBERT (encoder only) on full %dx%d batches: eager SDPA %.0fk tok/s%s" % (
            hf["rows"], hf["tokens"], hf["eager_tok_s"] / 1e3,
            ", torch.compile %.0fk tok/s (compile %.0f s)" % (hf["compile_tok_s"] / 1e3, hf["compile_s"])
            if "compile_tok_s" in hf else ""))
        fast = res.get("offline", {}).get("ours_fast")
        if fast and "compile_tok_s" in hf:
            lines.append("  ours fast offline / transformers + compile: %.2f"
                         % (fast["fwd_tok_s"] / hf["compile_tok_s"]))
    g = res.get("gemm")
    if g:
        lines.append("GEMM floor (M=%d): %.0fk tok/s" % (g["M"], g["floor_tok_s"] / 1e3))
        for r in g["shapes"]:
            lines.append("  %-9s N=%-5d K=%-5d torch %4.0f TF/s  tilelang %s" % (
                r["name"], r["N"], r["K"], r["torch_tflops"],
                "%4.0f TF/s (%.2f of torch, %s)" % (r["best_tflops"], r["ratio_vs_torch"], r["best"])
                if r["best"] else "n/a"))
            lines.append("            " + ", ".join(
                "%s %.0f" % (c["cfg"], c["tflops"]) + ("" if c["rel_err"] < 2e-2 else " (wrong: %.1e)" % c["rel_err"])
                + (" (+RoPE %.3f ms%s)" % (c["rope_ms"], "" if c["rope_rel_err"] < 2e-2 else " wrong")
                   if "rope_ms" in c else "")
                if "ms" in c else "%s failed" % c["cfg"] for c in r["candidates"]))
            if r.get("used") and r["used"] != r["best"]:
                lines.append("            the forward uses %s (%s)" % (r["used"], "kernels/gemm_manual.py"
                             if r["used"].startswith("ws:") else "fastest with its RoPE epilogue"))
    lines += gemm8.table_lines(res)
    al = res.get("add_ln")
    if al:
        lines.append("add+LN (%d x %d, add mode): " % (al["M"], al["d"]) + ", ".join(
            "%s %.2f TB/s%s" % (c["cfg"], c["tb_s"], " (wrong)" if c["rel_err"] >= 1e-2 else "")
            if "ms" in c else "%s failed" % c["cfg"] for c in al["candidates"])
            + "; used %s (default %s)" % (al["best"], al["default"]))
    n = res.get("numerics")
    if n:
        for k in ("eager",) + FAST:
            if k in n:
                lines.append("numerics %-6s vs fp32 (%d rows): max|dp| %.4f  argmax %.3f  act %.4f  nan %s" % (
                    k, n["rows"], n[k]["max_dp"], n[k]["argmax_agree"], n[k]["max_dp_act"], n[k]["nan"]))
        for k in ("fp32_bf16_weights", "eager_fp16"):
            if "max_dp" in n.get(k, {}):
                lines.append("numerics %-17s vs fp32: max|dp| %.4f  argmax %.3f  (where the error comes from)" % (
                    k, n[k]["max_dp"], n[k]["argmax_agree"]))
    at = res.get("attention")
    if at:
        for c in at["candidates"]:
            if "ms_per_forward" in c:
                lines.append("  attention %-16s full %.3f ms, window %.3f ms (64k tokens), %.2f ms/forward, err %.1e%s"
                             % (c["cfg"], c["ms_w0"], c["ms_w64"], c["ms_per_forward"], c["rel_err"],
                                "  <- used" if c["cfg"] == at["best"] else ""))
            elif "error" in c:
                lines.append("  attention %-16s failed: %s" % (c["cfg"], c["error"].splitlines()[0][:90]))
    for k, p in res.get("profile", {}).items():
        lines.append("profile %-13s %5d tok: %.2f ms = %s, other %.2f" % (
            k, p["tokens"], p["total_ms"], ", ".join("%s %.2f" % kv for kv in group_ops(p["ops"]).items()),
            p["other_ms"]))
        if "split" in p:
            lines.append("  one forward %.2f ms: host staging %.2f, encoder graph on the GPU %.2f" % (
                p["split"]["forward_ms"], p["split"]["stage_ms"], p["split"]["graph_ms"]))
    fs = res.get("load", {}).get("fast", {}).get("stats")
    if fs:
        lines.append("fast: %d graphs + %d tail graphs, warm-up %.1fs, captures after warm-up %d" % (
            fs["graphs"], fs["tail_graphs"], res["load"]["fast"]["warmup_s"], fs["captures_after_warmup"]))
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    """Bar charts of latency and offline throughput; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    systems = ["ours_" + n for n in FAST + ("eager",)] + ["upstream_eager", "upstream_tilelang"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    lat = res.get("latency", {})
    ws = ["1x1", "1x3", "10x3@512"]
    width = 0.84 / len(systems)
    for i, s in enumerate(systems):
        vals = [lat.get(w, {}).get(s, {}).get("e2e_ms", 0) for w in ws]
        axes[0].bar([j + i * width for j in range(len(ws))], vals, width, label=s)
    axes[0].set_xticks([j + (len(systems) - 1) / 2 * width for j in range(len(ws))], ws)
    axes[0].set_ylabel("ms (end to end, median)")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title("latency")
    off = res.get("offline", {})
    names, vals = [], []
    for s in systems:
        r = off.get(s)
        if r:
            names.append(s)
            vals.append(r.get("fwd_tok_s", r.get("e2e_tok_s", 0)) / 1e3)
    if "gemm" in res:
        names.append("GEMM floor")
        vals.append(res["gemm"]["floor_tok_s"] / 1e3)
    axes[1].bar(names, vals, color="tab:green")
    axes[1].set_ylabel("k tokens/s (forward; upstream end to end)")
    axes[1].set_title("offline throughput")
    axes[1].tick_params(axis="x", labelrotation=20)
    fig.suptitle("laya-fleet fast path, %s, %s" % (res.get("gpu", "?"), res.get("date", "")))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def print_proposal(res: dict, tuning_out: str | None) -> None:
    """This run's proposed kernels/tuning.json: kept in `res`, printed, and written to `tuning_out` when given."""
    res["tuning"] = proposal().as_dict()
    print("proposed kernels/tuning.json:\n%s" % json.dumps(res["tuning"], indent=1))
    if tuning_out:
        with open(tuning_out, "w") as fh:
            json.dump(res["tuning"], fh, indent=1)
            fh.write("\n")
        print("wrote %s (copy it over kernels/tuning.json to make the forward run it)" % tuning_out)
