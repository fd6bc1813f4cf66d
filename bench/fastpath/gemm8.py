"""The FP8 precision's products at M rows: torch.matmul in bf16 (the floor's kernel), cuBLAS's e4m3 GEMM with row
and column scales (`torch._scaled_mm`, what the forward runs for few rows) and the e4m3 hand-warp-specialised
kernel (kernels/gemm_manual.py, what it runs for many on Hopper), each checked against the fp32 product of the
dequantised operands; and the per-token quantisation kernel (kernels/quant.py) of each product's input."""

from __future__ import annotations

from bench.fastpath.common import bench_gpu, log


def _launcher(kernel, args: tuple):
    return lambda: kernel(*args)


def section_gemm8(res: dict, dims: dict, M: int) -> None:
    """res["gemm8"]: per product {N, K, bf16 / scaled_mm / ws ms and TF/s, ws error, quant ms}."""
    import torch

    from kernels import gemm_manual as GM
    from kernels import quant
    from kernels.tuning import pick_gemm_ws8
    from model.backends.fast.specs import sm_count

    d, inter = dims["d"], dims["inter"]
    dev = "cuda"
    zero = torch.zeros(max(3 * d, 2 * inter), device=dev)
    rows = []
    for name, N, K, geglu in (("wqkv", 3 * d, d, False), ("wo", d, d, False), ("wi_geglu", inter, d, True),
                              ("mlp_wo", d, inter, False)):
        nw = 2 * N if geglu else N
        a = torch.randn(M, K, device=dev).bfloat16()
        w = torch.randn(nw, K, device=dev) * K ** -0.5
        qa, sa = quant.quant(a, False)
        qw, sw = quant.quant_rows_ref(w)
        ref = (qa.float() * sa[:, None]) @ (qw.float() * sw[:, None]).t()
        if geglu:
            ref = torch.nn.functional.gelu(ref[:, :N]) * ref[:, N:]
        flops = 2.0 * M * nw * K
        wb = w.bfloat16()
        rec = {"name": name, "N": N, "K": K, "M": M}
        rec["bf16_ms"] = bench_gpu(lambda a=a, wb=wb: torch.matmul(a, wb.t()))
        sa2, sw2 = sa.view(-1, 1), sw.view(1, -1)
        rec["scaled_mm_ms"] = bench_gpu(lambda qa=qa, qw=qw, sa2=sa2, sw2=sw2: torch._scaled_mm(
            qa, qw.t(), scale_a=sa2, scale_b=sw2, out_dtype=torch.bfloat16))
        cfg = pick_gemm_ws8(M, N, geglu, arch="sm_90a", sms=sm_count())
        out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
        try:
            k = GM.gemm_manual_kernel(N, K, cfg, False, "none", 0, geglu, torch.bfloat16, fp8=True)
            call = _launcher(k, (qa, qw, out, sa, sw) if geglu else (qa, qw, zero[:N], out, sa, sw))
            out.fill_(float("nan"))
            call()
            rec["ws_rel_err"] = float((out.float() - ref).norm() / ref.norm())
            rec["ws_ms"] = bench_gpu(call)
            rec["ws_cfg"] = cfg.tag()
        except Exception as e:  # noqa: BLE001 - recorded, the other columns still stand
            rec["ws_error"] = "%s: %s" % (type(e).__name__, str(e)[:300])
        rec["quant_ms"] = bench_gpu(lambda a=a: quant.quant(a, False))
        for key in ("bf16", "scaled_mm", "ws"):
            if key + "_ms" in rec:
                rec[key + "_tflops"] = flops / rec[key + "_ms"] / 1e9
        rows.append(rec)
        log("gemm8 %s: bf16 %.0f TF/s, scaled_mm %.0f, ws %s (err %s), quant %.3f ms" % (
            name, rec["bf16_tflops"], rec["scaled_mm_tflops"], "%.0f" % rec["ws_tflops"] if "ws_ms" in rec else "-",
            "%.1e" % rec["ws_rel_err"] if "ws_rel_err" in rec else rec.get("ws_error"), rec["quant_ms"]))
    res["gemm8"] = rows


def table_lines(res: dict) -> list[str]:
    """The table rows of res["gemm8"]."""
    out = []
    for r in res.get("gemm8", []):
        out.append("  fp8 %-9s N=%-5d K=%-5d bf16 %4.0f TF/s  scaled_mm %4.0f  ws %s  quant %.3f ms" % (
            r["name"], r["N"], r["K"], r["bf16_tflops"], r["scaled_mm_tflops"],
            "%4.0f (err %.1e, %s)" % (r["ws_tflops"], r["ws_rel_err"], r["ws_cfg"]) if "ws_ms" in r
            else "failed: %s" % r.get("ws_error"), r["quant_ms"]))
    return out


__all__ = ["section_gemm8", "table_lines"]
