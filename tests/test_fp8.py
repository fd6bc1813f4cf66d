"""The fast forward's FP8 precision (model/backends/fast/fp8.py): e4m3 rounding and scales, the scaled GEMM's
semantics, the whole forward on CPU (torch ops; `torch._scaled_mm` runs there too) and on a GPU, and how the
precision is chosen (setting, checkpoint) and refused where it cannot run."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kernels import quant
from model.backends.base import cuda_amp_dtype, cuda_precision
from model.backends.fast import fp8, make_backend
from model.bundle import load_model

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def _softmax(logits):
    z = logits - logits.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _rows_of_many_ranges(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-4, 3, 64).unsqueeze(1)
    x[5] = 0.0                      # a zero row must quantise to zeros, not NaN
    x[9, 7] = 1e4                   # one outlier: only its own row's resolution drops
    return x


def test_rows_and_weight_channels_round_within_one_e4m3_half_step():
    x = _rows_of_many_ranges()
    q, s = fp8.quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 1) and s.dtype == torch.float32
    deq = q.float() * s
    # 3 mantissa bits: half a step is 2^-4 of the value for normals; subnormals step by 2^-9 of the scale
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * s + 1e-30
    assert torch.isfinite(deq).all() and ((deq - x).abs() <= bound).all()
    assert (deq[5] == 0).all()
    assert (q.float().abs().amax(1)[torch.arange(64) != 5] == fp8.E4M3_MAX).all()   # each row uses the full range
    w = fp8.quantize_weight(x)
    assert w.shape == (64, 256) and w.scale.shape == (1, 64)
    torch.testing.assert_close(w.q.float() * w.scale.t(), deq, rtol=0, atol=0)
    assert fp8.quantize_rows(x, "tilelang")[0].equal(q)   # on CPU the kernel's torch form runs


def test_the_scaled_gemm_is_the_product_of_the_dequantised_operands():
    """Row scales multiply rows of the output and channel scales its columns (a swap or transpose fails this)."""
    a = _rows_of_many_ranges(1)[:48]
    w = fp8.quantize_weight(torch.randn(80, 256, generator=torch.Generator().manual_seed(2))
                            * torch.logspace(-2, 2, 80).unsqueeze(1))
    a8, sa = fp8.quantize_rows(a)
    want = (a8.float() * sa) @ (w.q.float() * w.scale.t()).t()
    got = fp8.matmul(a, w)
    assert got.dtype == torch.bfloat16 and got.shape == (48, 80)
    torch.testing.assert_close(got.float(), want, rtol=2.0 ** -7, atol=1e-6 * want.abs().max().item())
    bias = torch.randn(80)
    y = fp8.gemm(a, w, bias, "relu")
    torch.testing.assert_close(y, torch.relu(got.float() + bias))
    wi = fp8.quantize_weight(torch.randn(160, 256, generator=torch.Generator().manual_seed(3)))
    x, gate = fp8.matmul(a, wi).float().chunk(2, -1)
    qg, sg = fp8.geglu(a, wi)      # quantised for the next GEMM
    qh, sh = fp8.quantize_rows((torch.nn.functional.gelu(x) * gate).bfloat16())   # rounded as the kernels store it
    assert torch.equal(qg.float(), qh.float()) and torch.equal(sg, sh) and sg.shape == (48, 1)
    assert fp8.matmul((qg, sg), w2 := fp8.quantize_weight(torch.randn(8, 80))).shape == (48, 8)
    out = torch.empty(48, 8, dtype=torch.bfloat16)
    assert fp8.gemm((qg, sg), w2, out=out) is out and torch.equal(out, fp8.matmul((qg, sg), w2))


def test_the_fp32_form_of_the_scaled_gemm_equals_scaled_mm_and_stands_in_where_cpu_takes_no_row_scales(monkeypatch):
    """torch 2.11's CPU `_scaled_mm` takes one scale a tensor: there the product runs as fp32 ops, the same sums in
    another order; the bf16 results agree with `_scaled_mm` where that takes scale vectors (torch 2.13 on CPU)."""
    a = _rows_of_many_ranges(1)[:48]
    w = fp8.quantize_weight(torch.randn(80, 256, generator=torch.Generator().manual_seed(2))
                            * torch.logspace(-2, 2, 80).unsqueeze(1))
    q = fp8.quantize_rows(a)
    ours = fp8.dequantised_product(q, w)
    assert ours.dtype == torch.bfloat16 and ours.shape == (48, 80)
    if fp8.cpu_takes_row_scales():
        ref = torch._scaled_mm(q[0], w.q.t(), scale_a=q[1], scale_b=w.scale, out_dtype=torch.bfloat16)
        torch.testing.assert_close(ours.float(), ref.float(), rtol=2.0 ** -7, atol=1e-6 * ref.abs().max().item())
    monkeypatch.setattr(fp8, "_cpu_rowwise", False)
    assert torch.equal(fp8.matmul(q, w), ours)
    out = torch.empty(48, 80, dtype=torch.bfloat16)
    assert fp8.gemm(q, w, out=out) is out and torch.equal(out, ours)


@pytest.fixture(scope="module")
def fp8_forward(bundle, rows):
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", fp8=True)
    return fast, fast.forward(rows)


def test_the_fp8_forward_stays_near_fp32_and_says_so(bundle, rows, rows_scored, fp8_forward):
    """The encoder's GEMM weights are e4m3, the head's stay as they were; answers finite and near the fp32
    reference, further from it than bf16 (e4m3 keeps 3 mantissa bits to bf16's 7)."""
    from serve_app.online.scorer_deployment import _precision

    fast, (logits, act) = fp8_forward
    ly = fast.engine.layers[0]
    for name in ("wqkv", "wo", "wi", "wo2"):
        assert isinstance(getattr(ly, name), fp8.Fp8Weight) and getattr(ly, name).q.dtype == torch.float8_e4m3fn
    assert fast.engine.head_layers[0].win.dtype == torch.float32 and fast.precision == "fp8-e4m3"
    assert _precision(type("E", (), {"backend": fast, "device": torch.device("cpu")})()) == "fp8-e4m3"
    l_ref, p_ref = rows_scored
    assert logits.shape == l_ref.shape and np.isfinite(logits).all() and np.isfinite(act).all()
    dp = np.abs(_softmax(logits) - _softmax(l_ref)).max()
    agree = (logits.argmax(-1) == l_ref.argmax(-1)).mean()
    bf16 = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", act_dtype=torch.bfloat16)
    dp_bf = np.abs(_softmax(bf16.forward(rows)[0]) - _softmax(l_ref)).max()
    assert dp_bf < dp < 1.0 and agree >= 0.75, (dp, dp_bf, agree)
    assert np.abs(act - p_ref).max() < 0.1


def test_a_non_boolean_fp8_option_names_itself(bundle):
    with pytest.raises(ValueError, match="fp8 is True or False, got 'no'"):
        make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", fp8="no")


def test_fp8_is_chosen_by_setting_or_checkpoint_and_refused_off_the_fast_backend(monkeypatch):
    monkeypatch.delenv("LAYA_FLEET_CUDA_AMP", raising=False)
    monkeypatch.delenv("LAYA_CUDA_AMP", raising=False)
    assert cuda_precision({"amp_dtype": "fp8"}) == "fp8"
    assert cuda_precision({"amp_dtype": "bf16"}) == "bf16" and cuda_precision({}) == "fp16"
    with pytest.raises(ValueError, match="fp8 \\(from the checkpoint's amp_dtype\\) runs on the fast backend only"):
        cuda_amp_dtype({"amp_dtype": "fp8"})
    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "FP8")
    assert cuda_precision({"amp_dtype": "bf16"}) == "fp8"
    with pytest.raises(ValueError, match="fp8 \\(from LAYA_FLEET_CUDA_AMP\\)"):
        cuda_amp_dtype({})
    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "bf16")
    assert cuda_precision({"amp_dtype": "fp8"}) == "bf16" and cuda_amp_dtype({"amp_dtype": "fp8"}) == torch.bfloat16
    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "fp4")
    with pytest.raises(ValueError, match="LAYA_FLEET_CUDA_AMP='fp4'.*fp8"):
        cuda_precision({})


def test_the_quantisation_references_are_the_per_row_formula():
    a = _rows_of_many_ranges(4)
    q, s = quant.quant_rows_ref(a)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64,)
    torch.testing.assert_close(s, a.abs().amax(1).clamp(min=1e-12) / 448.0)
    assert torch.equal(q.float(), (a / s[:, None]).to(torch.float8_e4m3fn).float())
    p = torch.randn(9, 2 * 192)
    qg, sg = quant.geglu_quant_ref(p)
    h = torch.nn.functional.gelu(p[:, :192]) * p[:, 192:]
    qh, sh = quant.quant_rows_ref(h)
    assert torch.equal(qg.float(), qh.float()) and torch.equal(sg, sh)
    qb, sb = quant.geglu_quant_ref(p.bfloat16())   # a 16-bit product: its GeGLU rounded to that dtype first
    pb = p.bfloat16().float()
    qr, sr = quant.quant_rows_ref((torch.nn.functional.gelu(pb[:, :192]) * pb[:, 192:]).bfloat16())
    assert torch.equal(qb.float(), qr.float()) and torch.equal(sb, sr)
    assert quant.fits(1024) and quant.fits(2624) and not quant.fits(1000)


@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("K,geglu", [(1024, False), (2624, True)])
def test_the_quantisation_kernels_compile_for_hopper_one_reduction_a_row(monkeypatch, tmp_path, K, geglu):
    """Built for sm_90a without a GPU: each thread holds bm * bk / threads floats of a chunk, the row maximum is
    one all-reduce after the first walk (not one per chunk), and the store converts to e4m3 with saturation."""
    import re

    from kernels import _tl

    monkeypatch.setattr(_tl, "_config", {"cache_dir": str(tmp_path), "arch": "sm_90a", "pdl": True})
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    cfg = quant.DEFAULT
    src = quant.quant_kernel(K, geglu).get_kernel_source()
    assert re.findall(r"float x\[(\d+)\]", src) == [str(cfg.bm * cfg.bk // cfg.threads)]
    assert src.count("AllReduce<tl::MaxOp") == 1 and "__NV_SATFINITE, __NV_E4M3" in src
    assert ("erf" in src) == geglu
    with pytest.raises(ValueError, match="multiple of the chunk width"):
        quant.build_quant(1000)


def test_the_fp8_kernel_list_for_warm_up_and_precompile():
    """The two norms with e4m3 outputs, three quantisations (d; the GeGLU's output; cuBLAS's GeGLU from the Wi
    product) and, on Hopper, the four products on e4m3 operands with Wqkv's RoPE and Wi's GeGLU; elsewhere cuBLAS
    does the products."""
    from kernels import gemm_manual as gm

    hop = fp8.kernel_specs(1024, 2624, (False, True, False), arch="sm_90a", sms=132)
    assert [args[:5] for kind, args in hop if kind == "add_ln"] == [(1024, m, False, 1e-5, torch.float8_e4m3fn)
                                                                    for m in ("inplace", "add")]
    assert [sp for sp in hop if sp[0] == "quant"] == [("quant", (1024, False, torch.bfloat16)),
                                                      ("quant", (2624, False, torch.bfloat16)),
                                                      ("quant", (2624, True, torch.bfloat16))]
    ws = [args for kind, args in hop if kind == "gemm_ws"]
    assert [(N, K, b, rope, g, f8) for N, K, _, b, _, rope, g, _, f8 in ws] == [
        (3072, 1024, False, 2048, False, True), (1024, 1024, True, 0, False, True), (2624, 1024, False, 0, True, True),
        (1024, 2624, False, 0, False, True)]
    assert ws[0][2] == gm.GEMM8 and ws[2][2] == gm.GEGLU8
    assert {kind for kind, _ in fp8.kernel_specs(1024, 2624, arch="sm_89", sms=128)} == {"add_ln", "quant"}
    # widths the quantisation kernel cannot walk: its torch form
    assert {kind for kind, _ in fp8.kernel_specs(1000, 2600, arch="sm_89", sms=128)} == {"add_ln"}


@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_the_norm_with_an_e4m3_output_compiles_for_hopper(monkeypatch, tmp_path):
    """The row's absolute maximum is one more all-reduce over the normalised row in registers; the store converts
    to e4m3 and the scale goes to S."""
    import re

    from kernels import _tl, layernorm

    monkeypatch.setattr(_tl, "_config", {"cache_dir": str(tmp_path), "arch": "sm_90a", "pdl": True})
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))
    src = layernorm.add_ln_kernel(1024, "add", False, 1e-5, torch.float8_e4m3fn).get_kernel_source()
    assert "__NV_SATFINITE, __NV_E4M3" in src and re.search(r"\bS\[", src) and src.count("AllReduce<tl::MaxOp") == 1
    cfg = layernorm.default_config(1024)
    assert re.findall(r"float x\[(\d+)\]", src) == [str(cfg.bm * 1024 // cfg.threads)]   # rows still split


# -- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("M", [1, 77, 1003])
@pytest.mark.parametrize("mode", ["add", "inplace"])
def test_the_norm_with_an_e4m3_output_equals_norm_then_quantise(M, mode):
    x = torch.randn(M, 1024, device="cuda") * 3000
    r = (torch.randn(M, 1024, device="cuda") * 50).bfloat16()
    w = torch.rand(1024, device="cuda") + 0.5
    xk = x.clone()
    q, s = fp8.add_ln(xk, r if mode == "add" else None, w, None, 1e-5, mode, "tilelang",
                      torch.empty(M, 1024, device="cuda", dtype=torch.bfloat16))
    xr = x.clone()
    qr, sr = fp8.add_ln(xr, r if mode == "add" else None, w, None, 1e-5, mode, "torch", None)
    torch.testing.assert_close(xk, xr, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
    diff = (q.float() - qr.float()).abs()   # fp32 LayerNorm's last bits may differ: at most one e4m3 step, rarely
    assert (diff > 0).float().mean() < 1e-3 and (diff <= qr.float().abs() / 8 + 2.0 ** -9).all()
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
@pytest.mark.parametrize("M", [1, 77, 1003, 40000])
@pytest.mark.parametrize("K,geglu", [(1024, False), (2624, True)])
def test_the_quantisation_kernels_equal_their_references(M, K, geglu):
    g = torch.Generator(device="cuda").manual_seed(M)
    a = (torch.randn(M, 2 * K if geglu else K, device="cuda", generator=g)
         * torch.logspace(-3, 2, M, device="cuda").unsqueeze(1)).bfloat16()
    a[M // 2] = 0
    q, s = quant.quant(a, geglu)
    qr, sr = (quant.geglu_quant_ref if geglu else quant.quant_rows_ref)(a)
    torch.testing.assert_close(s, sr, rtol=1e-6, atol=0)
    diff = (q.float() - qr.float()).abs()
    if geglu:   # erf's last bits may differ from torch's: at most one e4m3 step, on a sliver of the values
        assert (diff > 0).float().mean() < 1e-3 and (diff <= qr.float().abs() / 8 + 2.0 ** -9).all()
    else:
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    assert (q[M // 2].float() == 0).all() and torch.isfinite(s).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_fp8_with_the_kernels_equals_fp8_with_torch_ops_on_the_gpu(bundle, rows, rows_scored):
    """The kernels (norms with e4m3 outputs, quantisation, the e4m3 hand-warp-specialised GEMMs for the buckets past
    small_m) change where the work runs, not what it computes (the per-op tests hold each to its reference). End to
    end, on this random checkpoint, FP8 is chaotic: one bf16 ulp on 0.1% of one activation flips e4m3 codes and moves
    the answers by more than half as much as FP8 itself does (summation order, erf's last bits and the attention
    kernel's bf16 probabilities are such ulps), so the two forms are held to the same distance from fp32, not to
    each other."""
    dev = torch.device("cuda")
    fast = make_backend(load_model(bundle), bundle, dev, max_batch_tokens=4096, fp8=True)
    ref = make_backend(load_model(bundle), bundle, dev, max_batch_tokens=4096, fp8=True, ops="torch",
                       act_dtype=torch.bfloat16, use_graphs=False)
    kinds = {kind for kind, _ in fast.engine._kernel_specs()}
    assert {"quant", "add_ln", "gemm_ws"} <= kinds
    l1, p1 = fast.forward(rows)
    l2, p2 = ref.forward(rows)
    l_ref, p_ref = rows_scored
    dp = np.abs(_softmax(l1) - _softmax(l_ref)).max()
    dp_fp8 = np.abs(_softmax(l2) - _softmax(l_ref)).max()
    assert np.isfinite(l1).all() and dp <= 1.25 * dp_fp8 + 0.05, (dp, dp_fp8)
    agree, agree_t = ((lg.argmax(-1) == l_ref.argmax(-1)).mean() for lg in (l1, l2))
    assert agree >= agree_t - 0.05, (agree, agree_t)
    assert np.abs(p1 - p2).max() < 0.05 and np.abs(p1 - p_ref).max() <= 1.25 * np.abs(p2 - p_ref).max() + 0.02


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
def test_fp8_on_the_gpu_matches_its_cpu_form_and_captures_nothing_after_warm_up(bundle, rows, rows_scored,
                                                                               fp8_forward, monkeypatch):
    """LAYA_FLEET_CUDA_AMP=fp8 turns the fast backend's encoder GEMMs to e4m3 on its own; the answers sit about as
    near fp32 as the CPU form's (the same quantisation, bf16 activations, another summation order), graphs and
    all."""
    monkeypatch.setenv("LAYA_FLEET_CUDA_AMP", "fp8")
    fast = make_backend(load_model(bundle), bundle, torch.device("cuda"), max_batch_tokens=4096)
    assert fast.engine.fp8 and fast.engine.act_dtype == torch.bfloat16 and fast.precision == "fp8-e4m3"
    fast.warmup(4096)
    logits, act = fast.forward(rows)
    assert fast.stats.captures_after_warmup == 0
    l_ref, _ = rows_scored
    assert np.isfinite(logits).all() and np.isfinite(act).all()
    dp = np.abs(_softmax(logits) - _softmax(l_ref)).max()
    dp_cpu = np.abs(_softmax(fp8_forward[1][0]) - _softmax(l_ref)).max()
    assert dp <= max(0.05, 1.5 * dp_cpu), (dp, dp_cpu)
    assert (logits.argmax(-1) == l_ref.argmax(-1)).mean() >= 0.75
