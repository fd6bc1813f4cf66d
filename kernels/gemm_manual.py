"""Hopper GEMMs with hand-written warp specialisation: C[M,N] = act(A[M,K] @ W[N,K]^T + bias) (16-bit in/out,
fp32 accumulation), optionally with Wqkv's RoPE in the epilogue, or ModernBERT's GeGLU (two accumulators from one A
tile). The fast forward runs these on sm_90a for more than gemm.SMALL_M rows (kernels/tuning.py's `pick_gemm_ws`).

Written by hand because TileLang's automatic warp specialisation waits for every wgmma batch before releasing a
shared-memory stage and does not overlap a tile's epilogue with the next tile's loads. The schedule is CUTLASS's
"warp-specialised cooperative" one:

* warpgroup 0 is the producer (`setmaxnreg` down to `PRODUCER_REGS`): per k-step it waits for the stage's `empty`
  mbarrier, issues the TMA loads of A (one half per consumer) and W, and arrives on its `full` mbarrier;
* warpgroups 1 and 2 are consumers (`setmaxnreg` up to `CONSUMER_REGS`), each owning bm/2 rows x bn columns in an
  fp32 fragment (two for GeGLU): wait `full[s]`, issue the wgmma batch, release the stage (`inflight` says when);
* the epilogue (bias, activation, GELU x gate, RoPE; kernels/gemm_epilogue.py) runs on the fragment, stages a
  16-bit tile and stores it by TMA, which clips rows >= M and columns >= N, so any runtime M works.

`persistent > 0` launches that many blocks (one per SM) walking the output tiles in row-major order, the stage ring
running on across tiles so the producer loads the next tile during this tile's epilogue. `cluster=2` runs the
blocks in pairs on adjacent row blocks, each W tile loaded once and multicast into both (`empty` is then a cluster
barrier). `GemmWSConfig.epilogue` says where the output is staged. Compiled with TileLang's automatic warp
specialisation, pipelining and thread-sync insertion off: every synchronisation here is explicit. Measurements:
BENCHMARKS.md, "GPU fast path"."""

import torch

from . import _tl
from . import gemm_epilogue as _epi
from . import ln_fold as _lnf
from .gemm_ws_config import (
    CLUSTER_MIN_N,
    CONSUMER_REGS,
    CONSUMER_WARPS,
    EPI_BARRIER,
    EPI_COLS,
    GEGLU,
    GEGLU8,
    GEMM,
    GEMM8,
    PRODUCER_REGS,
    PRODUCER_THREADS,
    SMEM_LIMIT,
    GemmWSConfig,
    check_config,
)


def build_gemm_manual(N: int, K: int, cfg: GemmWSConfig = GemmWSConfig(), bias: bool = False, act: str = "none",
                      rope_cols: int = 0, geglu: bool = False, dtype: str = "bfloat16", fp8: bool = False,
                      ln: str = "", eps: float = 1e-5):
    """The TileLang PrimFunc main(A[M,K], W[N,K], Bias[N] f32, C[M,N]) (A, W, C `dtype`: bfloat16 or float16), M
    dynamic; C = act(A @ W^T + Bias) with the bias read only when `bias`.

    rope_cols > 0 (Wqkv): main(A, W, Bias, C, Pos[M] i32, Cos[P,32] f32, Sin[P,32] f32), and every 64-column head
    below rope_cols is rotated in the epilogue from its staged (rounded) value with fp32 math, as kernels/rope.py
    does to the stored output. geglu (ModernBERT's Wi): main(A, Wi[2N,K], C[M,N]) with C = gelu(A @ Wi[:N]^T) *
    (A @ Wi[N:]^T): one A tile feeds two accumulators (cfg.bn columns of each half), as kernels/geglu.py.

    fp8: A and W are e4m3 (C stays `dtype`) and every form takes two more arguments last, SA[M] f32 and SB[N] f32
    (SB[2N] for GeGLU): the products are dequantised by row and column scale, C[i, j] = act(SA[i] * SB[j] *
    (A[i] . W[j]) + Bias[j]), before anything else in the epilogue (kernels/quant.py makes A and SA); the GeGLU form
    rounds both dequantised halves to `dtype` first, as the bf16 Wi product of `torch._scaled_mm` is.

    ln (16-bit operands; kernels/ln_fold.py is the reference and prepares the weights): "fold": A's rows are the
    rounded residual stream and the LayerNorm (unit scale, eps `eps`) of each row is applied to the product, C =
    epi(rstd_i * (A_i . W_j - mu_i * Cs[j]) + Bias[j]) before RoPE / GeGLU, with W the weight times the norm's scale
    and Cs[NW] f32 its row sums, the row's mean and rstd summed by the consumers from the A tiles they multiply; Cs
    comes after Bias (the GeGLU form: main(A, Wi, Cs, C)). "residual": the residual add, main(A, W, Bias, X, C)
    with X[M,N] f32 the stream: X += A @ W^T + Bias, and C = X rounded (the next fold's A)."""
    from .gemm import ACTS

    wt, ab = 2 if geglu else 1, 1 if fp8 else 2
    check_config(cfg, wt, ab)
    if act not in ACTS:
        raise ValueError("act must be one of %s, got %r" % (ACTS, act))
    if rope_cols and (rope_cols % EPI_COLS or act != "none" or geglu or cfg.epilogue(wt, ab) != "chunk"):
        raise ValueError("a RoPE epilogue needs rope_cols a multiple of 64, no activation and a chunked epilogue")
    if geglu and (bias or act != "none"):
        raise ValueError("the GeGLU form takes no bias or activation")
    fold, resid = ln == "fold", ln == "residual"
    if ln not in ("", "fold", "residual") or (ln and (fp8 or act != "none")) or (resid and (geglu or rope_cols)):
        raise ValueError("ln is '', 'fold' (16-bit operands, no activation) or 'residual' (no activation, RoPE or "
                         "GeGLU), got %r" % (ln,))
    if fold and cfg.smem_bytes(wt, ab) + 8 * cfg.bm > SMEM_LIMIT - 1024:   # St_s: (2, bm / 2, 2) f32
        raise ValueError("%s leaves no room for the fold's row statistics" % cfg.tag())
    (tilelang, T), enter = _tl.tl(), _tl.pdl_enter(wait=cfg.cluster > 1)   # clusters wait in every build
    bm, bn, bk, S = cfg.bm, cfg.bn, cfg.bk, cfg.stages
    hm = bm // 2                          # rows per consumer warpgroup
    DT, F32, I32 = dtype, _tl.F32, _tl.I32
    AB = "float8_e4m3fn" if fp8 else DT   # the operands' type in memory and in the ring
    M = T.dynamic("M")
    Pn = T.dynamic("P")
    nbn = T.ceildiv(N, bn)
    k_iters = T.ceildiv(K, bk)
    acc_regs = hm * bn // 128             # fp32 accumulator registers per consumer thread (per accumulator)
    epi = cfg.epilogue(wt, ab)
    inflight = cfg.inflight
    P = cfg.persistent
    CL = cfg.cluster
    # with clusters, pair tiles: cluster c of P // 2 takes pair tile pt = w * (P // 2) + c, whose two row blocks
    # (2 * (pt // nbn) + rank; the second may lie past M: zero-filled loads, clipped stores) share column block pt % nbn
    n_tiles = T.ceildiv(T.ceildiv(M, bm), CL) * nbn
    n_waves = T.ceildiv(n_tiles, P // CL) if P else 1
    mask = 0b11 if CL == 2 else None      # W tiles: multicast to both blocks of the cluster (the first issues it)
    NW = 2 * N if geglu else N            # rows of W
    joint = cfg.joint
    stagger = min(cfg.stagger, -(-K // bk))   # a first tile of fewer k-steps releases the other consumer at its end
    if joint:
        acc_regs *= 2                     # one accumulator of 2 * bn columns
    epi_bias = bias and not ln            # the fold and the residual add the bias before the epilogue
    pingpong = cfg.pingpong
    warps = CONSUMER_WARPS // 2 if pingpong else CONSUMER_WARPS   # consumer warps that free a ring position
    PPN, PPG = (2, 1) if pingpong else (1, 0)   # ring positions a tile takes / a consumer skips

    @T.macro
    def release(empty, s):
        # a consumer warp frees stage s: with clusters, in both blocks (the multicast refills both at once)
        if CL == 2:
            T.mbarrier_arrive(empty[s], 0)
            T.mbarrier_arrive(empty[s], 1)
        else:
            T.mbarrier_arrive(empty[s])

    @T.macro
    def load(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, by, bx, k, g, half):
        # one k-step into ring position g: both A halves, or under ping-pong the half `half` of the consumer
        # that takes this position
        s = g % S
        T.mbarrier_wait_parity(empty[s], ((g // S) & 1) ^ 1)
        if pingpong:
            if half == 0:
                T.tma_copy(A[by * bm:by * bm + hm, k * bk:(k + 1) * bk], A0_s[s, :, :], barrier=full[s])
            else:
                T.tma_copy(A[by * bm + hm:by * bm + bm, k * bk:(k + 1) * bk], A1_s[s, :, :], barrier=full[s])
        else:
            T.tma_copy(A[by * bm:by * bm + hm, k * bk:(k + 1) * bk], A0_s[s, :, :], barrier=full[s])
            T.tma_copy(A[by * bm + hm:by * bm + bm, k * bk:(k + 1) * bk], A1_s[s, :, :], barrier=full[s])
        if joint:
            # GELU half into the stage tile's first bn rows, gate half into the rest (past 2N: zeros)
            T.tma_copy(W[bx * bn:(bx + 1) * bn, k * bk:(k + 1) * bk], W_s[s, 0:bn, :], barrier=full[s],
                       cluster_mask=mask)
            T.tma_copy(W[N + bx * bn:N + (bx + 1) * bn, k * bk:(k + 1) * bk], W_s[s, bn:2 * bn, :],
                       barrier=full[s], cluster_mask=mask)
        else:
            T.tma_copy(W[bx * bn:(bx + 1) * bn, k * bk:(k + 1) * bk], W_s[s, :, :], barrier=full[s],
                       cluster_mask=mask)
        if geglu and not joint:
            # the gate half's rows; past 2N (the last tile's tail) TMA fills zeros, never stored
            T.tma_copy(W[N + bx * bn:N + (bx + 1) * bn, k * bk:(k + 1) * bk], Wg_s[s, :, :], barrier=full[s],
                       cluster_mask=mask)
        T.barrier_arrive(full[s])

    @T.macro
    def produce(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, by, bx, it):
        # one tile's k-steps; `it` counts the tiles this block has done before (persistent), so the ring's
        # slot and parity run on across tiles. Ping-pong: the first consumer's k-steps, then the second's
        if pingpong:
            for h in T.unroll(2):
                for k in T.serial(k_iters):
                    load(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, by, bx, k, (it * 2 + h) * k_iters + k, h)
        else:
            for k in T.serial(k_iters):
                load(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, by, bx, k, it * k_iters + k, 0)

    epilogue = _epi.macro(T, cfg, epi_bias, act, rope_cols, geglu, DT, epi)

    row_sums, apply_ln = _lnf.macros(T, ln, N, K, M, bm, bn, bk, geglu, bias, eps, EPI_BARRIER) if ln else (None,) * 2

    @T.macro
    def consume(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos, Sin, SA, SB,
                Cs, X, St_s, st, by, bx, it, grp, lane, wid):
        if rope_cols:
            if bx * bn < rope_cols:
                # this tile's cosines and sines (one pair per row and frequency, shared by its heads), loaded before
                # the main loop so their latency hides behind it rather than stalling each head's rotation
                for i, d in T.Parallel(hm, 32):
                    p = Pos[T.min(by * bm + grp * hm + i, M - 1)]   # rows past M are never stored
                    Cs_l[i, d] = Cos[p, d]
                    Sn_l[i, d] = Sin[p, d]
        if stagger:
            if grp == 1:
                if it == 0:   # the first consumer is `stagger` k-steps into this block's first tile
                    T.mbarrier_wait_parity(go[0], 0)
        if fold:
            st[0][0] = T.float32(0)
            st[0][1] = T.float32(0)
        if pingpong:
            # a ring slot's full barrier completes k_iters / S times for the other consumer's half between two of
            # this one's: a parity wait alone could pass on the other's phase, so the consumers wait their turn
            if grp == 0:
                if it > 0:
                    T.mbarrier_wait_parity(go[0], (it - 1) & 1)
            else:
                T.mbarrier_wait_parity(go[1], it & 1)
        g0 = (it * PPN + grp * PPG) * k_iters   # this consumer's first ring position
        for k in T.serial(k_iters):
            g = g0 + k
            s = g % S
            T.mbarrier_wait_parity(full[s], (g // S) & 1)
            if pingpong:
                if k == k_iters - 1:
                    if lane == 0:
                        T.mbarrier_arrive(go[1 - grp])
            if geglu and not joint:
                # C_l takes the GELU half, Cx_l the gate half
                T.wgmma_gemm(Ag_s[s, :, :], W_s[s, :, :], C_l, transpose_B=True, clear_accum=(k == 0))
                T.wgmma_gemm(Ag_s[s, :, :], Wg_s[s, :, :], Cx_l, transpose_B=True, clear_accum=(k == 0))
            else:
                T.wgmma_gemm(Ag_s[s, :, :], W_s[s, :, :], C_l, transpose_B=True, clear_accum=(k == 0))
            if fold:   # under the wgmma batch, which reads the same stage
                row_sums(Ag_s, st[0], s, k, wid, st[1])
            if inflight:
                if k > 0:
                    # the batch of step k-1 is done (this step's stays in flight): its stage can be refilled
                    T.wait_wgmma(2 if geglu and not joint else 1)
                    if lane == 0:
                        release(empty, (g + S - 1) % S)
            else:
                T.wait_wgmma(0)
                if lane == 0:
                    release(empty, s)
            if stagger:
                if grp == 0:
                    if it == 0:
                        if k == stagger - 1:
                            if lane == 0:
                                T.mbarrier_arrive(go[0])
        if inflight:
            T.wait_wgmma(0)
            if lane == 0:
                release(empty, (g0 + k_iters - 1) % S)
        T.warpgroup_fence_operand(C_l, num_regs=acc_regs)
        if geglu and not joint:
            T.warpgroup_fence_operand(Cx_l, num_regs=acc_regs)
        if joint:
            # the gate half into a fragment of its own: a parallel loop must index a fragment one way only, and
            # column j + bn sits in the thread that holds column j, so this is a renaming of registers
            for i, j in T.Parallel(hm, bn):
                Cx_l[i, j] = C_l[i, bn + j]
        if fp8:
            # dequantise: row scale x column scale (clamped indices: rows past M and columns past N are never
            # stored, and their scales must not be read out of bounds)
            for i, j in T.Parallel(hm, bn):
                C_l[i, j] = C_l[i, j] * SA[T.min(by * bm + grp * hm + i, M - 1)] * SB[T.min(bx * bn + j, N - 1)]
            if geglu:
                # halves rounded to C's dtype before the GeGLU, as torch._scaled_mm's Wi product is (one GeGLU)
                for i, j in T.Parallel(hm, bn):
                    C_l[i, j] = T.Cast(F32, T.Cast(DT, C_l[i, j]))
                for i, j in T.Parallel(hm, bn):
                    Cx_l[i, j] = T.Cast(F32, T.Cast(DT, Cx_l[i, j] * SA[T.min(by * bm + grp * hm + i, M - 1)] *
                                                    SB[N + T.min(bx * bn + j, N - 1)]))
        if fold or resid:   # bools: a str condition makes TileLang warn at every build
            apply_ln(Bias, C_l, Cx_l, Cs, X, St_s, st[0], by, bx, grp, wid)
        epilogue(C, Bias, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, by, bx, grp)

    @T.macro
    def consumer(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos, Sin, SA, SB,
                 Cs, X, St_s, st, ids, grp, lane, wid):
        T.set_max_nreg(CONSUMER_REGS, 1)
        if P:
            for w in T.serial(n_waves):
                t = w * (P // CL) + ids // CL
                if t < n_tiles:
                    consume(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos,
                            Sin, SA, SB, Cs, X, St_s, st, t // nbn * CL + ids % CL, t % nbn, w, grp, lane, wid)
        else:
            consume(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos, Sin,
                    SA, SB, Cs, X, St_s, st, ids[1], ids[0], 0, grp, lane, wid)
        T.tma_store_wait(0)   # the staging tile (shared memory) must outlive the last store's reads

    @T.macro
    def body(A, W, Bias, C, Pos, Cos, Sin, SA, SB, Cs, X):
        grid = (P,) if P else (nbn, T.ceildiv(M, bm))
        # (cluster_dims=1: no cluster, an ordinary launch)
        with T.ClusterKernel(*grid, cluster_dims=CL, threads=PRODUCER_THREADS + 256) as ids:
            A0_s = T.alloc_shared((S, hm, bk), AB)
            A1_s = T.alloc_shared((S, hm, bk), AB)
            W_s = T.alloc_shared((S, 2 * bn if joint else bn, bk), AB)
            Wg_s = T.alloc_shared((S, bn, bk), AB) if geglu and not joint else None
            if epi == "alias":
                # a (hm, bn) view of the ring would need its own layout, and TileLang keys layouts by the
                # storage ("Get different layout for A0_s"): the epilogue writes the ring's slabs instead
                C0_s, C1_s = A0_s, A1_s
            elif epi == "full":
                C0_s = T.alloc_shared((hm, bn), DT)
                C1_s = T.alloc_shared((hm, bn), DT)
            else:
                C0_s = T.alloc_shared((2, hm, EPI_COLS), DT)
                C1_s = T.alloc_shared((2, hm, EPI_COLS), DT)
            C0_l = T.alloc_fragment((hm, 2 * bn if joint else bn), F32)
            C1_l = T.alloc_fragment((hm, 2 * bn if joint else bn), F32)
            C0x_l = T.alloc_fragment((hm, bn), F32) if geglu else None
            C1x_l = T.alloc_fragment((hm, bn), F32) if geglu else None
            cs = [T.alloc_fragment((hm, 32), F32) for _ in range(4)] if rope_cols else [None] * 4
            xr = [T.alloc_fragment((hm, 32), F32) for _ in range(2)] if rope_cols and cfg.rope_regs else [None] * 2
            full = T.alloc_barrier([PRODUCER_THREADS] * S)
            # with clusters: every consumer warp of both blocks frees a stage in both
            empty = T.alloc_cluster_barrier([warps * 2] * S) if CL > 1 else T.alloc_barrier([warps] * S)
            # stagger: the first consumer's 4 warps release the second; ping-pong: go[c] is consumer c's turn, given
            # by the other's 4 warps once they have waited for their half's last k-step
            go = T.alloc_barrier([CONSUMER_WARPS // 2] * (2 if pingpong else 1)) if stagger or pingpong else None
            St_s = T.alloc_shared((2, hm, 2), F32) if fold else None   # each row's mean and rstd
            # each consumer's (sums and shift, a 16-byte load of A)
            st = [(T.alloc_local((3,), F32), T.alloc_local((8,), AB)) for _ in range(2)] if fold else [(None, None)] * 2
            ring = (A0_s, A1_s, W_s) + ((Wg_s,) if Wg_s is not None else ())
            layouts = {b: tilelang.layout.make_swizzled_layout(b) for b in ring}
            if epi != "alias":
                layouts.update({b: tilelang.layout.make_swizzled_layout(b) for b in (C0_s, C1_s)})
            T.annotate_layout(layouts)
            enter()
            tx = T.get_thread_binding()
            lane = tx % 32
            if tx < PRODUCER_THREADS:
                T.set_max_nreg(PRODUCER_REGS, 0)
                if P:
                    for w in T.serial(n_waves):
                        t = w * (P // CL) + ids // CL
                        if t < n_tiles:
                            produce(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, t // nbn * CL + ids % CL, t % nbn, w)
                else:
                    produce(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, ids[1], ids[0], 0)
            elif tx < PRODUCER_THREADS + 128:
                consumer(C, Bias, A0_s, W_s, Wg_s, C0_l, C0x_l, C0_s, cs[0], cs[1], xr[0], full, empty, go, Pos, Cos,
                         Sin, SA, SB, Cs, X, St_s, st[0], ids, 0, lane, tx % 128)
            else:
                consumer(C, Bias, A1_s, W_s, Wg_s, C1_l, C1x_l, C1_s, cs[2], cs[3], xr[1], full, empty, go, Pos, Cos,
                         Sin, SA, SB, Cs, X, St_s, st[1], ids, 1, lane, tx % 128)
            if CL > 1:
                # neither block exits while the other may still arrive on its barriers
                T.cluster_sync()

    if fp8:
        if geglu:
            @T.prim_func
            def main_geglu8(A: T.Tensor((M, K), AB), Wi: T.Tensor((NW, K), AB), C: T.Tensor((M, N), DT),
                            SA: T.Tensor((M,), F32), SB: T.Tensor((NW,), F32)):
                body(A, Wi, None, C, None, None, None, SA, SB, None, None)
            return main_geglu8

        if rope_cols:
            @T.prim_func
            def main_rope8(A: T.Tensor((M, K), AB), W: T.Tensor((N, K), AB), Bias: T.Tensor((N,), F32),
                           C: T.Tensor((M, N), DT), Pos: T.Tensor((M,), I32), Cos: T.Tensor((Pn, 32), F32),
                           Sin: T.Tensor((Pn, 32), F32), SA: T.Tensor((M,), F32), SB: T.Tensor((N,), F32)):
                body(A, W, Bias, C, Pos, Cos, Sin, SA, SB, None, None)
            return main_rope8

        @T.prim_func
        def main8(A: T.Tensor((M, K), AB), W: T.Tensor((N, K), AB), Bias: T.Tensor((N,), F32),
                  C: T.Tensor((M, N), DT), SA: T.Tensor((M,), F32), SB: T.Tensor((N,), F32)):
            body(A, W, Bias, C, None, None, None, SA, SB, None, None)
        return main8

    if fold:
        if geglu:
            @T.prim_func
            def main_geglu_fold(A: T.Tensor((M, K), DT), Wi: T.Tensor((NW, K), DT), Cs: T.Tensor((NW,), F32),
                                C: T.Tensor((M, N), DT)):
                body(A, Wi, None, C, None, None, None, None, None, Cs, None)
            return main_geglu_fold

        if rope_cols:
            @T.prim_func
            def main_rope_fold(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
                               Cs: T.Tensor((N,), F32), C: T.Tensor((M, N), DT), Pos: T.Tensor((M,), I32),
                               Cos: T.Tensor((Pn, 32), F32), Sin: T.Tensor((Pn, 32), F32)):
                body(A, W, Bias, C, Pos, Cos, Sin, None, None, Cs, None)
            return main_rope_fold

        @T.prim_func
        def main_fold(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
                      Cs: T.Tensor((N,), F32), C: T.Tensor((M, N), DT)):
            body(A, W, Bias, C, None, None, None, None, None, Cs, None)
        return main_fold

    if resid:
        @T.prim_func
        def main_res(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
                     X: T.Tensor((M, N), F32), C: T.Tensor((M, N), DT)):
            body(A, W, Bias, C, None, None, None, None, None, None, X)
        return main_res

    if geglu:
        @T.prim_func
        def main_geglu(A: T.Tensor((M, K), DT), Wi: T.Tensor((NW, K), DT), C: T.Tensor((M, N), DT)):
            body(A, Wi, None, C, None, None, None, None, None, None, None)
        return main_geglu

    if rope_cols:
        @T.prim_func
        def main_rope(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
                      C: T.Tensor((M, N), DT), Pos: T.Tensor((M,), I32),
                      Cos: T.Tensor((Pn, 32), F32), Sin: T.Tensor((Pn, 32), F32)):
            body(A, W, Bias, C, Pos, Cos, Sin, None, None, None, None)
        return main_rope

    @T.prim_func
    def main(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
             C: T.Tensor((M, N), DT)):
        body(A, W, Bias, C, None, None, None, None, None, None, None)

    return main


def pass_configs() -> dict:
    """TileLang pass configs: no automatic warp specialisation (it would re-split the roles), no automatic
    thread-sync insertion (a __syncthreads in one role's branch would deadlock; every sync here is explicit)."""
    return {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True}


def gemm_manual_kernel(N: int, K: int, cfg: GemmWSConfig = GemmWSConfig(), bias: bool = False, act: str = "none",
                       rope_cols: int = 0, geglu: bool = False, dtype: torch.dtype = torch.bfloat16,
                       fp8: bool = False, ln: str = "", eps: float = 1e-5):
    """The compiled hand-warp-specialised GEMM for (N, K, cfg, bias, act, RoPE columns, GeGLU, dtype, e4m3
    operands, LayerNorm form and its eps), built once per process."""
    d = _tl.dt(dtype)
    extra = {} if d == _tl.BF16 else {"i": d}
    if fp8:
        extra["f8"] = 1
    if bias:
        extra["b"] = 1
    if act != "none":
        extra["a"] = act
    if rope_cols:
        extra["r"] = rope_cols
    if ln:   # the fold's eps is in its code; the residual form has none
        extra.update({"ln": ln[0]}, **({"e": "%g" % eps} if ln == "fold" else {}))
    name = _tl.kernel_name("lf_geglu_ws" if geglu else "lf_gemmws", n=N, k=K, c=cfg.tag(), **extra)
    key = ("gemm_manual", N, K, cfg, bias, act, rope_cols, geglu, d) + (("f8",) if fp8 else ()) + \
        ((ln, float(eps) if ln == "fold" else 0.0) if ln else ())
    return _tl.memo(key, lambda: _tl.compile_func(
        lambda: build_gemm_manual(N, K, cfg, bias, act, rope_cols, geglu, d, fp8, ln, eps), name,
        pass_configs=pass_configs()))



__all__ = ["GemmWSConfig", "GEMM", "GEGLU", "GEMM8", "GEGLU8", "CLUSTER_MIN_N", "build_gemm_manual",
           "gemm_manual_kernel", "check_config"]
