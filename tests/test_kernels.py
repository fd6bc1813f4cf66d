"""Kernel tests: the torch references against independent formulas (CPU), a compile check for sm_90a (needs
tilelang, no GPU), and every TileLang kernel against its reference at awkward sizes (GPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.fastpath_sweep import ATTENTION, SWEEP_GEGLU, SWEEP_GEMM, SWEEP_LN
from kernels import _tl, attention, geglu, gemm, layernorm, rope, tuning
from model.backends.fast import row_capacity, token_buckets

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def use_tilelang(monkeypatch, cache_dir: str | None = None, arch: str | None = None) -> None:
    """Build kernels for `arch` (None: the visible GPU's) into `cache_dir`, by default the node-local TileLang
    cache the fast backend uses (what `laya-fleet precompile --pack` fills); undone after the test."""
    from model.cache import local_dir

    cache_dir = cache_dir or local_dir("tilelang")
    monkeypatch.setattr(_tl, "_config", {"cache_dir": cache_dir, "arch": arch, "pdl": True})
    monkeypatch.setenv("TILELANG_CACHE_DIR", cache_dir)


def use_sm90(monkeypatch, cache_dir: str | None = None) -> None:
    """Build kernels for sm_90a, as an image build does without the GPU (see `use_tilelang`)."""
    use_tilelang(monkeypatch, cache_dir, "sm_90a")


@pytest.fixture(autouse=True)
def _node_local_kernel_cache(monkeypatch):
    use_tilelang(monkeypatch)
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")


def _packed_qkv(lengths, heads, extra=0, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    total = int(sum(lengths))
    qkv = torch.randn(total + extra, 3 * heads * 64, generator=g)
    qkv[total:] = 0  # stream padding: finite, like the forward's zero-filled buffers
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    return qkv.to(device), cu.to(device)


# -- CPU: references and host-side helpers ------------------------------------------------------
def test_tile_table_covers_every_row_once():
    lengths = [1, 64, 65, 130, 7, 1024]
    t = attention.tile_table(lengths, 64, capacity=40, empty_row=9)
    real = [(int(r), int(q)) for r, q in t if r != 9]
    expect = [(i, q) for i, n in enumerate(lengths) for q in range(0, n, 64)]
    assert real == expect
    assert (t[len(expect):] == [9, 0]).all()
    with pytest.raises(ValueError):
        attention.tile_table(lengths, 64, capacity=3)


@pytest.mark.parametrize("window", [0, 64])
def test_attention_references_agree(window):
    lengths = [1, 5, 64, 65, 200]
    qkv, cu = _packed_qkv(lengths, heads=2, extra=11)
    ref = attention.attention_ref(qkv, cu, 2, window)
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    row = torch.cat([row, torch.full((11,), -1)])
    pos = torch.cat([pos, torch.zeros(11, dtype=torch.long)])
    dense = attention.attention_dense(qkv, row, pos, 2, window)
    total = sum(lengths)
    torch.testing.assert_close(dense[:total], ref[:total], atol=1e-5, rtol=1e-5)
    # a length-1 row attends only to itself
    torch.testing.assert_close(ref[0], qkv[0, 2 * 128:3 * 128])


def test_rope_ref_matches_transformers():
    from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

    heads, n = 2, 37
    qkv = torch.randn(n, 3 * heads * 64)
    cos, sin = rope.rope_tables(160000.0, 64)
    pos = torch.arange(n, dtype=torch.int32)
    out = rope.rope_ref(qkv, pos, cos, sin, heads).view(n, 3, heads, 64)
    x = qkv.view(n, 3, heads, 64)
    c2 = torch.cat([cos[:n], cos[:n]], -1)[None]
    s2 = torch.cat([sin[:n], sin[:n]], -1)[None]
    q, k = apply_rotary_pos_emb(x[:, 0].transpose(0, 1)[None], x[:, 1].transpose(0, 1)[None], c2, s2)
    torch.testing.assert_close(out[:, 0], q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 1], k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 2], x[:, 2])


def test_add_ln_ref_modes():
    x = torch.randn(5, 32) * 30
    r = torch.randn(5, 32).bfloat16()
    w, b = torch.rand(32) + 0.5, torch.randn(32)
    xa, ya = layernorm.add_ln_ref(x, r, w, b, 1e-5, "add")
    assert torch.equal(xa, x + r.float())
    torch.testing.assert_close(ya, F.layer_norm(x + r.float(), (32,), w, b, 1e-5).bfloat16())
    xp, yp = layernorm.add_ln_ref(x, None, w, None, 1e-5, "plain", torch.float32)
    assert torch.equal(xp, x)
    xi, yi = layernorm.add_ln_ref(x, r, w, None, 1e-5, "add_inplace", torch.float32)
    assert torch.equal(xi, yi)


def test_geglu_ref_is_first_half_gelu_times_second():
    a = torch.randn(3, 16)
    wi = torch.randn(10, 16)
    y = a @ wi.t()
    torch.testing.assert_close(geglu.geglu_ref(a, wi), F.gelu(y[:, :5]) * y[:, 5:])


def test_token_buckets():
    b = token_buckets(65536)
    assert b[0] == 64 and b[-1] == 65536 and b == sorted(set(b))
    assert all(x % 64 == 0 for x in b)
    assert max(b[i + 1] / b[i] for i in range(len(b) - 1)) <= 2
    assert all(b[i + 1] / b[i] <= 1.126 for i in range(len(b) - 1) if b[i] >= 512)
    assert 15360 in b and 4096 + 512 in b   # 10 x 3 rows of 512 tokens pad nothing
    assert token_buckets(100)[-1] == 128
    assert row_capacity(64) == 8 and row_capacity(65536) == 4096


# -- compile only (tilelang, no GPU) -----------------------------------------------------------
@needs_tilelang
def test_kernels_compile_for_hopper(monkeypatch):
    use_sm90(monkeypatch)
    ln = layernorm.add_ln_kernel(128, "add", False, 1e-5, torch.bfloat16)
    assert "__launch_bounds__" in ln.get_kernel_source()
    at = attention.attention_kernel(2, 64, attention.WARP_SPECIALISED)
    src = at.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src


@needs_tilelang
def test_kernels_wait_for_the_previous_grid_before_any_role_starts(monkeypatch):
    """Under programmatic dependent launch a kernel may start before its predecessor ends: every thread must pass
    griddepcontrol.wait before its role (producer or consumer warps) touches memory, and only then signal the next
    grid. Without it (pdl=False) neither call is emitted."""
    from kernels import gemm_manual

    use_sm90(monkeypatch)
    srcs = {"manual": gemm_manual.gemm_manual_kernel(1024, 1024, gemm_manual.GemmWSConfig(), True).get_kernel_source(),
            "gemm": gemm.gemm_kernel(1024, 1024, True, "none", gemm.SMALL).get_kernel_source(),
            "attention": attention.attention_kernel(2, 64).get_kernel_source(),
            "add_ln": layernorm.add_ln_kernel(128, "add", False, 1e-5, torch.bfloat16).get_kernel_source()}
    for name, src in srcs.items():
        wait = src.find("cudaGridDependencySynchronize();")
        trigger = src.find("cudaTriggerProgrammaticLaunchCompletion();")
        assert src.count("cudaGridDependencySynchronize();") == 1 and 0 < wait < trigger, name
        role = src.find("threadIdx.x) < 128")
        assert role == -1 or wait < role, name
    monkeypatch.setitem(_tl._config, "pdl", False)
    plain = layernorm.add_ln_kernel(128, "add", False, 1e-5, torch.bfloat16).get_kernel_source()
    assert "cudaGridDependency" not in plain and "cudaTriggerProgrammatic" not in plain


@needs_tilelang
@pytest.mark.parametrize("pdl", [False, True])
def test_cluster_gemms_wait_for_the_previous_grid_in_every_build(monkeypatch, pdl):
    """TileLang's runtime launches every cluster kernel as a programmatic dependent, so it may start once the
    previous kernel's blocks have exited, before their writes are flushed: the 2-CTA hand-WS GEMMs wait in the
    plain build too (without the trigger there), while a one-block-per-tile build without PDL waits for nothing."""
    from kernels import gemm_manual

    use_sm90(monkeypatch)
    monkeypatch.setitem(_tl._config, "pdl", pdl)
    for cfg, n, glu in ((gemm_manual.GEMM, 3072, False), (gemm_manual.GEGLU, 2624, True)):
        src = gemm_manual.gemm_manual_kernel(n, 1024, cfg, geglu=glu).get_kernel_source()
        wait = src.find("cudaGridDependencySynchronize();")
        assert src.count("cudaGridDependencySynchronize();") == 1 and 0 < wait < src.find("threadIdx.x) < 128")
        assert ("cudaTriggerProgrammaticLaunchCompletion();" in src) == pdl
    single = gemm_manual.gemm_manual_kernel(1024, 1024, gemm_manual.GemmWSConfig(persistent=132)).get_kernel_source()
    assert ("cudaGridDependencySynchronize();" in single) == pdl


@needs_tilelang
def test_fp16_kernels_compile_for_hopper_with_half_operands(monkeypatch):
    """act_dtype fp16: every kernel of the forward compiles for sm_90a with fp16 operands (tensor-core products
    on half inputs, fp32 accumulation), under names of their own; the bf16 kernels keep theirs."""
    use_sm90(monkeypatch)
    f16 = torch.float16
    g = gemm.gemm_kernel(1024, 1024, True, "none", gemm.SMALL, f16, f16).get_kernel_source()
    assert "kFloat16" in g and "kBFloat16" not in g
    gg = geglu.geglu_kernel(2624, 1024, geglu.SMALL, f16).get_kernel_source()
    assert "kFloat16" in gg and "kBFloat16" not in gg
    at = attention.attention_kernel(16, 64, attention.DEFAULT, f16).get_kernel_source()
    assert "kFloat16" in at and "kBFloat16" not in at
    ln = layernorm.add_ln_kernel(1024, "add", False, 1e-5, f16, r_dtype=f16).get_kernel_source()
    assert "half_t" in ln and "bfloat16_t" not in ln
    rp = rope.rope_kernel(16, dtype=f16).get_kernel_source()
    assert "half_t" in rp and "bfloat16_t" not in rp
    bf = attention.attention_kernel(16, 64, attention.DEFAULT).get_kernel_source()
    assert "kBFloat16" in bf and "lf_attn_h16_w64_c64x64s1t128gnlv_pdl_kernel" in bf
    assert "lf_attn_h16_w64_c64x64s1t128gnlv_ifloat16_pdl_kernel" in at


@needs_tilelang
@pytest.mark.parametrize("window", [0, 64])
def test_attention_without_warp_specialisation_compiles_for_hopper(monkeypatch, window):
    """The default (ws=False): no producer warpgroup and no register reallocation, so several blocks share an SM;
    the warp-specialised form has both."""
    import re

    use_sm90(monkeypatch)
    cfg = attention.UNSPECIALISED
    assert not cfg.ws and attention.DEFAULT == attention.OVERLAP
    src = attention.attention_kernel(16, window, cfg).get_kernel_source()
    assert re.findall(r"__launch_bounds__\((\d+)", src) == [str(cfg.threads)]
    assert "reg_alloc" not in src and "wgmma" in src and "cp_async" in src
    ws = attention.attention_kernel(16, window, attention.WARP_SPECIALISED).get_kernel_source()
    assert re.findall(r"__launch_bounds__\((\d+)", ws) == [str(attention.WARP_SPECIALISED.threads + 128)]
    assert "reg_alloc" in ws
    # the lean form: the QK^T product starts from zero itself (the first wgmma of each block does not accumulate)
    # instead of a separate clear, under a kernel name of its own
    lean = attention.attention_kernel(16, window, attention.LEAN).get_kernel_source()
    assert re.findall(r"__launch_bounds__\((\d+)", lean) == [str(attention.LEAN.threads)]
    assert "(0 < ki) ? 1 : 0" in lean and "(0 < ki) ? 1 : 0" not in src
    assert "lf_attn_h16_w%d_c64x64s1t128gnl_pdl_kernel" % window in lean
    # the overlapped form: K and V through TMA into two-slot rings (Q, the first K/V and the second K before the
    # loop, V_j and K_{j+1} in it), QK^T waited for while PV stays in flight, one block-wide sync a key block
    # (plus the barrier init's and the epilogue's), no cp.async, and ptxas asked for nothing (one warpgroup)
    ov = attention.attention_kernel(16, window, attention.OVERLAP).get_kernel_source()
    assert ov.count("tl::tma_load(QKV_desc") == 6 and "cp_async" not in ov
    assert "wait_wgmma<1>" in ov and "wgmma_rs" in ov and ov.count("__syncthreads()") == 3
    assert "lf_attn_h16_w%d_c64x64s1t128gnlv_pdl_kernel" % window in ov
    o5 = attention.attention_kernel(16, window, attention.AttnConfig(guard=True, ws=False, lean=True, occupancy=5))
    assert "__launch_bounds__(128, 5)" in o5.get_kernel_source()
    with pytest.raises(ValueError, match="overlapped"):
        attention.build_attention(16, window, attention.AttnConfig(bn=128, guard=True, ws=False, lean=True,
                                                                    overlap=True))


@needs_tilelang
@pytest.mark.parametrize("window", [0, 64])
def test_attention_walking_several_heads_a_block_compiles_for_hopper(monkeypatch, window):
    """hp > 1: a block of the overlapped kernel takes hp heads of its query tile in turn. The next head's Q loads
    inside the loop (two more TMA loads than one head a block), each finished head is written through a V slot
    (two more syncs), and the dynamic shared memory stays one head's 48 KiB, so four blocks still fit an SM."""
    from dataclasses import replace

    use_sm90(monkeypatch)
    one = attention.attention_kernel(16, window, attention.OVERLAP)
    four = attention.attention_kernel(16, window, replace(attention.OVERLAP, hp=4))
    src = four.get_kernel_source()
    assert "lf_attn_h16_w%d_c64x64s1t128gnlvh4_pdl_kernel" % window in src
    assert src.count("tl::tma_load(QKV_desc") == 8 and src.count("__syncthreads()") == 6
    assert "fence_proxy_async" in src and "fence_proxy_async" not in one.get_kernel_source()
    for k in (one, four):
        assert "((int64_t)49152)" in k.get_host_source(), "dynamic shared memory is not 48 KiB"
    attention.attention_kernel(3, window, replace(attention.OVERLAP, hp=2))   # the last block takes one head
    with pytest.raises(ValueError, match="overlapped kernel only"):
        attention.build_attention(16, window, replace(attention.LEAN, hp=2))
    with pytest.raises(ValueError, match="hp=0"):
        attention.build_attention(16, window, replace(attention.OVERLAP, hp=0))


@needs_tilelang
def test_persistent_and_rope_fused_gemms_compile_for_hopper(monkeypatch):
    """A persistent GEMM launches one block per SM (a fixed grid) that loops over the tiles; the RoPE-fused Wqkv
    GEMM takes positions and tables, rotates Q/K tiles in shared memory and stores every tile through TMA (no
    element-wise global stores: C is only reached through its tensor map)."""
    import re

    use_sm90(monkeypatch)
    pers = gemm.GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256, persistent=132)
    assert pers.tag() == "128x256x64s3t256rp132" and gemm.LARGE.tag() == "128x256x64s3t256r"
    src = gemm.gemm_kernel(3072, 1024, False, "none", pers).get_kernel_source()
    assert re.search(r"for \(int (\w+) = 0; \1 < [^;]*M[^;]*; \+\+\1\) \{", src) and "* 132)" in src, \
        "no loop over waves of 132 tiles"
    assert "wgmma" in src and "tma_store" in src
    gsrc = geglu.geglu_kernel(2624, 1024, geglu.GegluConfig(persistent=132)).get_kernel_source()
    assert re.search(r"for \(int (\w+) = 0; \1 < [^;]*M[^;]*; \+\+\1\) \{", gsrc) and "* 132)" in gsrc
    for cfg in (gemm.SMALL, gemm.LARGE, pers):
        k = gemm.gemm_kernel(3072, 1024, False, "none", cfg, rope_cols=2048)
        rs = k.get_kernel_source()
        assert "Cos" in rs and "Sin" in rs and "Pos" in rs and "tma_store" in rs and "_r2048_" in rs
        assert "C_desc" in rs and not re.search(r"\* __restrict__ C\b", rs)
        names = ("A", "W", "Bias", "C", "Pos", "Cos", "Sin")
        assert [p.name for p in k.prim_func.params] == [n + "_handle" for n in names]
    with pytest.raises(ValueError, match="RoPE"):
        gemm.build_gemm(3072, 1024, cfg=gemm.GemmConfig(bn=96), rope_cols=2048)


@needs_tilelang
def test_unspecialised_gemm_and_geglu_compile_for_hopper(monkeypatch):
    """ws=False: no producer warpgroup or register reallocation (a block of `threads` threads whose cp.async
    pipeline feeds wgmma), under a name of its own; the default keeps TileLang's warp specialisation."""
    import re

    use_sm90(monkeypatch)
    g = gemm.GemmConfig(bm=128, bn=128, bk=64, stages=3, threads=256, ws=False)
    assert g.tag() == "128x128x64s3t256rn" and g in SWEEP_GEMM
    gg = geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, ws=False)
    assert gg.tag() == "128x128x64s3t256rn" and gg in SWEEP_GEGLU
    for src in (gemm.gemm_kernel(3072, 1024, False, "none", g).get_kernel_source(),
                gemm.gemm_kernel(3072, 1024, False, "none", g, rope_cols=2048).get_kernel_source(),
                geglu.geglu_kernel(2624, 1024, gg).get_kernel_source()):
        assert re.findall(r"__launch_bounds__\((\d+)", src) == ["256"]
        assert "reg_alloc" not in src and "wgmma" in src and "cp_async" in src and "rn_" in src
    ws = gemm.gemm_kernel(3072, 1024, False, "none", gemm.LARGE).get_kernel_source()
    assert re.findall(r"__launch_bounds__\((\d+)", ws) == ["384"] and "reg_alloc" in ws


@needs_tilelang
@pytest.mark.parametrize("D", [128, 384, 768, 1024])
def test_add_ln_splits_each_row_over_the_threads(monkeypatch, D):
    """Each thread holds bm * D / threads floats of x and the row sums go through a block all-reduce. The
    layout TileLang infers otherwise gives every thread whole rows (float x[D], spilled to local memory), as 4 rows x
    128 threads do at D = 768."""
    import re

    use_sm90(monkeypatch)
    cfg = layernorm.default_config(D)
    assert (D // 4) % cfg.threads == 0 and cfg.threads & (cfg.threads - 1) == 0
    src = layernorm.add_ln_kernel(D, "add", False, 1e-5, torch.bfloat16).get_kernel_source()
    regs = [int(n) for n in re.findall(r"float x\[(\d+)\]", src)]
    assert regs == [cfg.bm * D // cfg.threads] and "AllReduce" in src
    if D == 768:  # the failure this guards against, with the config that had it
        old = layernorm.add_ln_kernel(D, "add", False, 1e-5, torch.bfloat16, layernorm.LNConfig(4, 128))
        assert re.findall(r"float x\[(\d+)\]", old.get_kernel_source()) == ["768"]


@needs_tilelang
def test_add_ln_sweep_candidates_split_rows_over_threads(monkeypatch):
    """Every add+LN candidate of the benchmark's sweep keeps the split layout at D = 1024 (no whole rows per
    thread), and a winner in the tuning table is what the forward picks."""
    import re

    use_sm90(monkeypatch)
    for cfg in SWEEP_LN:
        assert 256 % cfg.threads == 0
        src = layernorm.add_ln_kernel(1024, "add", False, 1e-5, torch.bfloat16, cfg).get_kernel_source()
        assert [int(n) for n in re.findall(r"float x\[(\d+)\]", src)] == [cfg.bm * 1024 // cfg.threads], cfg
    table = tuning.Tuning().with_entry("add_ln", "1024", SWEEP_LN[-1])
    assert tuning.pick_add_ln(1024, table) == SWEEP_LN[-1]
    assert tuning.pick_add_ln(768, table) == layernorm.default_config(768)
    cfg = tuning.pick_add_ln(1024, table)
    src = layernorm.add_ln_kernel(1024, "add", False, 1e-5, cfg=cfg).get_kernel_source()
    assert "_c%s_" % SWEEP_LN[-1].tag() in src


@needs_tilelang
def test_kernel_index_loads_the_same_kernel_without_the_frontend(monkeypatch, tmp_path):
    """The second compile of a kernel comes from our index (kernels/_tl.py) without calling its builder, and is
    the same kernel: same PrimFunc, params, dynamic shapes and source. A stale entry falls back to compiling."""
    use_sm90(monkeypatch)
    _tl.tl()
    use_sm90(monkeypatch, str(tmp_path))  # read by TileLang and the index on every access
    calls = []

    def build():
        calls.append(1)
        return layernorm.build_add_ln(192, "add", True, 1e-5, "bfloat16")

    first = _tl.compile_func(build, "lf_test_index_ln")
    index = _tl.index_path("lf_test_index_ln", _tl.target(), False)
    assert calls == [1] and index.startswith(str(tmp_path)) and os.path.isfile(index)

    def refuse():
        raise AssertionError("the index hit ran the frontend")

    again = _tl.compile_func(refuse, "lf_test_index_ln")
    assert again is not first
    assert again.prim_func.script() == first.prim_func.script()
    assert again.get_kernel_source() == first.get_kernel_source()
    assert [(str(p.dtype), str(p.shape)) for p in again.params] == [(str(p.dtype), str(p.shape)) for p in first.params]
    assert str(again.adapter.dynamic_symbolic_map) == str(first.adapter.dynamic_symbolic_map)
    # other options are other entries: fast math never loads the plain kernel
    assert _tl.index_path("lf_test_index_ln", _tl.target(), True) != index
    # an entry pointing at a kernel the cache no longer has, or garbage: compiled again, the index rewritten
    with open(index) as f:
        entry = json.load(f)
    for bad in (dict(entry, key="0" * 64), "not json"):
        with open(index, "w") as f:
            f.write(bad if isinstance(bad, str) else json.dumps(bad))
        k = _tl.compile_func(build, "lf_test_index_ln")
        assert k.get_kernel_source() == first.get_kernel_source()
        with open(index) as f:
            assert json.load(f)["key"] == entry["key"]
    assert calls == [1, 1, 1]


# -- GPU: every kernel against its reference at awkward sizes ----------------------------------
gpu = pytest.mark.gpu
DEV = "cuda"


def _poison(*shape, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


def _close(out, ref, tol):
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    err = (out - ref).norm() / ref.norm().clamp_min(1e-6)
    assert err < tol, "relative error %.3g >= %.3g" % (err, tol)
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max() + 1e-3


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 200, 1000])
@pytest.mark.parametrize("N,K,bias,act", [(3072, 1024, False, "none"), (1024, 1024, True, "gelu"),
                                          (1024, 2624, False, "none")])
@pytest.mark.parametrize("cfg", ["SMALL", "LARGE"])
def test_gemm(M, N, K, bias, act, cfg):
    a = torch.randn(M, K, device=DEV).bfloat16()
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
    b = torch.randn(N, device=DEV) if bias else None
    out = _poison(M, N)
    gemm.gemm(a, w, b, act, out=out, cfg=getattr(gemm, cfg))
    _close(out, gemm.gemm_ref(a, w, b, act), 1e-2)


PERSISTENT = gemm.GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256, persistent=132)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [77, 1000, 40000])
def test_persistent_gemm_and_geglu(M):
    """Persistent tiles at a partial last tile and at more tiles than blocks (40000 rows: 313 x 12 tiles over 132
    blocks); every row checked."""
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    w = (torch.randn(3072, 1024, device=DEV) * 1024 ** -0.5).bfloat16()
    out = _poison(M, 3072)
    gemm.gemm(a, w, out=out, cfg=PERSISTENT)
    _close(out, gemm.gemm_ref(a, w), 1e-2)
    wi = (torch.randn(2 * 2624, 1024, device=DEV) / 32).bfloat16()
    g = _poison(M, 2624)
    geglu.geglu(a, wi, out=g, cfg=geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, persistent=132))
    _close(g, geglu.geglu_ref(a, wi), 1.5e-2)


UNSPECIALISED_GEMM = [c for c in SWEEP_GEMM if not c.ws]
UNSPECIALISED_GEGLU = [c for c in SWEEP_GEGLU if not c.ws]


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [77, 1000, 40000])
def test_unspecialised_gemm_and_geglu(M):
    """The sweep's candidates without warp specialisation (cp.async pipeline, two blocks an SM): every row checked
    at a partial last tile and at many tiles."""
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    w = (torch.randn(3072, 1024, device=DEV) * 1024 ** -0.5).bfloat16()
    ref = gemm.gemm_ref(a, w)
    for c in UNSPECIALISED_GEMM:
        out = _poison(M, 3072)
        gemm.gemm(a, w, out=out, cfg=c)
        _close(out, ref, 1e-2)
    wi = (torch.randn(2 * 2624, 1024, device=DEV) / 32).bfloat16()
    ref = geglu.geglu_ref(a, wi)
    for c in UNSPECIALISED_GEGLU:
        g = _poison(M, 2624)
        geglu.geglu(a, wi, out=g, cfg=c)
        _close(g, ref, 1.5e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 200, 1000])
@pytest.mark.parametrize("cfg", ["SMALL", "LARGE", "PERSISTENT", "UNSPECIALISED"])
def test_gemm_with_rope_epilogue_equals_gemm_then_rope(M, cfg):
    """The fused Wqkv GEMM + RoPE gives what the GEMM kernel followed by the RoPE kernel gives (the same rounding
    of the product before the rotation), V columns untouched by the rotation."""
    c = {"PERSISTENT": PERSISTENT, "UNSPECIALISED": UNSPECIALISED_GEMM[0]}.get(cfg) or getattr(gemm, cfg)
    heads = 16
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    w = (torch.randn(3 * 1024, 1024, device=DEV) * 1024 ** -0.5).bfloat16()
    pos = torch.randint(0, 512, (M,), device=DEV, dtype=torch.int32)
    cos, sin = rope.rope_tables(160000.0, 512, DEV)
    two_step = gemm.gemm(a, w, cfg=c)
    rope.rope(two_step, pos, cos, sin, heads)
    fused = _poison(M, 3072)
    gemm.gemm_kernel(3072, 1024, False, "none", c, rope_cols=2048)(a, w, gemm._zeros(3072, DEV), fused, pos, cos, sin)
    _check_fused_rope(fused, two_step, a, w, pos, cos, sin, heads)


def _check_fused_rope(fused, two_step, a, w, pos, cos, sin, heads):
    """A Wqkv GEMM with its RoPE epilogue against the GEMM then the RoPE kernel (the same rounding of the product
    before the rotation: at most an ulp here and there from fma contraction), V columns untouched, and against the
    fp32 reference."""
    assert torch.isfinite(fused.float()).all()
    torch.testing.assert_close(fused.float(), two_step.float(), atol=1e-2, rtol=1e-2)
    assert (fused != two_step).float().mean() < 0.01
    assert torch.equal(fused[:, 2048:], two_step[:, 2048:])
    _close(fused, rope.rope_ref(gemm.gemm_ref(a, w), pos, cos, sin, heads), 1e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [5, 1000])
def test_gemm_relu_and_narrow_fp32(M):
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    w = (torch.randn(4096, 1024, device=DEV) / 32).bfloat16()
    b = torch.randn(4096, device=DEV)
    out = _poison(M, 4096)
    gemm.gemm(a, w, b, "relu", out=out, cfg=gemm.LARGE)
    _close(out, gemm.gemm_ref(a, w, b, "relu"), 1e-2)
    w16 = torch.zeros(16, 1024, device=DEV)
    w16[0] = torch.randn(1024, device=DEV) / 32
    w16 = w16.bfloat16()
    b16 = torch.zeros(16, device=DEV)
    b16[0] = 0.3
    o16 = _poison(M, 16, dtype=torch.float32)
    gemm.gemm(a, w16, b16, out=o16, cfg=gemm.NARROW)
    _close(o16[:, 0], gemm.gemm_ref(a, w16, b16, out_dtype=torch.float32)[:, 0], 1e-4)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 1000])
@pytest.mark.parametrize("cfg", ["SMALL", "LARGE"])
def test_geglu(M, cfg):
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    wi = (torch.randn(2 * 2624, 1024, device=DEV) / 32).bfloat16()
    out = _poison(M, 2624)
    geglu.geglu(a, wi, out=out, cfg=getattr(geglu, cfg))
    _close(out, geglu.geglu_ref(a, wi), 1.5e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 1003])
@pytest.mark.parametrize("mode", ["add", "plain", "inplace", "add_inplace"])
@pytest.mark.parametrize("bias", [False, True])
def test_add_ln(M, mode, bias):
    x = torch.randn(M, 1024, device=DEV) * 3000
    r = (torch.randn(M, 1024, device=DEV) * 50).bfloat16()
    w = torch.rand(1024, device=DEV) + 0.5
    b = torch.randn(1024, device=DEV) if bias else None
    xr, yr = layernorm.add_ln_ref(x, r, w, b, 1e-5, mode)
    xk = x.clone()
    y = _poison(M, 1024)
    layernorm.add_ln(xk, r if mode in ("add", "add_inplace") else None, w, b, 1e-5, y, mode)
    if mode == "add":
        assert torch.equal(xk, x + r.float())  # the fp32 stream is exact
    elif mode == "plain":
        assert torch.equal(xk, x)
    else:
        torch.testing.assert_close(xk, xr, atol=2e-5, rtol=1e-5)
    _close(y, yr, 1e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 1003])
@pytest.mark.parametrize("bias", [False, True])
def test_add_ln_sweep_candidates(M, bias):
    """Each add+LN config the benchmark may pick gives the reference's answer ("add" mode, the encoder's)."""
    x = torch.randn(M, 1024, device=DEV) * 3000
    r = (torch.randn(M, 1024, device=DEV) * 50).bfloat16()
    w = torch.rand(1024, device=DEV) + 0.5
    b = torch.randn(1024, device=DEV) if bias else None
    _, yr = layernorm.add_ln_ref(x, r, w, b, 1e-5, "add")
    for cfg in SWEEP_LN:
        xk, y = x.clone(), _poison(M, 1024)
        layernorm.add_ln_kernel(1024, "add", bias, 1e-5, torch.bfloat16, cfg)(xk, r, w, b if bias else w, y)
        assert torch.equal(xk, x + r.float()), cfg
        _close(y, yr, 1e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 1000])
@pytest.mark.parametrize("theta", [160000.0, 10000.0])
def test_rope(M, theta):
    heads = 16
    qkv = torch.randn(M, 3 * heads * 64, device=DEV).bfloat16()
    pos = torch.randint(0, 1024, (M,), device=DEV, dtype=torch.int32)
    cos, sin = rope.rope_tables(theta, 1024, DEV)
    ref = rope.rope_ref(qkv, pos, cos, sin, heads)
    rope.rope(qkv, pos, cos, sin, heads)
    _close(qkv, ref, 5e-3)
    assert torch.equal(qkv[:, 2048:], ref[:, 2048:])  # V untouched


ATTN_CASES = [
    [1],
    [1, 2, 3],
    [63, 64, 65, 127, 128, 129],
    [1024, 1, 300],
    [7, 513, 1, 1000, 64],
]


@gpu
@needs_tilelang
@pytest.mark.parametrize("lengths", ATTN_CASES)
@pytest.mark.parametrize("heads,window", [(16, 0), (16, 64), (2, 0)])
@pytest.mark.parametrize("cfg", ATTENTION, ids=lambda c: c.tag())
def test_attention(lengths, heads, window, cfg):
    extra, empty = 37, 3
    qkv, cu = _packed_qkv(lengths, heads, extra=extra, seed=len(lengths), device=DEV)
    qkv = qkv.bfloat16()
    total = int(sum(lengths))
    # trailing empty rows (a padded bucket) and spare tile-table entries pointing at one of them
    cu_full = torch.cat([cu, cu[-1:].repeat(empty)])
    bm = cfg.bm
    tiles = attention.tile_table(lengths, bm, capacity=-(-total // bm) + len(lengths) + 5, empty_row=len(lengths))
    tiles_t = torch.from_numpy(tiles).to(DEV)
    out = _poison(total + extra, heads * 64)
    attention.attention(qkv, cu_full, tiles_t, heads, window, out=out, cfg=cfg)
    ref = attention.attention_ref(qkv, cu, heads, window)
    _close(out[:total], ref[:total], 1e-2)
    assert torch.isnan(out[total:].float()).all(), "wrote outside every row"


@gpu
@needs_tilelang
def test_attention_every_length_up_to_1024():
    lengths = list(np.random.default_rng(0).permutation(np.arange(1, 1025)))[:160] + [1024, 1]
    qkv, cu = _packed_qkv(lengths, 2, seed=3, device=DEV)
    qkv = qkv.bfloat16()
    tiles = torch.from_numpy(attention.tile_table(lengths, attention.DEFAULT.bm)).to(DEV)
    for cfg in (attention.UNSPECIALISED, attention.LEAN, attention.OVERLAP):
        for window in (0, 64):
            out = _poison(qkv.shape[0], 128)
            attention.attention(qkv, cu, tiles, 2, window, out=out, cfg=cfg)
            _close(out, attention.attention_ref(qkv, cu, 2, window), 1e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("heads,hp", [(3, 2), (5, 4)])
@pytest.mark.parametrize("window", [0, 64])
def test_attention_walking_heads_that_do_not_fill_the_last_block(heads, hp, window):
    """Several heads a block where hp does not divide the heads: the last block takes the rest; one-block rows
    (the next head's Q loaded before the loop), rows of many key blocks, and padding tiles."""
    from dataclasses import replace

    lengths = [1, 63, 64, 65, 129, 300, 7, 520]
    qkv, cu = _packed_qkv(lengths, heads, extra=29, seed=heads, device=DEV)
    qkv = qkv.bfloat16()
    total = int(sum(lengths))
    cu_full = torch.cat([cu, cu[-1:].repeat(2)])
    tiles = attention.tile_table(lengths, 64, capacity=-(-total // 64) + len(lengths) + 3, empty_row=len(lengths))
    out = _poison(total + 29, heads * 64)
    attention.attention(qkv, cu_full, torch.from_numpy(tiles).to(DEV), heads, window, out=out,
                        cfg=replace(attention.OVERLAP, hp=hp))
    _close(out[:total], attention.attention_ref(qkv, cu, heads, window)[:total], 1e-2)
    assert torch.isnan(out[total:].float()).all(), "wrote outside every row"


def test_kernels_read_no_project_setting_and_the_target_comes_from_configure(monkeypatch):
    """kernels/ takes its cache dir and arch from `_tl.configure` (the fast backend passes them), never from a
    LAYA_FLEET_* variable."""
    for f in _tl.source_files() + [tuning.__file__]:
        with open(f, encoding="utf-8") as fh:
            assert "LAYA_FLEET_" not in fh.read(), f
    monkeypatch.setattr(_tl, "_config", dict(_tl._config))
    _tl.configure(arch="sm_80")
    assert _tl.target() == {"kind": "cuda", "arch": "sm_80"}


def test_pdl_is_set_by_configure_and_keeps_both_builds_apart(monkeypatch):
    """Programmatic dependent launch is on by default from sm_90 (Hopper) up, off below it and when configured
    off; a kernel built each way has its own name (its cache entries) and its own memo entry, so one process can
    hold both (bench/pdl_ab.py does)."""
    monkeypatch.setattr(_tl, "_config", dict(_tl._config))
    monkeypatch.setattr(_tl, "_kernels", {})
    builds = []

    def build():
        builds.append(_tl.pdl())
        return object()

    _tl.configure(arch="sm_90a")
    assert _tl.pdl() and _tl.settings()["pdl"] is True
    assert _tl.kernel_name("lf_x", n=3) == "lf_x_n3_pdl"
    on = _tl.memo(("x",), build)
    assert _tl.memo(("x",), build) is on
    _tl.configure(arch="sm_90a", pdl=False)
    assert not _tl.pdl() and _tl.kernel_name("lf_x", n=3) == "lf_x_n3"
    off = _tl.memo(("x",), build)
    assert off is not on and builds == [True, False]
    _tl.configure(arch="sm_90a")
    with _tl.pdl_scope(False):   # the fast forward's large batches: the plain builds, on this thread only
        assert not _tl.pdl() and _tl.memo(("x",), build) is off and _tl.kernel_name("lf_x", n=3) == "lf_x_n3"
        seen = []
        t = threading.Thread(target=lambda: seen.append(_tl.pdl()))
        t.start()
        t.join()
        assert seen == [True]
        with _tl.pdl_scope(True):
            assert _tl.memo(("x",), build) is on
    assert _tl.pdl() and builds == [True, False]
    _tl.configure(arch=None)   # the visible GPU's (sm_90a without one), asked once: pdl() runs at every kernel lookup
    first, real = _tl.pdl(), _tl.target
    monkeypatch.setattr(_tl, "target", lambda: pytest.fail("target() asked again"))
    assert _tl.pdl() == first and _tl.kernel_name("lf_x", n=3).endswith("_pdl") == first
    monkeypatch.setattr(_tl, "target", real)
    _tl.configure(arch="sm_80", pdl=True)   # Ampere has no griddepcontrol: built without, named without
    assert not _tl.pdl() and _tl.kernel_name("lf_x", n=3) == "lf_x_n3"
    assert _tl.memo(("x",), build) is off
