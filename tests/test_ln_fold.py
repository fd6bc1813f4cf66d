"""The add+LayerNorm fold (kernels/ln_fold.py): its algebra on CPU, the tuning switch and the kernel list, the
folded forward on the torch ops against the unfolded one, the folded kernels' compiled structure (tilelang, no GPU)
and, on the GPU, each folded kernel against its reference at awkward sizes and the folded forward's numerics."""

import importlib.util
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels import gemm, ln_fold, rope, tuning
from kernels import gemm_manual as gm
from model.backends.fast import make_backend
from model.backends.fast import specs as forward
from model.bundle import load_model
from tests.test_kernels import _close, _node_local_kernel_cache, _poison, use_sm90  # noqa: F401

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
EPS = 1e-5
FOLD = tuning.Tuning(ln_fold_m=512)   # default small_m (256): buckets from 512 tokens up fold


def _stream(M, K, offset=40.0, seed=0, device="cpu"):
    """Rows with a mean far from zero (offset standard deviations), where an unshifted one-pass variance cancels."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(M, K, generator=g) + offset * torch.randn(M, 1, generator=g)).to(device)


def test_the_fold_is_layernorm_then_the_gemm():
    """rstd * (x W'^T - mu colsum(W')) + b with W' = W * gamma is LN(x) * gamma @ W^T + b, held to the fp64 value of
    the unfused ops on rows 40 standard deviations off zero; the GeGLU and residual references are the unfused ops'."""
    x = _stream(33, 96)
    gamma = 1 + 0.1 * torch.randn(96)
    w, b = torch.randn(80, 96) / 10, torch.randn(80)
    wp, cs = ln_fold.prepare(w, gamma, torch.float32)
    assert torch.equal(wp, w * gamma) and torch.allclose(cs, (w * gamma).sum(1))
    ln = F.layer_norm(x.double(), (96,), gamma.double(), None, EPS)
    exact = ln @ w.double().t()
    torch.testing.assert_close(ln_fold.fold_ref(x, wp, cs, b, EPS).double(), exact + b.double(), rtol=1e-4,
                               atol=1e-4)
    g, u = exact.chunk(2, -1)
    torch.testing.assert_close(ln_fold.geglu_fold_ref(x, wp, cs, EPS).double(), F.gelu(g) * u, rtol=1e-4, atol=1e-4)
    r, xs = torch.randn(33, 96).bfloat16(), torch.randn(33, 80)
    keep = xs.clone()
    xn, p = ln_fold.residual_ref(r, w, b, xs)
    torch.testing.assert_close(xn, xs + r.float() @ w.t() + b)
    assert p.dtype == torch.bfloat16 and torch.equal(p, xn.bfloat16()) and torch.equal(xs, keep)


def test_the_tuning_switch_and_the_kernel_list(tmp_path):
    """ln_fold_m: 0 (the committed table) folds nothing; above small_m, the kernel list of a model whose weights
    are folded gains the four folded forms where its buckets reach ln_fold_m; a bad value is refused, naming it."""
    assert tuning.TABLE.ln_fold_m == 0 and FOLD.as_dict()["ln_fold_m"] == 512
    path = tmp_path / "t.json"
    path.write_text(json.dumps(FOLD.as_dict()))
    assert tuning.Tuning.from_json(str(path)) == FOLD
    for bad in (256, 100, -1, True, "512", 1.5):
        with pytest.raises(ValueError, match="ln_fold_m"):
            tuning.Tuning.from_dict({"ln_fold_m": bad})
    dims = dict(d=1024, heads=16, inter=2624, ffn=4096, windows={0, 64}, arch="sm_90a", sms=132, table=FOLD)
    plain = forward.kernel_specs(**dims)
    folded = forward.kernel_specs(**dims, ln_fold=True)
    extra = [a for op, a in folded if (op, a) not in plain]
    assert sorted((a[0], a[1], a[6], a[9]) for a in extra) == [
        (1024, 1024, False, "residual"), (1024, 2624, False, "residual"), (2624, 1024, True, "fold"),
        (3072, 1024, False, "fold")]
    assert [a[5] for a in extra if a[0] == 3072] == [2048] and {a[10] for a in extra if a[9] == "fold"} == {EPS}
    assert forward.kernel_specs(**dims, ln_fold=True, max_tokens=256) == forward.kernel_specs(**dims, max_tokens=256)
    assert forward.kernel_specs(**dims, ln_fold=True, max_tokens=512) == folded
    assert not [a for op, a in forward.kernel_specs(**{**dims, "arch": "sm_80"}, ln_fold=True)
                if op == "gemm_ws"]


def test_a_bad_ln_form_is_refused():
    """An unknown form, the fold with an activation, e4m3 operands or the residual form with RoPE: a ValueError
    naming `ln` (before any TileLang is imported)."""
    for kw in ({"ln": "folded"}, {"ln": "fold", "act": "relu"}, {"ln": "fold", "fp8": True},
               {"ln": "residual", "rope_cols": 2048}):
        with pytest.raises(ValueError, match="ln is"):
            gm.build_gemm_manual(3072, 1024, gm.GEMM, **kw)


@pytest.fixture(scope="module")
def torch_forwards(bundle, rows):
    """{folded: (backend, logits, P(action 0), residual epilogues run)} on the torch ops, fp32, 4096-token buckets."""
    out = {}
    for fold in (False, True):
        be = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096,
                          tuning=FOLD if fold else tuning.Tuning())
        ran, residual = [], be.engine._residual
        be.engine._residual = lambda *a, ran=ran, f=residual: (ran.append(a[0].shape[0]), f(*a))
        out[fold] = (be,) + be.forward(rows) + (ran,)
    return out


def test_a_folded_forward_gives_the_unfolded_answers(torch_forwards, rows):
    """The same rows through the folded forward (buckets of 512+ tokens folded, smaller ones with unit-scale norms
    and W * gamma) and the unfolded one: the same answers to fp32 rounding."""
    be, l_fold, p_fold, ran = torch_forwards[True]
    _, l_ref, p_ref, none = torch_forwards[False]
    ff = be.engine
    assert ff.fold and not torch_forwards[False][0].engine.fold
    assert ff._fold_rows(512) and not ff._fold_rows(448)
    assert all(torch.equal(ly.mlp_norm[0], torch.ones(ff.d)) and ly.cs_i is not None for ly in ff.layers)
    assert ff.layers[0].cs_qkv is None and all(ly.cs_qkv is not None for ly in ff.layers[1:])
    assert ran and min(ran) >= 512 and not none   # folded chunks ran the residual epilogues
    np.testing.assert_allclose(l_fold, l_ref, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(p_fold, p_ref, atol=1e-5)


def test_a_small_bucket_with_folded_weights_gives_the_unfolded_answers(torch_forwards, rows):
    """Rows in buckets below ln_fold_m run the unfused ops on the folded weights (unit-scale norms, W * gamma)."""
    be, ran = torch_forwards[True][0], torch_forwards[True][3]
    few = [min(rows, key=lambda r: len(r.ids))]
    assert len(few[0].ids) < 448
    n = len(ran)
    lf, pf = be.forward(few)
    assert len(ran) == n   # nothing folded
    lr, pr = torch_forwards[False][0].forward(few)
    np.testing.assert_allclose(lf, lr, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(pf, pr, atol=1e-5)


def test_a_norm_with_a_shift_keeps_the_unfolded_weights(bundle):
    """The fold needs bias-free norms (ModernBERT's): one norm with a shift leaves every weight as it is."""
    m = load_model(bundle)
    m.encoder.layers[1].mlp_norm.bias = torch.nn.Parameter(torch.zeros(m.encoder.config.hidden_size))
    be = make_backend(m, bundle, torch.device("cpu"), ops="torch", max_batch_tokens=1024, tuning=FOLD)
    assert not be.engine.fold and be.engine.layers[1].cs_i is None


# -- compile only (tilelang, no GPU) -----------------------------------------------------------
@needs_tilelang
def test_folded_kernels_compile_for_hopper(monkeypatch):
    """The fold sums its rows from the A tiles under the wgmma (a shuffle joins a row's two halves), keeps each
    row's mean and rstd in shared memory behind the warpgroup's barrier and reads the row sums Cs; the residual form
    reads and writes X (fp32) and stores the rounded stream by TMA."""
    use_sm90(monkeypatch)
    q = gm.gemm_manual_kernel(3072, 1024, gm.GEMM, rope_cols=2048, ln="fold").get_kernel_source()
    assert "_r2048_lnf_e1em05" in q and "const float* Cs" in q and "Cos" in q and "rsqrtf" in q
    assert q.count("__shfl_xor_sync") == 4 and "St_s" in q   # two sums, two consumers
    for grp in (0, 1):   # each consumer reads its A half-tile in 16-byte loads
        assert "*(uint4*)(((bfloat16_t*)A%d_s)" % grp in q
    g = gm.gemm_manual_kernel(2624, 1024, gm.GEGLU, geglu=True, ln="fold").get_kernel_source()
    assert "lf_geglu_ws" in g and "erff" in g and "2623) + 2624)]" in g   # the gate half's row sums
    r = gm.gemm_manual_kernel(1024, 2624, replace(gm.GEMM, cluster=1), ln="residual").get_kernel_source()
    assert "_lnr" in r and "__shfl_xor_sync" not in r and "tma_store(" in r and "St_s" not in r
    assert "float* X" in r
    assert re.search(r"\*\(float2\*\)\(X \+", r) and re.search(r"< \(M \+ 64\)\) \{\s*\*\(float2\*\)\(X \+", r)
    k = gm.gemm_manual_kernel(1024, 1000, replace(gm.GEMM, cluster=1), ln="fold").get_kernel_source()
    assert "< 125)) {" in k   # past column 1000 (chunk 125 of 8): TMA zero-fill, left out of the row sums


# -- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
DEV = "cuda"


def _weights(N, K, dtype=torch.bfloat16):
    w = torch.randn(N, K, device=DEV) * K ** -0.5
    gamma = 1 + 0.1 * torch.randn(K, device=DEV)
    return ln_fold.prepare(w, gamma, dtype)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 4099, 40000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_folded_gemm_equals_the_reference(M, dtype):
    """Wqkv folded with its RoPE, a plain fold with a bias and a K tail, and the GeGLU fold (F = 2624: a partial last
    tile), on rows whose mean is 40 standard deviations from zero."""
    a = _stream(M, 1024, device=DEV).to(dtype)
    w, cs = _weights(3072, 1024, dtype)
    pos = torch.randint(0, 512, (M,), device=DEV, dtype=torch.int32)
    cos, sin = rope.rope_tables(160000.0, 512, DEV)
    z = gemm._zeros(3072, DEV)
    out = _poison(M, 3072, dtype=dtype)
    gm.gemm_manual_kernel(3072, 1024, gm.GEMM, rope_cols=2048, dtype=dtype, ln="fold")(a, w, z, cs, out, pos, cos,
                                                                                        sin)
    ref = rope.rope_ref(ln_fold.fold_ref(a, w, cs, None, EPS).to(dtype), pos, cos, sin, 16)
    _close(out, ref, 1e-2)
    w2, cs2 = _weights(1024, 1000, dtype)
    b = torch.randn(1024, device=DEV)
    a2 = _stream(M, 1000, device=DEV).to(dtype)
    out2 = _poison(M, 1024, dtype=dtype)
    gm.gemm_manual_kernel(1024, 1000, replace(gm.GEMM, cluster=1), True, dtype=dtype, ln="fold")(a2, w2, b, cs2, out2)
    _close(out2, ln_fold.fold_ref(a2, w2, cs2, b, EPS), 1e-2)
    wi, csi = _weights(2 * 2624, 1024, dtype)
    g = _poison(M, 2624, dtype=dtype)
    gm.gemm_manual_kernel(2624, 1024, gm.GEGLU, geglu=True, dtype=dtype, ln="fold")(a, wi, csi, g)
    _close(g, ln_fold.geglu_fold_ref(a, wi, csi, EPS), 1.5e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 4099, 40000])
@pytest.mark.parametrize("N,K,bias", [(1024, 1024, True), (1024, 2624, False), (1000, 1024, True)])
def test_residual_gemm_adds_to_the_stream(M, N, K, bias):
    """X += A @ W^T + b for rows < M only (a sentinel row past M is untouched), and C = X rounded; N = 1000: a
    partial last column tile."""
    a = torch.randn(M, K, device=DEV).bfloat16()
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
    b = torch.randn(N, device=DEV) if bias else gemm._zeros(N, DEV)
    xs = torch.randn(M + 1, N, device=DEV) * 10
    x = xs.clone()
    out = _poison(M, N)
    gm.gemm_manual_kernel(N, K, replace(gm.GEMM, cluster=1), bias, ln="residual")(a, w, b, x[:M], out)
    xr, pr = ln_fold.residual_ref(a, w, b if bias else None, xs[:M])
    torch.testing.assert_close(x[:M], xr, atol=2e-3, rtol=1e-4)
    assert torch.equal(x[M], xs[M]) and torch.equal(out, x[:M].bfloat16())
    _close(out, pr, 1e-2)


@gpu
@needs_tilelang
def test_the_folded_fast_forward_stays_as_near_fp32(bundle, rows, rows_scored):
    """The GPU forward with the fold from 1024 tokens up against the eager fp32 answers, as near as the unfolded
    forward (fp16: within 0.02 of P), and no graph captured after warm-up."""
    from tests.test_fast import _softmax

    fold = replace(tuning.TABLE, ln_fold_m=tuning.TABLE.small_m + 128)
    assert sum(len(r.ids) for r in rows) > fold.ln_fold_m
    l_ref, _ = rows_scored
    errs = {}
    for t in (tuning.TABLE, fold):
        be = make_backend(load_model(bundle), bundle, torch.device(DEV), act_dtype=torch.float16,
                          max_batch_tokens=4096, tuning=t)
        be.warmup()
        lg, _ = be.forward(rows)
        assert be.engine.stats.captures_after_warmup == 0
        errs[t.ln_fold_m] = float(np.abs(_softmax(lg) - _softmax(l_ref)).max())
    assert errs[fold.ln_fold_m] <= max(0.02, 1.5 * errs[0]), errs
