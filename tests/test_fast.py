"""The fast backend: packing, buckets, chunking and errors on CPU (torch ops), and on GPU the TileLang +
CUDA-graph forward against the eager model."""

from __future__ import annotations

import importlib.util
import threading
import warnings

import numpy as np
import pytest
import torch

from model.backends import BackendUnavailable
from model.backends import make_backend as registry_backend
from model.backends.fast import FastForward, make_backend
from model.bundle import load_model
from model.sequence import Row

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def _softmax(logits):
    z = logits - logits.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def test_packed_forward_matches_eager_fp32(bundle, rows, rows_scored):
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=2048)
    assert fast.packed and fast.name == "fast"
    l1, p1 = rows_scored
    l2, p2 = fast.forward(rows)
    assert l2.shape == l1.shape and l2.dtype == np.float32 and p2.dtype == np.float32
    np.testing.assert_allclose(l2, l1, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(p2, p1, atol=1e-5)
    assert fast.stats.chunks > 1  # 2048 tokens per chunk forces several chunks


@pytest.fixture(scope="module")
def half_forward(bundle, rows):
    """{act_dtype: (backend, its forward over `rows`)} for fp16 and bf16, each built and run once on first use."""
    out = {}

    def run(dtype):
        if dtype not in out:
            fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", act_dtype=dtype)
            out[dtype] = fast, fast.forward(rows)
        return out[dtype]

    return run


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_packed_forward_in_half_precision_stays_near_fp32(rows_scored, half_forward, dtype):
    """act_dtype fp16 / bf16 (the kernels' two modes) on the torch ops: activations and GEMM weights rounded,
    residual stream fp32; fp16 keeps 3 more mantissa bits, so it must be the closer of the two."""
    l_ref, _ = rows_scored
    fast, (logits, act) = half_forward(dtype)
    assert fast.engine.act_dtype == dtype and fast.engine.QKV.dtype == dtype
    assert np.isfinite(logits).all() and np.isfinite(act).all()
    dp = np.abs(_softmax(logits) - _softmax(l_ref)).max()
    assert dp < (0.02 if dtype == torch.float16 else 0.15), dp
    if dtype == torch.float16:
        dp_bf = np.abs(_softmax(half_forward(torch.bfloat16)[1][0]) - _softmax(l_ref)).max()
        assert dp < dp_bf, (dp, dp_bf)


def test_max_tokens_cuts_chunks_and_a_bad_value_names_it(bundle, rows, rows_scored):
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096)
    c0 = fast.stats.chunks
    lg, p = fast.forward(rows, max_tokens=300)
    assert fast.stats.chunks - c0 >= sum(len(r) for r in rows) // 300
    l_ref, p_ref = rows_scored
    np.testing.assert_allclose(lg, l_ref, atol=2e-4, rtol=1e-4)
    for bad in (0, -5, 2.5, "512", True):
        with pytest.raises(ValueError, match="max_tokens"):
            fast.forward(rows, max_tokens=bad)


def test_a_bad_activation_dtype_names_the_option(bundle):
    with pytest.raises(ValueError, match="act_dtype='fp8'"):
        make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", act_dtype="fp8")
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", act_dtype="FP16")
    assert fast.engine.act_dtype == torch.float16


def test_single_row_and_order(engine, bundle, rows):
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch")
    one = rows[3:4]
    l1, p1 = engine.backend.forward(one)
    l2, p2 = fast.forward(one)
    np.testing.assert_allclose(l2, l1, atol=2e-4, rtol=1e-4)
    rev = rows[::-1][:9]
    la, _ = fast.forward(rev)
    lb, _ = engine.backend.forward(rev)
    np.testing.assert_allclose(la, lb, atol=2e-4, rtol=1e-4)


def test_registry_and_errors(bundle):
    m = load_model(bundle)
    be = registry_backend("fast", m, bundle, torch.device("cpu"), ops="torch")
    # rows to the encoder's positions (8192; the default buffers hold 16384 tokens), past the checkpoint's max_len
    assert be.name == "fast" and be.max_tokens_per_row == 8192 > bundle.max_len
    with pytest.raises(ValueError, match="at most 8192 tokens per row"):
        be.forward([Row([5] * 8193, [1], 0)])
    small = registry_backend("fast", m, bundle, torch.device("cpu"), ops="torch", max_batch_tokens=1024)
    assert small.max_tokens_per_row == 1024   # within its buffers
    with pytest.raises(ValueError, match="at most 1024"):
        small.forward([Row([5] * 1025, [1], 0)])
    with pytest.raises(ValueError, match="no tokens"):
        be.forward([Row([], [], 0)])
    with pytest.raises(ValueError, match="marker"):
        be.forward([Row([5, 6], [2], 0)])
    with pytest.raises(BackendUnavailable):
        make_backend(m, bundle, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown fast backend options"):
        make_backend(m, bundle, torch.device("cpu"), ops="torch", bogus=1)
    logits, p0 = be.forward([])
    assert logits.shape == (0, 0) and p0.shape == (0,)


def test_bucket_choice(bundle):
    ff = FastForward(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096)
    assert ff.bucket_for(72, 1) == 128
    assert ff.bucket_for(64, 1) == 64
    assert ff.bucket_for(64, 20) == 320   # 20 short rows need a bucket with 20 row slots (T // 16)
    with pytest.raises(ValueError):
        ff.bucket_for(5000, 1)


def test_staging_from_row_arrays_equals_staging_from_id_lists(engine, bundle, rows):
    import dataclasses
    import pickle

    from model.engine import Engine
    from tests import cases as C

    # only an engine over a packed backend builds the arrays (an eager engine or an ingress would not use them)
    assert all(r.arr is None for r in rows) and not engine.builder.row_arrays
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096)
    eng = Engine(bundle, fast)
    assert eng.builder.row_arrays
    states, qs = C.cases(3)[1]
    built = [r for e in eng.encode_many(states, eng.prepare(qs)) for r in e.rows]
    assert [r.ids for r in built] == [r.ids for e in engine.encode_many(states, engine.prepare(qs)) for r in e.rows]
    assert all(r.arr is not None and r.arr.tolist() == r.ids for r in built)   # the builder's rows carry both
    ff = fast.engine
    part = (built * 20)[:20]
    Tb = ff.bucket_for(sum(len(r) for r in part), len(part))
    ff._stage(part, Tb)
    size = ff._int_size(Tb)
    want = ff._ints_host[:size].clone()
    plain = [dataclasses.replace(r, arr=None) for r in part]
    for variant in (plain, pickle.loads(pickle.dumps(part)), part[:1] + plain[1:]):
        assert all(r.arr is None for r in variant[1:])
        ff._ints_host.fill_(-7)
        ff._stage(variant, Tb)
        assert torch.equal(ff._ints_host[:size], want)
    # an array that no longer matches its row's ids (ids edited after building) is not trusted
    edited = [dataclasses.replace(part[0], ids=part[0].ids[:-1])] + part[1:]
    assert len(edited[0].arr) == len(edited[0]) + 1
    ff._stage(edited, ff.bucket_for(sum(len(r) for r in edited), len(edited)))
    n = len(edited[0])
    assert ff._ints_host[:n].tolist() == edited[0].ids


def test_the_heads_last_layer_on_gathered_rows_answers_like_the_eager_model(engine, bundle, rows):
    """After the head's last attention only markers and [CLS] are read: those rows alone go on (Tb / 8 of them), or
    all Tb rows for a batch of short rows full of options; both answer like the eager model."""
    from model.backends.fast import gather_capacity

    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=4096)
    ff = fast.engine
    long_rows = [r for r in rows if len(r) >= 40][:6]
    dense = [Row(r.ids[:12], list(range(1, 11)), r.qtype) for r in rows[:6]]   # 10 markers in 12 tokens
    for batch, gathered in ((long_rows, True), (dense, False)):
        Tb = ff.bucket_for(sum(len(r) for r in batch), len(batch))
        _, g = ff._stage(batch, Tb)
        assert (g == gather_capacity(Tb) < Tb) if gathered else (g == Tb)
        l1, p1 = engine.backend.forward(batch)
        l2, p2 = fast.forward(batch)
        np.testing.assert_allclose(l2, l1, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(p2, p1, atol=1e-5)
    # repeated markers can list more tokens than the bucket holds: every token then goes on, in order
    repeated = [Row(r.ids[:6], [1, 2, 3] * 10, r.qtype) for r in rows[:10]]
    for batch in (long_rows + dense, repeated):
        la, pa = fast.forward(batch)
        lb, pb = engine.backend.forward(batch)
        np.testing.assert_allclose(la, lb, atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(pa, pb, atol=1e-5)
    Tb = ff.bucket_for(60, 10)
    assert sum(len(r.markers) + 1 for r in repeated) > Tb and ff._stage(repeated, Tb)[1] == Tb


def test_the_pdl_setting_reaches_the_kernels(monkeypatch):
    """$LAYA_FLEET_PDL (small by default, all, off) decides which builds the fast backend's kernels get: off builds
    none with programmatic dependent launch; a value outside the three is an error naming the variable or option,
    not a silent default."""
    import os

    from kernels import _tl
    from model.backends.fast import configure_tilelang

    monkeypatch.setattr(_tl, "_config", dict(_tl._config))
    monkeypatch.setenv("TILELANG_CACHE_DIR", os.environ.get("TILELANG_CACHE_DIR", ""))
    monkeypatch.delenv("LAYA_FLEET_PDL", raising=False)
    assert configure_tilelang("sm_90a") == "small" and _tl.pdl()
    monkeypatch.setenv("LAYA_FLEET_PDL", "off")
    assert configure_tilelang("sm_90a") == "off" and not _tl.pdl()
    monkeypatch.setenv("LAYA_FLEET_PDL", "ALL")
    assert configure_tilelang("sm_90a") == "all" and _tl.pdl()
    assert configure_tilelang("sm_90a", pdl="off") == "off" and not _tl.pdl()   # the backend option wins
    monkeypatch.setenv("LAYA_FLEET_PDL", "1")
    with pytest.raises(ValueError, match="LAYA_FLEET_PDL"):
        configure_tilelang("sm_90a")
    with pytest.raises(ValueError, match="pdl is one of small, all, off, got 'on'"):
        configure_tilelang("sm_90a", pdl="on")


def test_a_bad_pdl_option_names_itself_even_on_the_torch_ops(bundle):
    """The fast backend's `pdl` option is checked where no TileLang kernel would read it, as on CPU."""
    with pytest.raises(ValueError, match="pdl is one of small, all, off, got True"):
        make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", pdl=True)


def test_kernel_specs_build_pdl_where_each_batch_size_runs_it():
    """Under "small" the small-tile GEMMs get only their PDL build, the hand-warp-specialised ones and the attention
    walking several heads a block (large batches) only their plain one, and the kernels every batch runs (norms,
    RoPE, attention, the scorer's narrow GEMM) both; "all" builds everything with PDL, "off" nothing, and a GPU
    before Hopper never."""
    from kernels import gemm
    from model.backends.fast.precompile import shape_dims
    from model.backends.fast.specs import PDL, kernel_specs, spec_op

    dims = shape_dims("modernbert-large")
    off = kernel_specs(**dims, arch="sm_90a", sms=132, pdl="off")
    assert not [k for k, _ in off if k.endswith(PDL)]
    small = kernel_specs(**dims, arch="sm_90a", sms=132, pdl="small")
    kinds = {}
    for k, a in small:
        kinds.setdefault((k.removesuffix(PDL), a), set()).add(k.endswith(PDL))
    assert set(kinds) == set(off)
    for (k, a), builds in kinds.items():
        if k == "gemm_ws" or (k == "attention" and a[2].hp > 1):   # only the largest buckets run these
            assert builds == {False}
        elif k in ("add_ln", "rope", "attention") or (k == "gemm" and a[4] == gemm.NARROW):
            assert builds == {False, True}, (k, a)
        else:
            assert k in ("gemm", "geglu") and builds == {True}, (k, a)
    every = kernel_specs(**dims, arch="sm_90a", sms=132, pdl="all")
    assert len(every) == len(off) and set(every) == {(k + PDL, a) for k, a in off}
    assert kernel_specs(**dims, arch="sm_80", sms=108, pdl="all") == kernel_specs(**dims, arch="sm_80", sms=108)
    assert {spec_op(sp) for sp in small} == {spec_op(sp) for sp in off}


def test_warmup_to_larger_buckets_builds_what_they_run(bundle, monkeypatch):
    """Kernels that only larger buckets run (kernel_specs' max_tokens) are built when a warm-up grows the buffers,
    in one parallel build, and not again when it does not grow them; torch ops build nothing."""
    fast = make_backend(load_model(bundle), bundle, torch.device("cpu"), ops="torch", max_batch_tokens=1024)
    ff = fast.engine
    grown, built = [], []
    real_grown = ff._grown
    monkeypatch.setattr(ff, "_grown", lambda: (grown.append(ff.T_max), real_grown()))
    monkeypatch.setattr(ff, "_compile_all", lambda workers: built.append(ff.T_max))
    fast.warmup(4096)
    fast.warmup(2048)
    assert grown == [ff.T_max] and ff.T_max >= 4096 and built == []   # torch ops only: nothing to build
    monkeypatch.setattr(ff, "ops", dict(ff.ops, attention="tilelang"))
    real_grown()
    assert built == [ff.T_max]


def test_auto_falls_back_to_eager_without_cuda(tiny_checkpoint):
    import model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = model.load(tiny_checkpoint, device="cpu", backend="auto")
    assert eng.backend_name == "eager"


# -- GPU ----------------------------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_tilelang = pytest.mark.skipif(not HAS_TILELANG, reason="needs tilelang")


@pytest.fixture(scope="module")
def fast_gpu(bundle):
    be = make_backend(load_model(bundle), bundle, torch.device("cuda"), max_batch_tokens=4096)
    be.warmup(4096)
    return be


@gpu
@needs_tilelang
def test_fast_gpu_matches_eager(engine, bundle, fast_gpu, rows):
    """No worse than our eager bf16 against the fp32 reference (a random checkpoint amplifies bf16
    rounding, so both sit well above 0.02 on some rows; see docs/fast_path.md)."""
    from model.backends.eager import EagerBackend

    l_ref, p_ref = engine.backend.forward(rows)     # fp32 on CPU
    bf16 = EagerBackend(load_model(bundle), bundle.tokenizer.pad_token_id, torch.device("cuda"), bundle.max_len)
    l_bf, p_bf = bf16.forward(rows)
    l_fast, p_fast = fast_gpu.forward(rows)
    assert np.isfinite(l_fast).all() and np.isfinite(p_fast).all()
    dp_fast = np.abs(_softmax(l_fast) - _softmax(l_ref)).max()
    dp_bf = np.abs(_softmax(l_bf) - _softmax(l_ref)).max()
    assert dp_fast <= max(0.02, 1.25 * dp_bf), (dp_fast, dp_bf)
    agree_fast = (l_fast.argmax(-1) == l_ref.argmax(-1)).mean()
    agree_bf = (l_bf.argmax(-1) == l_ref.argmax(-1)).mean()
    assert agree_fast >= agree_bf - 0.03, (agree_fast, agree_bf)
    assert np.abs(p_fast - p_ref).max() <= max(0.02, 1.25 * np.abs(p_bf - p_ref).max())


@gpu
@needs_tilelang
def test_fast_gpu_fp16_is_closer_to_fp32_than_bf16(engine, bundle, fast_gpu, rows):
    """The fp16 kernels (act_dtype=torch.float16) against the fp32 reference: finite, and closer than bf16."""
    l_ref, _ = engine.backend.forward(rows)
    fp16 = make_backend(load_model(bundle), bundle, torch.device("cuda"), max_batch_tokens=4096,
                        act_dtype=torch.float16)
    fp16.warmup(4096)
    l16, p16 = fp16.forward(rows)
    l_bf, _ = fast_gpu.forward(rows)
    assert np.isfinite(l16).all() and np.isfinite(p16).all()
    dp16 = np.abs(_softmax(l16) - _softmax(l_ref)).max()
    dp_bf = np.abs(_softmax(l_bf) - _softmax(l_ref)).max()
    assert dp16 < dp_bf, (dp16, dp_bf)


@gpu
@needs_tilelang
def test_fast_gpu_no_capture_after_warmup_and_threads(fast_gpu, rows):
    before = fast_gpu.stats.captures_after_warmup
    sizes = [1, 2, 3, 7, 20, len(rows)]
    expected = {n: fast_gpu.forward(rows[:n]) for n in sizes}
    assert fast_gpu.stats.captures_after_warmup == before == 0
    errors = []

    def worker(n):
        for _ in range(3):
            lg, p = fast_gpu.forward(rows[:n])
            if not (np.array_equal(lg, expected[n][0]) and np.array_equal(p, expected[n][1])):
                errors.append(n)

    ts = [threading.Thread(target=worker, args=(n,)) for n in sizes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


@gpu
@needs_tilelang
def test_fast_gpu_multi_chunk_forward_is_pipelined_and_exact(fast_gpu, rows):
    """A forward over several chunks queues every chunk before collecting any (two host staging slots, each
    chunk's outputs copied out of the static tail buffer the next chunk overwrites): every chunk's answers equal
    that chunk run alone, bit for bit."""
    ff = fast_gpu.engine
    many, total = [], 0
    while total < 4 * ff.T_max:   # rows in a shuffled order, so neighbouring chunks differ in shape
        r = rows[(len(many) * 7) % len(rows)]
        many.append(r)
        total += len(r)
    chunks = ff._chunks(many)
    assert len(chunks) >= 4
    alone = [fast_gpu.forward(c) for c in chunks]
    c0 = ff.stats.chunks
    lg, p = fast_gpu.forward(many)
    assert ff.stats.chunks - c0 == len(chunks)
    pos = 0
    for la, pa in alone:
        n, k = la.shape
        np.testing.assert_array_equal(lg[pos:pos + n, :k], la)
        assert (lg[pos:pos + n, k:] == -1e4).all()
        np.testing.assert_array_equal(p[pos:pos + n], pa)
        pos += n
    assert pos == len(many)


@gpu
@needs_tilelang
def test_fast_gpu_a_launched_forward_equals_the_forward_and_frees_the_lock(fast_gpu, rows):
    """`launch` queues a one-chunk forward without waiting: polled to done and collected, it equals `forward`
    bit for bit and the lock is free again; rows of more than one chunk are not launched."""
    ff = fast_gpu.engine
    sizes = [n for n in (1, 3, 7, 11, 20) if len(ff._chunks(rows[:n])) == 1]
    assert len(sizes) >= 3
    for n in sizes:
        want = fast_gpu.forward(rows[:n])
        launched = fast_gpu.launch(rows[:n])
        assert launched is not None
        while not launched.ready():
            pass
        lg, p = launched.collect()
        np.testing.assert_array_equal(lg, want[0])
        np.testing.assert_array_equal(p, want[1])
        assert ff._lock.acquire(blocking=False)
        ff._lock.release()
    many, total = [], 0
    while total <= ff.T_max:
        many.append(rows[len(many) % len(rows)])
        total += len(many[-1])
    assert fast_gpu.launch(many) is None


@gpu
@needs_tilelang
def test_fast_gpu_kernels_answer_the_same_with_and_without_pdl(bundle, fast_gpu, rows):
    """Programmatic dependent launch changes when a kernel starts, never what it computes: the default ("small":
    PDL builds for the small-tile regime's batches, plain ones past it), every kernel with it and none give the
    same answers bit for bit, graphs and eager tails, with no capture after warm-up."""
    from kernels import _tl
    from model.backends.fast import configure_tilelang

    assert fast_gpu.engine.pdl == "small"
    small_m = fast_gpu.engine.tuning.small_m
    sizes = [n for n in (1, 3, 11, len(rows)) if n <= len(rows)]
    assert sum(len(r) for r in rows) > small_m   # both regimes
    try:
        for mode in ("off", "all"):
            other = make_backend(load_model(bundle), bundle, torch.device("cuda"), max_batch_tokens=4096, pdl=mode)
            other.warmup(4096)
            assert other.engine.pdl == mode
            for n in sizes:
                la, pa = other.forward(rows[:n])
                lb, pb = fast_gpu.forward(rows[:n])
                np.testing.assert_array_equal(la, lb)
                np.testing.assert_array_equal(pa, pb)
            assert other.stats.captures_after_warmup == 0
    finally:
        configure_tilelang()
    # the default's large batches ran the hand-warp-specialised GEMMs' plain builds, its small ones PDL builds
    built = list(_tl._kernels)
    assert any(k[0] == "gemm_manual" and k[-1] != "pdl" for k in built)
    assert any(k[0] == "gemm" and k[-1] == "pdl" for k in built)


@gpu
@needs_tilelang
def test_fast_gpu_graphs_match_eager_kernels(bundle, fast_gpu, rows):
    plain = make_backend(load_model(bundle), bundle, torch.device("cuda"), use_graphs=False, max_batch_tokens=4096)
    la, pa = plain.forward(rows[:11])
    lb, pb = fast_gpu.forward(rows[:11])
    np.testing.assert_allclose(la, lb, atol=1e-5)
    np.testing.assert_allclose(pa, pb, atol=1e-6)


def test_benchmark_rejects_an_unknown_tag_to_skip():
    """bench/fast_path.py --skip-attention / --skip-manual: a misspelt tag is an error naming it and the candidates,
    not a silent run of the candidate it meant (no GPU needed: the check runs before any section)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "bench" / "fast_path.py"), "--device", "cpu",
                        "--skip-attention", "64x64s1t128gnlv,64x64nope"], capture_output=True, text=True, cwd=root,
                       timeout=120)
    assert r.returncode == 2
    assert "--skip-attention: unknown 64x64nope" in r.stderr and "64x64s1t128gnlv" in r.stderr
    # the same for the manual GEMM alternatives (--skip-manual)
    r = subprocess.run([sys.executable, str(root / "bench" / "fast_path.py"), "--device", "cpu",
                        "--skip-manual", "128x128x64s4p132w0j,128x128x64s4p132w0jc9"], capture_output=True,
                       text=True, cwd=root, timeout=120)
    assert r.returncode == 2
    assert "--skip-manual: unknown 128x128x64s4p132w0jc9" in r.stderr and "128x256x64s4p132w0g3q" in r.stderr
