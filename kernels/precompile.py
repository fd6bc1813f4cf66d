"""Build TileLang kernels ahead of time into the kernel cache (no GPU needed; sm_90a by default).

    python -m kernels.precompile --shapes tiny modernbert-large --tests --sweep [--fp16]

The cache (TileLang's, under `model.cache.local_dir("tilelang")`) is keyed by the kernel source, target
and tilelang version, not by the machine's Python or paths, so a cache filled here serves the GPU box.
Also home of the kernel lists that the GPU tests and the GEMM sweep use.
"""

import argparse
import logging
import time
from dataclasses import replace

import torch

from . import attention as _attn
from . import geglu as _geglu
from . import gemm as _gemm
from . import gemm_manual as _gm
from . import layernorm as _ln
from .forward import compile_specs, kernel_specs

BF = torch.bfloat16

# Candidate large-M tiles for the sweep (Hopper: 2 consumer warpgroups + a TMA producer warpgroup; p132: one
# persistent block per SM of an H100/H200, whose producer loads the next tile during this tile's epilogue;
# no gain measured on the H200, kept so a new GPU or torch release gets the choice; n: no warp specialisation,
# 96 registers a thread, so two blocks share an SM and one's epilogue overlaps the other's main loop: 480-520 TF/s
# against 580-680 warp-specialised on the H200, ninth session, kept as the one candidate of that kind).
SWEEP_GEMM = (
    _gemm.LARGE,
    _gemm.GemmConfig(bm=128, bn=256, bk=64, stages=4, threads=256),
    _gemm.GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256, persistent=132),
    _gemm.GemmConfig(bm=256, bn=128, bk=64, stages=3, threads=256),
    _gemm.GemmConfig(bm=128, bn=128, bk=128, stages=3, threads=256),
    _gemm.GemmConfig(bm=128, bn=128, bk=128, stages=3, threads=256, persistent=132),
    _gemm.GemmConfig(bm=128, bn=128, bk=64, stages=3, threads=256, ws=False),
)
# Tried and dropped (tenth session, H200): 192 x 128 tiles with three consumer warpgroups, for fewer partial last
# waves (N = 1024 at 15360 tokens: 480 tiles of 256 x 128 are 3.6 waves of 132 SMs, 640 of 192 x 128 are 4.85):
# 568 against 560 TF/s for Wo at M = 15360, 2-6% slower than the 128 x 256 / 256 x 128 tiles everywhere else.
# add+LayerNorm (bandwidth-bound: ~4.0 TB/s with the default at D = 1024 on the H200): rows and threads per block,
# each keeping D / 4 a multiple of the threads (see layernorm.default_config)
SWEEP_LN = (_ln.LNConfig(4, 128), _ln.LNConfig(2, 64), _ln.LNConfig(4, 64), _ln.LNConfig(8, 128),
            _ln.LNConfig(8, 256), _ln.LNConfig(16, 256))
SWEEP_GEGLU = (
    _geglu.LARGE,
    _geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256),
    _geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, persistent=132),
    _geglu.GegluConfig(bm=128, bn=128, bk=64, stages=4, threads=256, persistent=132),
    _geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, ws=False),
    # 256 rows x 64 columns of each half: the same 256-wide accumulator pair, the A tile read once for twice the rows
    # (527 / 539 TF/s against 541 for LARGE on the H200, ninth session)
    _geglu.GegluConfig(bm=256, bn=64, bk=64, stages=3, threads=256),
    _geglu.GegluConfig(bm=256, bn=64, bk=64, stages=4, threads=256),
)


def shape_dims(shape: str) -> dict:
    """Model dimensions of a make-checkpoint shape: d, heads, inter, ffn, windows."""
    from model.make_checkpoint import SHAPES

    s = SHAPES[shape]
    return dict(d=s["hidden"], heads=s["heads"], inter=s["ff"], ffn=4 * s["hidden"], windows={0, 64})


def model_specs(shape: str, dtype: torch.dtype = BF) -> list[tuple[str, tuple]]:
    """The kernels a make-checkpoint shape's fast forward uses (bf16, or fp16 with act_dtype=torch.float16)."""
    return kernel_specs(**shape_dims(shape), dtype=dtype)


def gemm_shapes(d: int, inter: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of every distinct GEMM of encoder + head; "geglu" rows give (F, K)."""
    return [("wqkv", 3 * d, d), ("wo", d, d), ("wi_geglu", inter, d), ("wo_mlp", d, inter),
            ("head_ffn1", ffn, d), ("head_ffn2", d, ffn)]


def sweep_specs(shape: str = "modernbert-large") -> list[tuple[str, tuple]]:
    """Every candidate config of every GEMM shape of `shape` (no bias, and the bias / activation variants
    the head uses, since a winner is used there too), and every attention candidate."""
    dims = shape_dims(shape)
    d, ffn = dims["d"], dims["ffn"]
    out = []
    for name, N, K in gemm_shapes(d, dims["inter"], ffn):
        if name == "wi_geglu":
            out += [("geglu", (N, K, c)) for c in SWEEP_GEGLU]
        else:
            out += [("gemm", (N, K, False, "none", c, BF)) for c in SWEEP_GEMM]
        if name == "wqkv":   # the forward runs the winner with its RoPE epilogue
            out += [("gemm", (N, K, False, "none", c, BF, BF, 2 * d)) for c in SWEEP_GEMM if c.bn % 64 == 0]
    for c in SWEEP_GEMM:
        out += [("gemm", (3 * d, d, True, "none", c, BF)), ("gemm", (d, d, True, "none", c, BF)),
                ("gemm", (d, d, True, "gelu", c, BF)), ("gemm", (ffn, d, True, "relu", c, BF)),
                ("gemm", (d, ffn, True, "none", c, BF))]
    for c in _attn.CANDIDATES:
        out += [("attention", (dims["heads"], w, c)) for w in (0, 64)]
        if c.lean:   # a lean winner also runs the fp16 engine (its forward: encoder layers and the head's attention)
            out += [("attention", (h, w, c, torch.float16)) for h, w in ((dims["heads"], 0), (dims["heads"], 64),
                                                                          (max(1, d // 64), 0))]
    # the hand-warp-specialised kernels the forward runs, timed beside the candidates (bf16)
    for name, N, K in gemm_shapes(d, dims["inter"], ffn):
        g = name == "wi_geglu"
        for c in ((_gm.GEGLU if g else _gm.GEMM),) + _gm.ALTERNATIVES[g]:
            out.append(("gemm_ws", (N, K, c, False, "none", 0, g, BF)))
            if name == "wqkv":
                out.append(("gemm_ws", (N, K, c, False, "none", 2 * d, False, BF)))
    # a timed config (the form's default or an alternative) that wins runs every product of the forward, or the
    # products it wins, in the bf16 and the fp16 engine
    for g, alts in _gm.ALTERNATIVES.items():
        saved = _gm.TUNED.get(g)
        try:
            for c in ((_gm.GEGLU if g else _gm.GEMM),) + alts:
                _gm.TUNED[g] = c
                for dt in (BF, torch.float16):
                    out += [sp for sp in kernel_specs(**dims, dtype=dt) if sp[0] == "gemm_ws"]
        finally:
            if saved is None:
                _gm.TUNED.pop(g, None)
            else:
                _gm.TUNED[g] = saved
    # every add+LN the forward launches, per candidate (a winner serves all of them)
    for c in SWEEP_LN:
        out += [("add_ln", (d, m, False, 1e-5, BF, c)) for m in ("add", "inplace", "add_inplace")]
        out += [("add_ln", (d, m, True, 1e-5, BF, c)) for m in ("plain", "add")]
    return out


def test_specs() -> list[tuple[str, tuple]]:
    """The kernels tests/test_kernels.py runs (awkward sizes are runtime M, so few compiles)."""
    out = [("gemm", (3072, 1024, False, "none", c, BF)) for c in (_gemm.SMALL, _gemm.LARGE)]
    out += [("gemm", (1024, 1024, True, "gelu", c, BF)) for c in (_gemm.SMALL, _gemm.LARGE)]
    out += [("gemm", (1024, 2624, False, "none", c, BF)) for c in (_gemm.SMALL, _gemm.LARGE)]
    out += [("gemm", (4096, 1024, True, "relu", _gemm.LARGE, BF)),
            ("gemm", (16, 1024, True, "none", _gemm.NARROW, torch.float32))]
    out += [("geglu", (2624, 1024, c)) for c in (_geglu.SMALL, _geglu.LARGE)]
    pers = _gemm.GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256, persistent=132)
    out += [("gemm", (3072, 1024, False, "none", pers, BF)),
            ("geglu", (2624, 1024, _geglu.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, persistent=132)))]
    nows = [c for c in SWEEP_GEMM if not c.ws]
    out += [("gemm", (3072, 1024, False, "none", c, BF)) for c in nows]
    out += [("geglu", (2624, 1024, c)) for c in SWEEP_GEGLU if not c.ws]
    out += [("gemm", (3072, 1024, False, "none", c, BF, BF, 2048)) for c in (_gemm.SMALL, _gemm.LARGE, pers, nows[0])]
    for mode in ("add", "plain", "inplace", "add_inplace"):
        for bias in (False, True):
            out.append(("add_ln", (1024, mode, bias, 1e-5, BF)))
    out.append(("rope", (16,)))
    for c in _attn.CANDIDATES:
        out += [("attention", (16, w, c)) for w in (0, 64)] + [("attention", (2, 0, c))]
    return out + manual_test_specs()


GEGLU_TEST_CFGS = (_gm.GEGLU, replace(_gm.GEGLU, inflight=1), replace(_gm.GEGLU, joint=False),
                   replace(_gm.GEGLU, joint=False, inflight=1), replace(_gm.GEGLU, persistent=0, stages=3, cluster=1),
                   replace(_gm.GEGLU, cluster=1, stagger=3), replace(_gm.GEGLU, cluster=1))


def manual_test_specs() -> list[tuple[str, tuple]]:
    """The kernels tests/test_gemm_manual.py runs."""
    cfgs = (_gm.GEMM, replace(_gm.GEMM, inflight=1), _gm.GemmWSConfig(stages=4),
            _gm.GemmWSConfig(stages=3, persistent=132), replace(_gm.GEMM, cluster=1, stagger=2),
            replace(_gm.GEMM, cluster=1))
    prods = [(3072, 1024, False, "none"), (1024, 2624, False, "none"), (4096, 1024, True, "relu"),
             (1024, 1024, True, "gelu"), (1024, 1000, False, "none")]
    out = [("gemm_ws", (N, K, c, b, a, 0, False, BF)) for c in cfgs for N, K, b, a in prods]
    out += [("gemm_ws", (3072, 1024, c, False, "none", 2048, False, BF))
            for c in (_gm.GEMM, replace(_gm.GEMM, cluster=1, stagger=2), replace(_gm.GEMM, rope_regs=False),
                      replace(_gm.GEMM, cluster=1))]
    out += [("gemm_ws", (2624, 1024, c, False, "none", 0, True, BF)) for c in GEGLU_TEST_CFGS]
    out += [("gemm_ws", (1024, 1024, _gm.GEMM, True, "none", 0, False, torch.float16))]
    out += [("gemm_ws", (2624, 1024, c, False, "none", 0, True, torch.float16))
            for c in (_gm.GEGLU, replace(_gm.GEGLU, joint=False), replace(_gm.GEGLU, cluster=1))]
    return out


def main(argv=None) -> int:
    """CLI entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=["tiny", "modernbert-large"])
    ap.add_argument("--tests", action="store_true", help="also the kernels of tests/test_kernels.py")
    ap.add_argument("--sweep", action="store_true", help="also the GEMM sweep candidates")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--fp16", action="store_true", help="also the shapes' fp16 kernels (act_dtype=torch.float16)")
    ap.add_argument("--pack", metavar="FILE.tar.xz", default=None,
                    help="then pack the node-local TileLang cache into FILE (what bench/gpu_env.sh unpacks into "
                         "$LAYA_FLEET_LOCAL_CACHE_DIR on a GPU host, so it compiles nothing)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    specs = []
    for s in a.shapes:
        specs += model_specs(s)
        if a.fp16:
            specs += model_specs(s, torch.float16)
    if a.tests:
        specs += test_specs()
    if a.sweep:
        specs += sweep_specs()
    specs = list(dict.fromkeys(specs))
    t = time.perf_counter()
    compile_specs(specs, a.workers)
    print("%d kernels ready in %.1fs" % (len(specs), time.perf_counter() - t))
    if a.pack:
        print("packed %s (%.1f MB)" % (a.pack, pack_cache(a.pack) / 1e6))
    return 0


def pack_cache(path: str) -> int:
    """Write the node-local TileLang kernel cache (`tilelang/` under the local cache root) to `path` as tar.xz;
    returns its size in bytes."""
    import os
    import tarfile

    from model.cache import local_dir

    src = local_dir("tilelang")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tarfile.open(path, "w:xz") as tar:
        tar.add(src, arcname="tilelang")
    return os.path.getsize(path)


if __name__ == "__main__":
    raise SystemExit(main())
