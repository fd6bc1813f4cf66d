"""The fast path's sweep candidates: the tile configs bench/fast_path.py times beside each op's default.

A winner is not applied here: bench/fast_path.py prints a proposed kernels/tuning.json (and writes it with
`--tuning-out`), and copying that file over the committed one is what makes the forward run it. `sweep_specs`
lists every candidate kernel of a shape, for `laya-fleet precompile --sweep`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kernels import attention as A
from kernels import geglu as G
from kernels import gemm as K
from kernels import gemm_manual as GM
from kernels import layernorm as L
from kernels.tuning import TABLE
from model.backends.fast.precompile import shape_dims

BF = torch.bfloat16

# large-M GEMM tiles: 2 consumer warpgroups + a TMA producer; p132 one persistent block per SM; ws=False none
SWEEP_GEMM = (
    K.LARGE,
    K.GemmConfig(bm=128, bn=256, bk=64, stages=4, threads=256),
    K.GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256, persistent=132),
    K.GemmConfig(bm=256, bn=128, bk=64, stages=3, threads=256),
    K.GemmConfig(bm=128, bn=128, bk=128, stages=3, threads=256),
    K.GemmConfig(bm=128, bn=128, bk=128, stages=3, threads=256, persistent=132),
    K.GemmConfig(bm=128, bn=128, bk=64, stages=3, threads=256, ws=False),
)
# add+LayerNorm rows and threads per block, each keeping D / 4 a multiple of the threads (layernorm.default_config)
SWEEP_LN = (L.LNConfig(4, 128), L.LNConfig(2, 64), L.LNConfig(4, 64), L.LNConfig(8, 128),
            L.LNConfig(8, 256), L.LNConfig(16, 256))
SWEEP_GEGLU = (
    G.LARGE,
    G.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256),
    G.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, persistent=132),
    G.GegluConfig(bm=128, bn=128, bk=64, stages=4, threads=256, persistent=132),
    G.GegluConfig(bm=128, bn=128, bk=64, stages=3, threads=256, ws=False),
    G.GegluConfig(bm=256, bn=64, bk=64, stages=3, threads=256),   # the A tile read once for twice the rows
    G.GegluConfig(bm=256, bn=64, bk=64, stages=4, threads=256),
)
# attention kernels timed against attention.DEFAULT
ATTENTION = (A.UNGUARDED, A.AttnConfig(guard=True), A.WARP_SPECIALISED,
             A.AttnConfig(bm=128, bn=64, stages=2, threads=256, guard=True),
             A.AttnConfig(bm=128, bn=128, stages=2, threads=256, guard=True),
             A.UNSPECIALISED, A.AttnConfig(bn=128, guard=True, ws=False),
             A.LEAN, A.AttnConfig(bn=128, guard=True, ws=False, lean=True),
             A.AttnConfig(guard=True, ws=False, lean=True, occupancy=5), A.OVERLAP,
             *(replace(A.OVERLAP, hp=h) for h in (2, 4, 8)))
# hand-warp-specialised configs timed beside gemm_manual's GEMM / GEGLU, keyed by geglu
GEMM_WS = {
    False: (replace(GM.GEMM, cluster=1), replace(GM.GEMM, cluster=1, stagger=3)),
    True: (replace(GM.GEGLU, cluster=1),),
}


def gemm_shapes(d: int, inter: int, ffn: int) -> list[tuple[str, int, int]]:
    """(name, N, K) of every distinct GEMM of encoder + head; "geglu" rows give (F, K)."""
    return [("wqkv", 3 * d, d), ("wo", d, d), ("wi_geglu", inter, d), ("wo_mlp", d, inter),
            ("head_ffn1", ffn, d), ("head_ffn2", d, ffn)]


def sweep_specs(shape: str = "modernbert-large") -> list[tuple[str, tuple]]:
    """Every candidate config of every GEMM shape of `shape` (with the bias / activation variants the head uses,
    since a winner runs there too), every attention candidate, the hand-warp-specialised alternatives in each
    product of the forward, and every add+LN candidate."""
    from model.backends.fast.specs import kernel_specs

    dims = shape_dims(shape)
    d, ffn = dims["d"], dims["ffn"]
    out = []
    for name, N, Kd in gemm_shapes(d, dims["inter"], ffn):
        if name == "wi_geglu":
            out += [("geglu", (N, Kd, c)) for c in SWEEP_GEGLU]
        else:
            out += [("gemm", (N, Kd, False, "none", c, BF)) for c in SWEEP_GEMM]
        if name == "wqkv":   # the forward runs the winner with its RoPE epilogue
            out += [("gemm", (N, Kd, False, "none", c, BF, BF, 2 * d)) for c in SWEEP_GEMM if c.bn % 64 == 0]
    for c in SWEEP_GEMM:
        out += [("gemm", (3 * d, d, True, "none", c, BF)), ("gemm", (d, d, True, "none", c, BF)),
                ("gemm", (d, d, True, "gelu", c, BF)), ("gemm", (ffn, d, True, "relu", c, BF)),
                ("gemm", (d, ffn, True, "none", c, BF))]
    for c in ATTENTION:
        out += [("attention", (dims["heads"], w, c)) for w in (0, 64)]
        if c.lean:   # a lean winner also runs the fp16 engine (encoder layers and the head's attention)
            out += [("attention", (h, w, c, torch.float16)) for h, w in ((dims["heads"], 0), (dims["heads"], 64),
                                                                          (max(1, d // 64), 0))]
    for name, N, Kd in gemm_shapes(d, dims["inter"], ffn):
        g = name == "wi_geglu"
        for c in ((GM.GEGLU if g else GM.GEMM),) + GEMM_WS[g]:
            out.append(("gemm_ws", (N, Kd, c, False, "none", 0, g, BF)))
            if name == "wqkv":
                out.append(("gemm_ws", (N, Kd, c, False, "none", 2 * d, False, BF)))
    # a config that wins runs every product of its form, in the bf16 and the fp16 engine
    for g, alts in GEMM_WS.items():
        for c in ((GM.GEGLU if g else GM.GEMM),) + alts:
            table = TABLE.with_entry("gemm_ws", "geglu" if g else "gemm", c)
            for dt in (BF, torch.float16):
                out += [sp for sp in kernel_specs(**dims, dtype=dt, table=table)
                        if sp[0] == "gemm_ws"]
    for c in SWEEP_LN:
        out += [("add_ln", (d, m, False, 1e-5, BF, c)) for m in ("add", "inplace", "add_inplace")]
        out += [("add_ln", (d, m, True, 1e-5, BF, c)) for m in ("plain", "add")]
    from bench.small_gemm import small_specs

    return out + small_specs(shape)   # bench/small_gemm.py's candidates
