"""The epilogue of kernels/gemm_manual.py's GEMMs: a consumer warpgroup's fp32 fragment (bm / 2 rows x bn columns)
through bias, activation, GeGLU and RoPE, staged as a 16-bit tile in shared memory and stored by TMA, which clips
rows >= M and columns >= N. `GemmWSConfig.epilogue` picks the staging: "chunk" (EPI_COLS columns at a time through
a double buffer, overlapping the stores with the next chunk's math), "full" (one tile) or "alias" (the consumer's
own A half-ring, when shared memory has no room for a tile of its own)."""

from . import _tl
from .gemm_ws_config import EPI_BARRIER, EPI_COLS, GemmWSConfig


def macro(T, cfg: GemmWSConfig, bias: bool, act: str, rope_cols: int, geglu: bool, dtype: str, epi: str):
    """gemm_manual's epilogue macro epilogue(C, Bias, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, by, bx, grp), run by
    consumer warpgroup `grp` of the block on output tile (by, bx): C_l the accumulator (Cx_l the gate half of a
    GeGLU), Cg_s its staging tile, Cs_l / Sn_l its rows' cosines and sines and Xr_l a 32-column fragment for RoPE
    in registers. The bias is added here only when `bias` (the LayerNorm forms add theirs before)."""
    from .gemm import apply_act

    bm, bn, bk, S = cfg.bm, cfg.bn, cfg.bk, cfg.stages
    hm, joint = bm // 2, cfg.joint
    DT, F32 = dtype, _tl.F32

    @T.macro
    def epilogue(C, Bias, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, by, bx, grp):
        r0 = by * bm + grp * hm
        if epi == "chunk":
            # EPI_COLS columns at a time through a double buffer: a buffer is rewritten only once the store from
            # it two chunks ago has read it (at most one bulk group, the other buffer's, pending)
            for c in T.unroll(bn // EPI_COLS):
                if geglu:
                    for i, j in T.Parallel(hm, EPI_COLS):
                        C_l[i, c * EPI_COLS + j] = apply_act(C_l[i, c * EPI_COLS + j], "gelu", T) * \
                            Cx_l[i, c * EPI_COLS + j]
                elif bias:
                    for i, j in T.Parallel(hm, EPI_COLS):
                        C_l[i, c * EPI_COLS + j] = apply_act(
                            C_l[i, c * EPI_COLS + j] + Bias[bx * bn + c * EPI_COLS + j], act, T)
                elif act != "none":
                    for i, j in T.Parallel(hm, EPI_COLS):
                        C_l[i, c * EPI_COLS + j] = apply_act(C_l[i, c * EPI_COLS + j], act, T)
                if rope_cols and cfg.rope_regs:
                    if bx * bn + c * EPI_COLS < rope_cols:
                        # a Q or K head, rotated in registers from its rounded value; the upper half goes through a
                        # fragment of its own (a parallel loop indexes a fragment one way only)
                        for i, d in T.Parallel(hm, 32):
                            Xr_l[i, d] = C_l[i, c * EPI_COLS + 32 + d]
                        for i, d in T.Parallel(hm, 32):
                            x0 = T.Cast(F32, T.Cast(DT, C_l[i, c * EPI_COLS + d]))
                            x1 = T.Cast(F32, T.Cast(DT, Xr_l[i, d]))
                            C_l[i, c * EPI_COLS + d] = x0 * Cs_l[i, d] - x1 * Sn_l[i, d]
                            Xr_l[i, d] = x1 * Cs_l[i, d] + x0 * Sn_l[i, d]
                        for i, d in T.Parallel(hm, 32):
                            C_l[i, c * EPI_COLS + 32 + d] = Xr_l[i, d]
                T.tma_store_wait(1)
                T.sync_threads(EPI_BARRIER + grp, 128)
                T.copy(C_l[:, c * EPI_COLS:(c + 1) * EPI_COLS], Cg_s[c % 2, :, :])
                if rope_cols and not cfg.rope_regs:
                    if bx * bn + c * EPI_COLS < rope_cols:
                        # a Q or K head: rotate the staged (rounded) values in place; each thread reads both
                        # halves of its pairs before writing them, other threads' writes are behind the barrier
                        T.sync_threads(EPI_BARRIER + grp, 128)
                        for i, d in T.Parallel(hm, 32):
                            x0 = T.Cast(F32, Cg_s[c % 2, i, d])
                            x1 = T.Cast(F32, Cg_s[c % 2, i, d + 32])
                            Cg_s[c % 2, i, d] = T.Cast(DT, x0 * Cs_l[i, d] - x1 * Sn_l[i, d])
                            Cg_s[c % 2, i, d + 32] = T.Cast(DT, x1 * Cs_l[i, d] + x0 * Sn_l[i, d])
                T.fence_proxy_async()
                T.sync_threads(EPI_BARRIER + grp, 128)
                T.tma_copy(Cg_s[c % 2, :, :], C[r0:r0 + hm, bx * bn + c * EPI_COLS:bx * bn + (c + 1) * EPI_COLS])
        else:
            # the previous tile's store must have read the staging tile before it is overwritten; then fragment
            # -> shared, fence to the async proxy, the stores (no wait: the next tile or the kernel's end waits)
            if geglu:
                for i, j in T.Parallel(hm, bn):
                    C_l[i, j] = apply_act(C_l[i, j], "gelu", T) * Cx_l[i, j]
            elif bias:
                for i, j in T.Parallel(hm, bn):
                    C_l[i, j] = apply_act(C_l[i, j] + Bias[bx * bn + j], act, T)
            elif act != "none":
                for i, j in T.Parallel(hm, bn):
                    C_l[i, j] = apply_act(C_l[i, j], act, T)
            T.tma_store_wait(0)
            T.sync_threads(EPI_BARRIER + grp, 128)
            if epi == "alias":
                # Cg_s is this consumer's A half-ring (S, hm, bk): column block c of the tile goes to slab c, which
                # has the 128-byte-swizzled (hm, bk) layout of the TMA store box of that column block
                for c in T.unroll(S):
                    T.copy(C_l[:, c * bk:(c + 1) * bk], Cg_s[c, :, :])
            elif joint:
                T.copy(C_l[:, 0:bn], Cg_s)
            else:
                T.copy(C_l, Cg_s)
            T.fence_proxy_async()
            T.sync_threads(EPI_BARRIER + grp, 128)
            if epi == "alias":
                for c in T.unroll(S):
                    T.tma_copy(Cg_s[c, :, :], C[r0:r0 + hm, bx * bn + c * bk:bx * bn + (c + 1) * bk])
            else:
                T.tma_copy(Cg_s, C[r0:r0 + hm, bx * bn:(bx + 1) * bn])

    return epilogue


__all__ = ["macro"]
