"""The hand-warp-specialised GEMMs (kernels/gemm_manual.py): what the forward picks, that every form compiles for
sm_90a with the structure it claims (needs tilelang, no GPU), and every form against the references at awkward
sizes (GPU): rows not a multiple of the tile, more tiles than persistent blocks, a K tail, N not a multiple of the
tile (GeGLU's 2624), fp16."""

import importlib.util
import json
import re
from dataclasses import replace

import pytest
import torch

from kernels import geglu, gemm, rope, tuning
from kernels import gemm_manual as gm
from model.backends.fast import specs as forward
from tests.kernel_specs import GEGLU_TEST_CFGS, PINGPONG
from tests.test_kernels import _check_fused_rope, _close, _node_local_kernel_cache, _poison, use_sm90  # noqa: F401

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")
BF, F16 = torch.bfloat16, torch.float16


def test_configs_and_tags():
    assert gm.GEMM.tag() == "128x256x64s4p132w0qc2" and gm.GEMM.epilogue() == "chunk"
    assert gm.GEGLU.tag() == "128x128x64s4p132w0jc2" and gm.GEGLU.epilogue(2) == "full"
    assert gm.GemmWSConfig(stages=4).epilogue() == "alias"
    gm.check_config(gm.GEGLU, 2)
    with pytest.raises(ValueError, match="shared memory"):
        gm.check_config(gm.GemmWSConfig(bm=256, bn=256, stages=4, persistent=132))
    with pytest.raises(ValueError, match="two accumulators"):
        gm.check_config(gm.GemmWSConfig(stages=2, persistent=132), 2)   # 64 x 256 of each half: 256 registers
    two = replace(gm.GEGLU, joint=False)
    assert two.tag() == "128x128x64s4p132w0c2" and two.smem_bytes(2) == gm.GEGLU.smem_bytes(2)
    with pytest.raises(ValueError, match="joint"):
        gm.check_config(replace(gm.GEMM, joint=True), 1)
    assert replace(gm.GEMM, cluster=1, stagger=2).tag() == "128x256x64s4p132w0g2q"
    with pytest.raises(ValueError, match="stagger"):
        gm.check_config(replace(gm.GEMM, stagger=4))
    # 2-CTA clusters (W multicast, the defaults): persistent over an even number of blocks only
    c2 = gm.GEMM
    assert replace(c2, cluster=1).tag() == "128x256x64s4p132w0q"
    gm.check_config(c2)
    for bad in (replace(c2, persistent=0), replace(c2, persistent=131), replace(c2, stagger=2), replace(c2, cluster=4)):
        with pytest.raises(ValueError, match="cluster"):
            gm.check_config(bad)


def _pick(M, N, in_dtype, out_dtype, geglu=False, K=None, sms=132, arch="sm_90a", table=tuning.TABLE):
    return tuning.pick_gemm_ws(M, N, in_dtype, out_dtype, geglu, K, arch=arch, sms=sms, table=table)


def test_pick():
    """Many rows of a 16-bit product on Hopper: the manual kernels; few rows, an fp32 output (the scorer's last
    layer) or another GPU: the other kernels."""
    small_m = tuning.TABLE.small_m  # the committed table's end of the small tiles
    assert _pick(small_m + 1, 3072, BF, BF) == gm.GEMM
    # no clusters for the N = 1024 products (see BENCHMARKS.md, "GPU fast path")
    assert _pick(small_m + 1, 1024, BF, BF, K=2624) == replace(gm.GEMM, cluster=1)
    assert _pick(65536, 2624, F16, F16, geglu=True) == gm.GEGLU
    assert _pick(small_m, 3072, BF, BF) is None
    assert _pick(4096, 16, BF, torch.float32) is None
    assert _pick(4096, 3072, BF, BF, sms=114).persistent == 114   # an H100 PCIe: one block per SM there
    # a measured winner in the table (bench/fast_path.py proposes one)
    table = tuning.Tuning().with_entry("gemm_ws", "geglu", replace(gm.GEGLU, cluster=1, stagger=2))
    assert _pick(4096, 2624, BF, BF, geglu=True, sms=114, table=table) == replace(gm.GEGLU, cluster=1, stagger=2,
                                                                                  persistent=114)
    assert _pick(4096, 3072, BF, BF, sms=114, table=table) == replace(gm.GEMM, persistent=114)
    # a per-product winner beats the default (and a per-form winner), for that product only
    table = table.with_entry("gemm_ws", "gemm:1024x2624", gm.GEMM)
    assert _pick(4096, 1024, BF, BF, K=2624, sms=114, table=table) == replace(gm.GEMM, persistent=114)
    assert _pick(4096, 1024, BF, BF, K=1024, sms=114, table=table) == replace(gm.GEMM, cluster=1, persistent=114)
    form = table.with_entry("gemm_ws", "gemm", replace(gm.GEMM, cluster=1, stagger=3))
    assert _pick(4096, 1024, BF, BF, K=1024, sms=114, table=form) == replace(gm.GEMM, cluster=1, stagger=3,
                                                                             persistent=114)
    assert _pick(4096, 1024, BF, BF, K=2624, sms=114, table=form) == replace(gm.GEMM, persistent=114)
    # an odd SM count: not every block would have its pair
    assert _pick(4096, 3072, BF, BF, sms=113, table=table) == replace(gm.GEMM, persistent=113, cluster=1)
    assert _pick(4096, 1024, BF, BF, arch="sm_80") is None


def test_a_tuning_table_round_trips_through_its_json_form(tmp_path):
    table = tuning.Tuning().with_entry("gemm_ws", "geglu", replace(gm.GEGLU, cluster=1)).with_entry(
        "gemm", "3072x1024", gemm.LARGE)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table.as_dict()))
    assert tuning.Tuning.from_json(str(path)) == table
    assert tuning.Tuning.from_json(str(tmp_path / "none.json")) == tuning.Tuning()
    with pytest.raises(ValueError, match="unknown ops"):
        tuning.Tuning.from_dict({"gemmm": {}})


def test_small_m_moves_where_the_small_tiles_end(tmp_path):
    """The table's small_m decides which token buckets run the small tiles, for every pick, and the forward's
    kernel list keeps the same kernels (M is dynamic: only the bucket at which they switch moves)."""
    wide = replace(tuning.TABLE, small_m=1024)
    assert _pick(1024, 3072, BF, BF, table=wide) is None and _pick(1025, 3072, BF, BF, table=wide) == gm.GEMM
    assert tuning.pick_gemm(1024, 3072, 1024, wide) == gemm.SMALL
    assert tuning.pick_gemm(1024, 3072, 1024) == gemm.LARGE
    assert tuning.pick_geglu(1024, 2624, 1024, wide) == geglu.SMALL
    assert tuning.pick_geglu(1024, 2624, 1024) == geglu.LARGE
    dims = dict(d=1024, heads=16, inter=2624, ffn=4096, windows={0, 64}, arch="sm_90a", sms=132)
    assert forward.kernel_specs(**dims, table=wide) == forward.kernel_specs(**dims)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(wide.as_dict()))
    assert tuning.Tuning.from_json(str(path)) == wide
    for bad in (100, 0, -64, "512", True):
        with pytest.raises(ValueError, match="small_m"):
            tuning.Tuning.from_dict({"small_m": bad})


def test_attention_walks_several_heads_a_block_only_in_the_largest_buckets(tmp_path):
    """attn_hp / attn_hp_m: the overlapped attention takes attn_hp heads a block from attn_hp_m tokens up (where
    bench/fast_path.py's sweep timed it faster) and one head a block below, where fewer, longer blocks leave the GPU
    idle; the forward's kernel list builds both, another attention config is left as it is, and a bad table is
    refused."""
    from kernels import attention

    table = tuning.Tuning(attn_hp=4, attn_hp_m=65536)
    ov = attention.OVERLAP
    assert tuning.pick_attention(65536, ov, table) == replace(ov, hp=4)
    assert tuning.pick_attention(65535, ov, table) == ov and tuning.pick_attention(83, ov, table) == ov
    assert tuning.pick_attention(1 << 20, attention.LEAN, table) == attention.LEAN
    assert tuning.pick_attention(1 << 20, ov, tuning.Tuning()) == ov
    dims = dict(d=1024, heads=16, inter=2624, ffn=4096, windows={0, 64}, arch="sm_90a", sms=132)
    attn = [a for op, a in forward.kernel_specs(**dims, table=table) if op == "attention"]
    assert sorted((a[1], a[2].hp) for a in attn) == [(0, 1), (0, 4), (64, 1), (64, 4)]
    # an engine whose buckets stop short of attn_hp_m lists the one-head form only
    short = [a for op, a in forward.kernel_specs(**dims, table=table, max_tokens=16384) if op == "attention"]
    assert sorted((a[1], a[2].hp) for a in short) == [(0, 1), (64, 1)]
    long = [a for op, a in forward.kernel_specs(**dims, table=table, max_tokens=131072) if op == "attention"]
    assert sorted(long, key=lambda a: (a[1], a[2].hp)) == sorted(attn, key=lambda a: (a[1], a[2].hp))
    # the forward asks for what it lists: every bucket's pick is among the specs
    for M in (64, 1024, 65536, 131072):
        assert (64, tuning.pick_attention(M, ov, table)) in {(a[1], a[2]) for a in attn}
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table.as_dict()))
    assert tuning.Tuning.from_json(str(path)) == table
    for bad in ({"attn_hp": 0}, {"attn_hp": 4, "attn_hp_m": 128}, {"attn_hp": "4", "attn_hp_m": 65536},
                {"attn_hp": 2, "attn_hp_m": True}):
        with pytest.raises(ValueError, match="attn_hp"):
            tuning.Tuning.from_dict(bad)


def test_a_small_tile_winner_runs_for_its_product_up_to_small_m(tmp_path):
    """gemm_small / geglu_small (bench/small_gemm.py's proposals) replace SMALL for their product only, up to
    small_m rows, and the forward's kernel list builds them."""
    narrow = replace(gemm.SMALL, bn=32)
    g32 = replace(geglu.SMALL, bn=32)
    table = tuning.Tuning().with_entry("gemm_small", "1024x2624", narrow).with_entry("geglu_small", "2624x1024", g32)
    small = table.small_m
    assert tuning.pick_gemm(small, 1024, 2624, table) == narrow
    assert tuning.pick_gemm(small, 1024, 1024, table) == gemm.SMALL
    assert tuning.pick_gemm(small + 1, 1024, 2624, table) == gemm.LARGE
    assert tuning.pick_geglu(64, 2624, 1024, table) == g32 and tuning.pick_geglu(small + 1, 2624, 1024, table) != g32
    dims = dict(d=1024, heads=16, inter=2624, ffn=4096, windows={0, 64}, arch="sm_90a", sms=132)
    specs = forward.kernel_specs(**dims, table=table)
    assert ("gemm", (1024, 2624, False, "none", narrow, BF)) in specs and ("geglu", (2624, 1024, g32)) in specs
    assert ("gemm", (1024, 2624, False, "none", gemm.SMALL, BF)) not in specs
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(table.as_dict()))
    assert tuning.Tuning.from_json(str(path)) == table


def test_the_forward_lists_manual_kernels_for_many_rows_only():
    dims = dict(d=1024, heads=16, inter=2624, ffn=4096, windows={0, 64})
    specs = forward.kernel_specs(**dims, arch="sm_90a", sms=132)
    ws = [a for op, a in specs if op == "gemm_ws"]
    assert len(ws) == 9 and sum(1 for a in ws if a[6]) == 1       # 8 products (Wqkv with RoPE) and the GeGLU
    assert [a[5] for a in ws if a[5]] == [2048]
    assert [a[2] for op, a in specs if op == "geglu"] == [geglu.SMALL]   # no large-tile auto GeGLU left
    assert [a for op, a in specs if op == "gemm" and a[4] == gemm.SMALL]     # few rows keep the SMALL tiles
    # every spec maps to an op the backend's `ops` option switches (a manual spec to gemm, or geglu)
    assert {forward.spec_op(sp) for sp in specs} == set(forward.OPS)
    assert sorted(forward.spec_op(("gemm_ws", a)) for a in ws) == ["geglu"] + ["gemm"] * 8
    assert not [a for op, a in forward.kernel_specs(**dims, arch="sm_80", sms=132) if op == "gemm_ws"]


# -- compile only (tilelang, no GPU) -----------------------------------------------------------
@needs_tilelang
def test_manual_kernels_compile_for_hopper(monkeypatch):
    """One producer warpgroup (TMA loads, registers given back) and two consumer warpgroups (wgmma, registers
    taken) in 384 threads; the output leaves through TMA stores only; the persistent form walks the tiles in waves
    of 132 blocks; the RoPE form rotates only heads below rope_cols; the GeGLU form loads both halves of Wi."""
    use_sm90(monkeypatch)
    for cfg in (replace(gm.GEMM, cluster=1), gm.GemmWSConfig(stages=4), gm.GemmWSConfig(stages=3, persistent=132)):
        src = gm.gemm_manual_kernel(3072, 1024, cfg).get_kernel_source()
        assert re.findall(r"__launch_bounds__\((\d+)", src) == ["384"]
        assert "warpgroup_reg_dealloc<%d>" % gm.PRODUCER_REGS in src
        assert "warpgroup_reg_alloc<%d>" % gm.CONSUMER_REGS in src
        assert "tma_load(" in src and "tma_store(" in src and "wgmma_ss" in src
        assert not re.search(r"\* __restrict__ C\b", src)   # C only through its tensor map
        assert ("* 132)" in src) == bool(cfg.persistent)
    one = gm.gemm_manual_kernel(3072, 1024, gm.GemmWSConfig(stages=4, persistent=132, inflight=1)).get_kernel_source()
    assert "wait_wgmma<1>" in one   # one batch in flight: the previous step's stage released after it
    rs = gm.gemm_manual_kernel(3072, 1024, replace(gm.GEMM, rope_regs=False), rope_cols=2048).get_kernel_source()
    assert "Cos" in rs and "Sin" in rs and "_r2048" in rs and "% 12) < 8" in rs   # 8 of 12 column tiles rotate
    gs = gm.gemm_manual_kernel(2624, 1024, replace(gm.GEGLU, joint=False), geglu=True).get_kernel_source()
    assert "erff" in gs and "lf_geglu_ws" in gs and gs.count("tma_load(Wi_desc") == 2
    assert re.findall(r"wgmma_ss<[^>]*, 64, (\d+), 16", gs) == ["128"] * 4   # two n=128 products a consumer
    js = gm.gemm_manual_kernel(2624, 1024, replace(gm.GEGLU, cluster=1), geglu=True).get_kernel_source()
    assert js.count("tma_load(Wi_desc") == 2 and "_c128x128x64s4p132w0j_" in js
    assert re.findall(r"wgmma_ss<[^>]*, 64, (\d+), 16", js) == ["256"] * 2   # one n=256 product a consumer
    # clusters: the W tiles multicast by the first block of a pair, stages freed in both blocks
    cs = gm.gemm_manual_kernel(2624, 1024, gm.GEGLU, geglu=True).get_kernel_source()
    assert cs.count("tma_load_multicast(Wi_desc") == 2 and "empty[0].init(16)" in cs and "* 66)" in cs
    assert "].arrive(0u)" in cs and "].arrive(1u)" in cs and cs.count("cluster_sync()") >= 2
    # staggered: the second consumer waits (once, on its first tile) for the first's arrival after 2 k-steps
    st = gm.gemm_manual_kernel(3072, 1024, replace(gm.GEMM, cluster=1, stagger=2), rope_cols=2048).get_kernel_source()
    assert "go[0].init(4)" in st and st.count("go[0].wait(0)") == 1 and "(k_1 == 1)" in st
    # RoPE in registers: no shared-memory rotation (no Cg_s reads back into registers before the store)
    q = gm.gemm_manual_kernel(3072, 1024, gm.GEMM, rope_cols=2048).get_kernel_source()
    assert "_c128x256x64s4p132w0qc2_r2048" in q and "__bfloat1622float2" in q
    assert "= *(uint2*)(((bfloat16_t*)C0_s)" not in q and "= *(uint2*)(((bfloat16_t*)C0_s)" in rs
    # ping-pong: each ring position holds one consumer's A half (one A load of two per position, in turn) and is
    # freed by that consumer's 4 warps (in both blocks of a pair: 8)
    pp = gm.gemm_manual_kernel(2624, 1024, replace(gm.GEGLU, inflight=1, pingpong=True), geglu=True
                               ).get_kernel_source()
    assert "_c128x128x64s4p132jc2pp_" in pp and "empty[0].init(8)" in pp and "wait_wgmma<1>" in pp
    assert "if (half == 0)" in pp and pp.count("tma_load(A_desc") == 2
    # each consumer waits its turn (the other has waited for its half's last k-step) before its own waits
    assert "go[0].init(4)" in pp and "go[1].init(4)" in pp and "go[0].wait(((it_1 - 1) & 1))" in pp
    p1 = gm.gemm_manual_kernel(1024, 1024, replace(PINGPONG, cluster=1)).get_kernel_source()
    assert "empty[0].init(4)" in p1
    bs = gm.gemm_manual_kernel(4096, 1024, gm.GEMM, bias=True, act="relu", dtype=F16).get_kernel_source()
    assert "Bias" in bs and "kFloat16" in bs and "_ifloat16_b1_arelu" in bs
    with pytest.raises(ValueError, match="RoPE"):
        gm.build_gemm_manual(3072, 1024, gm.GemmWSConfig(stages=3, persistent=132), rope_cols=2048)


# -- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
DEV = "cuda"


CFGS = {"default": gm.GEMM, "inflight": gm.GemmWSConfig(stages=4, persistent=132, inflight=1),
        "alias": gm.GemmWSConfig(stages=4), "full": gm.GemmWSConfig(stages=3, persistent=132),
        "stagger": replace(gm.GEMM, cluster=1, stagger=2), "one_block": replace(gm.GEMM, cluster=1),
        "pingpong": PINGPONG, "pingpong_one_block": replace(PINGPONG, cluster=1)}


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 257, 4099, 40000])
@pytest.mark.parametrize("N,K,bias,act", [(3072, 1024, False, "none"), (1024, 2624, False, "none"),
                                          (4096, 1024, True, "relu"), (1024, 1024, True, "gelu"),
                                          (1024, 1000, False, "none")])
@pytest.mark.parametrize("cfg", list(CFGS))
def test_manual_gemm(M, N, K, bias, act, cfg):
    """Every row checked (NaN-filled output); 40000 rows: 313 x 4..16 tiles over 132 blocks; K = 1000: a partial
    last k-step (zero-filled by TMA)."""
    a = torch.randn(M, K, device=DEV).bfloat16()
    w = (torch.randn(N, K, device=DEV) * K ** -0.5).bfloat16()
    b = torch.randn(N, device=DEV) if bias else gemm._zeros(N, DEV)
    out = _poison(M, N)
    gm.gemm_manual_kernel(N, K, CFGS[cfg], bias, act)(a, w, b, out)
    _close(out, gemm.gemm_ref(a, w, b if bias else None, act), 1e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 4099, 40000])
def test_manual_gemm_with_rope_equals_gemm_then_rope(M):
    """The fused Wqkv form gives what the plain manual GEMM followed by the RoPE kernel gives (the same rounding
    of the product before the rotation); V columns untouched."""
    heads = 16
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    w = (torch.randn(3072, 1024, device=DEV) * 1024 ** -0.5).bfloat16()
    pos = torch.randint(0, 512, (M,), device=DEV, dtype=torch.int32)
    cos, sin = rope.rope_tables(160000.0, 512, DEV)
    z = gemm._zeros(3072, DEV)
    two_step = _poison(M, 3072)
    gm.gemm_manual_kernel(3072, 1024, gm.GEMM)(a, w, z, two_step)
    rope.rope(two_step, pos, cos, sin, heads)
    for cfg in (gm.GEMM, replace(gm.GEMM, cluster=1, stagger=2), replace(gm.GEMM, rope_regs=False),
                replace(gm.GEMM, cluster=1), PINGPONG):
        fused = _poison(M, 3072)
        gm.gemm_manual_kernel(3072, 1024, cfg, rope_cols=2048)(a, w, z, fused, pos, cos, sin)
        _check_fused_rope(fused, two_step, a, w, pos, cos, sin, heads)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 4099, 40000])
@pytest.mark.parametrize("cfg", GEGLU_TEST_CFGS, ids=lambda c: c.tag())
def test_manual_geglu(M, cfg):
    """F = 2624 is 20.5 tiles of 128: the last tile's extra columns read gate rows or zeros, never stored. Every
    form (two products or one joint one, either wait, persistent or not) against the fp32 reference."""
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    wi = (torch.randn(2 * 2624, 1024, device=DEV) / 32).bfloat16()
    out = _poison(M, 2624)
    gm.gemm_manual_kernel(2624, 1024, cfg, geglu=True)(a, wi, out)
    _close(out, geglu.geglu_ref(a, wi), 1.5e-2)


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 129, 4099, 40000])
def test_cluster_multicast_same_bits(M):
    """2-CTA clusters with the W tiles multicast (the defaults) run the same products in the same order: every bit is
    the one-block kernel's (M = 1, 77: one row block, its pair past M; 129: two; odd and even pair counts)."""
    _same_bits_as_shipped(M, replace(gm.GEGLU, cluster=1), replace(gm.GEMM, cluster=1))


def _same_bits_as_shipped(M: int, geglu_cfg: gm.GemmWSConfig, rope_cfg: gm.GemmWSConfig) -> torch.Tensor:
    """Assert that the GeGLU under `geglu_cfg` and Wqkv + RoPE under `rope_cfg` give the shipped configs' bits on M
    random rows; returns the rows."""
    a = torch.randn(M, 1024, device=DEV).bfloat16()
    wi = (torch.randn(2 * 2624, 1024, device=DEV) / 32).bfloat16()
    ref, out = _poison(M, 2624), _poison(M, 2624)
    gm.gemm_manual_kernel(2624, 1024, gm.GEGLU, geglu=True)(a, wi, ref)
    gm.gemm_manual_kernel(2624, 1024, geglu_cfg, geglu=True)(a, wi, out)
    assert torch.equal(out, ref)
    w = (torch.randn(3072, 1024, device=DEV) / 32).bfloat16()
    pos = torch.randint(0, 512, (M,), device=DEV, dtype=torch.int32)
    cos, sin = rope.rope_tables(160000.0, 512, DEV)
    z = gemm._zeros(3072, DEV)
    ref, out = _poison(M, 3072), _poison(M, 3072)
    gm.gemm_manual_kernel(3072, 1024, gm.GEMM, rope_cols=2048)(a, w, z, ref, pos, cos, sin)
    gm.gemm_manual_kernel(3072, 1024, rope_cfg, rope_cols=2048)(a, w, z, out, pos, cos, sin)
    assert torch.equal(out, ref)
    return a


@gpu
@needs_tilelang
def test_manual_kernels_in_fp16():
    a = torch.randn(3000, 1024, device=DEV).half()
    w = (torch.randn(1024, 1024, device=DEV) / 32).half()
    b = torch.randn(1024, device=DEV)
    out = _poison(3000, 1024, dtype=F16)
    gm.gemm_manual_kernel(1024, 1024, gm.GEMM, True, "none", dtype=F16)(a, w, b, out)
    _close(out, gemm.gemm_ref(a, w, b), 1e-2)
    wi = (torch.randn(2 * 2624, 1024, device=DEV) / 32).half()
    for cfg in (gm.GEGLU, replace(gm.GEGLU, joint=False), replace(gm.GEGLU, cluster=1)):
        g = _poison(3000, 2624, dtype=F16)
        gm.gemm_manual_kernel(2624, 1024, cfg, geglu=True, dtype=F16)(a, wi, g)
        _close(g, geglu.geglu_ref(a, wi), 1.5e-2)


# -- e4m3 operands (the FP8 precision) ----------------------------------------------------------
def test_pingpong_config():
    """Ping-pong runs persistent, with a batch in flight (one consumer at a time issues the products) and no
    stagger (the turn barriers already alternate the consumers); its tag says so."""
    pp = replace(gm.GEMM, inflight=1, pingpong=True)
    gm.check_config(pp)
    assert pp.tag() == "128x256x64s4p132qc2pp"
    for bad in (replace(pp, inflight=0), replace(pp, persistent=0, cluster=1), replace(pp, cluster=1, stagger=2)):
        with pytest.raises(ValueError, match="ping-pong"):
            gm.check_config(bad)


def test_pingpong_engine_table_changes_only_the_schedule():
    """bench/fast_path.py's ping-pong engines: every product the hand-warp-specialised kernels run for a
    modernbert-large forward, bf16 or e4m3, gets ping-pong consumers and keeps the tiles and cluster the shipped
    forward picks; few rows and other GPUs still run the other kernels."""
    from bench.fastpath.workloads import pingpong_table

    table = pingpong_table(tuning.TABLE, 1024, 2624, 4096, sms=132)
    prods = [(3072, 1024, False), (1024, 1024, False), (1024, 2624, False), (2624, 1024, True),
             (4096, 1024, False), (1024, 4096, False)]
    for N, K, g in prods:
        shipped = tuning.pick_gemm_ws(65536, N, BF, BF, g, K, arch="sm_90a", sms=132)
        pp = tuning.pick_gemm_ws(65536, N, BF, BF, g, K, arch="sm_90a", sms=132, table=table)
        assert pp == replace(shipped, inflight=1, pingpong=True), (N, K, g)
        gm.check_config(pp, 2 if g else 1)
        assert tuning.pick_gemm_ws(64, N, BF, BF, g, K, arch="sm_90a", sms=132, table=table) is None
        assert tuning.pick_gemm_ws(65536, N, BF, BF, g, K, arch="sm_80", sms=108, table=table) is None
    prods8 = prods[:4]   # the FP8 precision runs the encoder's products in e4m3
    for N, K, g in prods8:
        shipped = tuning.pick_gemm_ws8(65536, N, g, K, arch="sm_90a", sms=132)
        pp = tuning.pick_gemm_ws8(65536, N, g, K, arch="sm_90a", sms=132, table=table)
        assert pp == replace(shipped, inflight=1, pingpong=True), (N, K, g)
        gm.check_config(pp, 2 if g else 1, 1)
    assert len(table.gemm_ws) == len(prods) + len(prods8)   # one entry a product, nothing form-wide
    assert tuning.Tuning.from_dict(table.as_dict()) == table   # writable as kernels/tuning.json


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 129, 4099, 40000])
def test_pingpong_same_bits(M):
    """Ping-pong runs each half's products in the same k order on the same wgmma shapes as the cooperative
    schedule, so every bit is the shipped kernel's: the GeGLU, Wqkv with its RoPE, and a plain product with a bias,
    with and without 2-CTA clusters (M = 1, 77: one row block, the second consumer's half past M)."""
    a = _same_bits_as_shipped(M, replace(gm.GEGLU, inflight=1, pingpong=True), PINGPONG)
    w4, b = (torch.randn(4096, 1024, device=DEV) / 32).bfloat16(), torch.randn(4096, device=DEV)
    ref, out = _poison(M, 4096), _poison(M, 4096)
    gm.gemm_manual_kernel(4096, 1024, gm.GEMM, True, "relu")(a, w4, b, ref)
    gm.gemm_manual_kernel(4096, 1024, replace(PINGPONG, cluster=1), True, "relu")(a, w4, b, out)
    assert torch.equal(out, ref)


def test_fp8_configs_and_pick():
    """128-element (128-byte) k-steps; the GEMM's 4-stage ring leaves room for the chunked epilogue only, which
    Wqkv's RoPE needs; a 16-bit k-step must stay within its swizzle atom, an e4m3 one within 128 elements."""
    assert gm.GEMM8.epilogue(1, 1) == "chunk" and gm.GEGLU8.epilogue(2, 1) == "full"
    gm.check_config(gm.GEMM8, 1, 1)
    gm.check_config(gm.GEGLU8, 2, 1)
    with pytest.raises(ValueError, match="bk a multiple of 16 up to 64"):
        gm.check_config(gm.GEMM8)                                   # the same tile with 16-bit operands
    with pytest.raises(ValueError, match="bk a multiple of 32 up to 128"):
        gm.check_config(replace(gm.GEMM8, bk=48), 1, 1)
    assert gm.GemmWSConfig(stages=4).epilogue(1, 1) != "alias"    # an e4m3 ring cannot hold the bf16 output
    small_m = tuning.TABLE.small_m

    def pick8(M, N, geglu=False, arch="sm_90a", sms=132):
        return tuning.pick_gemm_ws8(M, N, geglu, arch=arch, sms=sms)

    assert pick8(small_m + 1, 3072) == gm.GEMM8 and pick8(small_m + 1, 2624, True) == gm.GEGLU8
    assert pick8(small_m + 1, 1024) == replace(gm.GEMM8, cluster=1)
    assert pick8(small_m, 3072) is None and pick8(small_m + 1, 3072, arch="sm_89") is None
    assert pick8(small_m + 1, 3072, sms=114) == replace(gm.GEMM8, persistent=114)
    # measured winners in the table: one product's, then every e4m3 product's of a form; the bf16 entries are not
    # the e4m3 kernels' (other k-steps)
    one = replace(gm.GEMM8, inflight=1, pingpong=True)
    t = tuning.TABLE.with_entry("gemm_ws", "gemm8:3072x1024", one).with_entry("gemm_ws", "gemm", gm.GEMM)
    assert tuning.pick_gemm_ws8(small_m + 1, 3072, False, 1024, arch="sm_90a", sms=132, table=t) == one
    assert tuning.pick_gemm_ws8(small_m + 1, 3072, False, 2048, arch="sm_90a", sms=132, table=t) == gm.GEMM8
    t = t.with_entry("gemm_ws", "geglu8", replace(gm.GEGLU8, cluster=1))
    assert tuning.pick_gemm_ws8(small_m + 1, 2624, True, 1024, arch="sm_90a", sms=132, table=t) == \
        replace(gm.GEGLU8, cluster=1)
    assert tuning.pick_gemm_ws8(small_m + 1, 3072, False, 1024, arch="sm_90a", sms=114, table=t) == \
        replace(one, persistent=114)


@needs_tilelang
def test_fp8_kernels_compile_for_hopper(monkeypatch):
    """e4m3 x e4m3 wgmma (k = 32, four a 128-element k-step) into fp32, the rest of the schedule unchanged, and every
    product scaled by its row's and column's scale (indices clamped: no read past M or N) before the epilogue."""
    use_sm90(monkeypatch)
    for N, K, cfg, rope_cols, g in ((3072, 1024, gm.GEMM8, 2048, False), (1024, 2624, replace(gm.GEMM8, cluster=1),
                                                                           0, False), (2624, 1024, gm.GEGLU8, 0, True)):
        src = gm.gemm_manual_kernel(N, K, cfg, rope_cols=rope_cols, geglu=g, fp8=True).get_kernel_source()
        assert re.findall(r"__launch_bounds__\((\d+)", src) == ["384"] and "_f81" in src
        assert re.findall(r"wgmma_ss<tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, "
                          r"64, (\d+), 32", src) == [str(2 * cfg.bn if g else cfg.bn)] * 2
        assert "fp8_e4_t" in src and "SA[min(" in src and re.search(r"SB(\[| \+ )", src)   # rows past M clamped
        assert (", %d)" % (N - 1) in src) == bool(N % cfg.bn)   # columns clamped where the last tile passes N
        assert ("Cos" in src) == bool(rope_cols) and ("erff" in src) == g
        assert not re.search(r"\* __restrict__ C\b", src) and "tma_store(" in src


@gpu
@needs_tilelang
@pytest.mark.parametrize("M", [1, 77, 4099, 40000])
@pytest.mark.parametrize("form", ["plain", "rope", "geglu", "bias"])
def test_fp8_manual_kernels_equal_the_dequantised_product(M, form):
    """Against the fp32 product of the dequantised operands (the kernel's own inputs): e4m3 products are exact in
    fp32, so only the summation order and the bf16 output differ. Rows past a tile, F = 2624's half tile, a K of
    2624, clusters and one-block tiles."""
    from kernels import quant

    K, N = (2624, 1024) if form == "bias" else (1024, 3072 if form == "rope" else 2624)
    a = torch.randn(M, K, device=DEV) * torch.logspace(-2, 1, M, device=DEV).unsqueeze(1)
    w = torch.randn(2 * N if form == "geglu" else N, K, device=DEV) * K ** -0.5
    qa, sa = quant.quant_rows_ref(a)
    qw, sw = quant.quant_rows_ref(w)
    y = (qa.float() * sa[:, None]) @ (qw.float() * sw[:, None]).t()
    out = _poison(M, N)
    if form == "geglu":
        gm.gemm_manual_kernel(N, K, gm.GEGLU8, geglu=True, fp8=True)(qa, qw, out, sa, sw)
        yb = y.bfloat16().float()   # the halves rounded to bf16 first, as `torch._scaled_mm`'s product
        _close(out, torch.nn.functional.gelu(yb[:, :N]) * yb[:, N:], 1.5e-2)
    elif form == "rope":
        pos = torch.randint(0, 512, (M,), device=DEV, dtype=torch.int32)
        cos, sin = rope.rope_tables(160000.0, 512, DEV)
        gm.gemm_manual_kernel(N, K, gm.GEMM8, rope_cols=2048, fp8=True)(qa, qw, gemm._zeros(N, DEV), out, pos, cos,
                                                                         sin, sa, sw)
        ref = y.bfloat16()
        rope.rope(ref, pos, cos, sin, 16)
        _close(out, ref, 1e-2)
    else:
        bias = torch.randn(N, device=DEV) if form == "bias" else gemm._zeros(N, DEV)
        cfg = tuning.pick_gemm_ws8(4096, N, arch="sm_90a", sms=132)
        gm.gemm_manual_kernel(N, K, cfg, bias=form == "bias", fp8=True)(qa, qw, bias, out, sa, sw)
        _close(out, y + (bias if form == "bias" else 0), 1e-2)
