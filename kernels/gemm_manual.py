"""Hopper GEMMs with hand-written warp specialisation: C[M,N] = act(A[M,K] @ W[N,K]^T + bias) (16-bit in/out,
fp32 accumulation), optionally with Wqkv's RoPE in the epilogue, or ModernBERT's GeGLU (two accumulators from one A
tile). What the forward (kernels/forward.py) runs on sm_90a for more than gemm.SMALL_M rows (`pick`;
LAYA_FLEET_MANUAL_GEMM=0 goes back to kernels/gemm.py and kernels/geglu.py).

Why by hand: TileLang's automatic warp specialisation (kernels/gemm.py) waits for every wgmma batch with
`warpgroup_wait<0>` before it releases the shared-memory stage, refuses delayed waits ("AutoWarpSpecialization
skipped: gemm with wg_wait != 0"), and its persistent form (T.Persistent) did not overlap a tile's epilogue with the
next tile's loads on the H200. Here, CUTLASS's "warp-specialised cooperative" schedule is written out:

* warpgroup 0 (threads 0-127) is the producer: `setmaxnreg` down to `PRODUCER_REGS`, and for each k-step it
  waits for the stage's `empty` mbarrier, then issues the TMA loads of A (two halves, one per consumer) and W
  (both halves of Wi for GeGLU) into that stage and arrives on its `full` mbarrier (expect_tx accounts the bytes);
* warpgroups 1 and 2 are consumers, `setmaxnreg` up to `CONSUMER_REGS`, each owning bm/2 rows x bn columns of
  the tile in an fp32 fragment (two for GeGLU). Each k-step: wait `full[s]`, issue the async wgmma batch for stage
  s, then (inflight=1) `wgmma.wait_group 1` (the PREVIOUS batch only) and release the previous stage's `empty`
  barrier, or (inflight=0) wait for this batch and release its stage at once;
* epilogue per consumer: bias / activation / GELU x gate on the fragment, fragment -> 16-bit shared tile -> TMA
  store (it clips rows >= M and columns >= N at the tensor bound, and TMA loads zero-fill past M and K, so any
  runtime M works). The RoPE form rotates each Q/K head from its rounded value with fp32 math (as kernels/rope.py
  does to the stored output), in registers before staging (`rope_regs`, the default: a head's columns d and d + 32
  sit in one thread) or in the staged tile; each tile's cosines and sines are loaded into registers before its main
  loop (0.722 -> 0.691 ms at 65536 rows, eleventh session; in registers 0.650 against 0.672, twelfth).
  GeGLU's default `joint` form loads both halves' W tiles into one 2 * bn-row stage tile and runs one n=256 wgmma a
  k-step (GELU half in accumulator columns < bn, gate half above; paired in registers).

`persistent > 0` launches that many blocks (one per SM; `pick` uses the device's SM count) that walk the output
tiles in row-major tile order (tile t -> row block t // nbn, column block t % nbn, so a wave shares W in L2); the
stage ring runs on across tiles, so the producer loads the next tile while the consumers run this tile's epilogue.
Its staging tile cannot share memory with the ring (the producer is already filling it): a whole 16-bit tile fits
beside a 3-stage 128x256x64 ring (and beside GeGLU's 4-stage 128x128x64 one); with a 4-stage 128x256x64 ring the
output goes out 64 columns (one head) at a time through a double buffer.

Non-persistent, the C staging tile of consumer g aliases that consumer's A half-ring (`stages * bk == bn`,
e.g. 128x256x64 with 4 stages): once the consumer has waited for its last batch, every load into its A
half-ring has landed and been read, so the memory is free. (`GemmWSConfig.epilogue` picks the variant.)

2-CTA clusters (`cluster=2`, the default since the thirteenth session for GeGLU and the products of at least
`CLUSTER_MIN_N` columns; `pick` runs the N = 1024 ones in one block): the persistent blocks run in pairs on an SM
pair, each pair on two adjacent row blocks of one column block, in step. The first block of a pair issues each W
tile's TMA load once, multicast into both blocks' shared memory (each block's own `full` barrier counts the bytes);
a stage is refilled only after the consumer warps of both blocks have released it, so `empty` is a cluster barrier
that every consumer warp arrives on in both blocks; the blocks meet at a cluster barrier before either exits. The
weight traffic from L2 halves (a 128 x 256 x 64 stage reads 16 KiB of A and 16 of W a block instead of 16 and 32):
Wqkv + RoPE 0.644 -> 0.625 ms, GeGLU 1.174 -> 1.150 ms at 65536 rows on the H200, the same bits; Wo and MLP Wo
(N = 1024, small W tiles that stay in L2) ran 1-6% slower in clusters in three calls of four.

Tried and dropped (thirteenth session): the epilogue on the producer warpgroup's three idle warps, the consumers
handing a 16-bit tile over through shared memory in two halves and going on to the next tile's products. Three warps
cannot keep up with 16384 exact erfs a tile: GeGLU took 1.72 ms against 1.21, Wqkv + RoPE 0.89 against 0.65 (the
plain products were within 2%). A fourth warpgroup is not an option: ptxas allocates every thread the launch bound's
registers (65536 / 512 = 128) whatever `setmaxnreg` grants later, too few for a 128-register accumulator.

Compiled with TileLang's automatic warp specialisation, pipelining and thread-sync insertion off (the
synchronisation is all explicit: mbarriers between roles, named barriers inside a consumer warpgroup).

Measured on the H200 (bench/gemm_manual_probe.py, 5 runs, every output bitwise equal to torch.matmul's; then
bench/fast_path.py, eleventh session): the persistent 128x256x64 4-stage kernel runs 680-750 TF/s at M = 65536 and
15360, 14-24% above the auto-WS GEMM at K = 1024 and 5-10% above at K = 2624 / 4096, at or above torch.matmul;
the GeGLU form 584-604 TF/s against 543-550 for the auto-WS one. The non-persistent kernel is within 2% of the auto-WS
one: the gain is the persistence (epilogue and next tile's loads overlapped, no per-tile launch and pipeline fill),
not the delayed wait: inflight=0 measured the same or 1-3% faster, since with two consumer warpgroups one's wgmma
keeps the tensor pipe busy while the other waits, and the delayed release holds one stage longer. bk=32 with 8
stages, and 256x128 tiles, were slower.
"""

import os
from dataclasses import dataclass, replace

import torch

from . import _tl

PRODUCER_REGS = 40
CONSUMER_REGS = 232
EPI_BARRIER = 8          # named barriers EPI_BARRIER + g (g = 0, 1): one per consumer warpgroup's epilogue
PRODUCER_THREADS = 128
CONSUMER_WARPS = 8       # the empty barriers count one arrival per consumer warp (its lane 0)
EPI_COLS = 64            # columns per store of the "chunk" epilogue (one 128-byte swizzle atom of bf16)
SMEM_LIMIT = 227 * 1024  # per block on the H100 / H200


@dataclass(frozen=True)
class GemmWSConfig:
    """Tile and schedule of the hand-warp-specialised GEMM: a bm x bn tile split by rows over two consumer
    warpgroups, bk-deep k-steps, a `stages`-deep shared-memory ring; persistent > 0: that many blocks walk the
    tiles (the number of SMs, 132 on the H200)."""

    bm: int = 128
    bn: int = 256
    bk: int = 64
    stages: int = 4
    persistent: int = 0
    # wgmma batches a consumer keeps in flight across k-steps: 1 (the design: wait for the previous batch,
    # release its stage) or 0 (wait for this step's batch and release its stage at once, as TileLang's
    # automatic warp specialisation does: the tensor pipe drains, but the producer may run one stage further
    # ahead). An experiment knob, to tell the two effects apart.
    inflight: int = 1
    # GeGLU only: both halves' bn-row W tiles sit in one 2*bn-row stage tile, so each k-step is ONE wgmma of
    # 2*bn columns into one accumulator (GELU half in columns < bn, gate half above) instead of two of bn
    # columns: A is read from shared memory once per k-step, not twice. Column j and j + bn of a wgmma
    # accumulator sit in the same thread (the fragment repeats every 8 columns), so the epilogue pairs them
    # in registers.
    joint: bool = False
    # stagger > 0: the second consumer starts its first tile only once the first has issued that many k-steps
    # (an mbarrier), so the two run that far apart from then on (the shared ring, `stages` deep, bounds the gap):
    # one consumer's epilogue (GELU, RoPE, the stores) overlaps the other's products instead of both idling the
    # tensor cores at once
    stagger: int = 0
    # RoPE form only: rotate each Q/K head in registers before it is staged (column d and d + 32 of a head sit in
    # the same thread, as GeGLU's halves do), instead of in the staged shared tile behind one more barrier; the same
    # arithmetic (from the 16-bit rounded value, fp32 math)
    rope_regs: bool = False
    # Persistent only: cluster = 2 launches blocks in pairs (a 2-CTA cluster, one per SM pair) that run adjacent
    # row blocks of the same column block in step: each W tile is loaded once and multicast into both blocks' shared
    # memory (TMA multicast), halving the weight traffic from L2; a stage is refilled only once both blocks' consumers
    # have released it (the empty barriers are cluster barriers that both blocks' consumer warps arrive on)
    cluster: int = 1

    def tag(self) -> str:
        """A short text form, e.g. 128x256x64s4 (p132: persistent over 132 blocks; w0: inflight=0; j: joint; gN:
        stagger N; q: RoPE in registers; c2: 2-CTA clusters with the W tiles multicast)."""
        return "%dx%dx%ds%d%s%s%s%s%s%s" % (self.bm, self.bn, self.bk, self.stages,
                                            "p%d" % self.persistent if self.persistent else "",
                                            "" if self.inflight else "w0", "j" if self.joint else "",
                                            "g%d" % self.stagger if self.stagger else "", "q" if self.rope_regs else "",
                                            "c%d" % self.cluster if self.cluster > 1 else "")

    def epilogue(self, wt: int = 1) -> str:
        """How the consumers stage their output for the TMA store: "alias" (non-persistent, stages * bk == bn:
        onto their own A half-ring, free once their last wgmma batch is done), "full" (a bf16 bm x bn tile of
        its own) or "chunk" (a double-buffered bm x EPI_COLS tile, stored EPI_COLS columns at a time: what a
        persistent 4-stage 128x256x64 ring leaves room for)."""
        if not self.persistent and self.stages * self.bk == self.bn:
            return "alias"
        if self._ring_bytes(wt) + self.bm * self.bn * 2 <= SMEM_LIMIT - 1024:
            return "full"
        return "chunk"

    def _ring_bytes(self, wt: int = 1) -> int:
        return self.stages * (self.bm + wt * self.bn) * self.bk * 2

    def smem_bytes(self, wt: int = 1) -> int:
        """Dynamic shared memory: the ring (wt weight tiles a stage: 2 for GeGLU) and the staging tiles (16-bit);
        the mbarriers are static."""
        epi = self.epilogue(wt)
        return self._ring_bytes(wt) + {"alias": 0, "full": self.bm * self.bn * 2,
                                     "chunk": 2 * self.bm * EPI_COLS * 2}[epi]




def check_config(cfg: GemmWSConfig, wt: int = 1) -> None:
    """Raise ValueError for a config this kernel cannot build (wt weight tiles a stage: 2 for GeGLU)."""
    if cfg.bm not in (128, 256):
        raise ValueError("bm must be 128 or 256 (two consumer warpgroups of 64 or 128 rows)")
    if cfg.bn % 16 or cfg.bn > 256 or cfg.bk % 16 or cfg.bk * 2 > 128:
        raise ValueError("bn must be a multiple of 16 up to 256 and bk a multiple of 16 up to 64 (one 128-byte "
                         "swizzle atom per row)")
    if cfg.stages < 2:
        raise ValueError("stages must be at least 2")
    if cfg.inflight not in (0, 1):
        raise ValueError("inflight must be 0 or 1")
    if not 0 <= cfg.stagger < cfg.stages:
        raise ValueError("stagger must be 0 or more and below stages (the ring bounds how far apart the consumers "
                         "run)")
    if cfg.bn % EPI_COLS and cfg.epilogue(wt) == "chunk":
        raise ValueError("a chunked epilogue needs bn to be a multiple of %d" % EPI_COLS)
    if cfg.smem_bytes(wt) > SMEM_LIMIT - 1024:
        raise ValueError("%s needs %d bytes of shared memory (the H200 has %d)" % (cfg.tag(), cfg.smem_bytes(wt),
                                                                                 SMEM_LIMIT))
    if wt == 2 and cfg.bm // 2 * cfg.bn * 2 // 128 > 128:
        raise ValueError("GeGLU keeps two accumulators: at most 128 fp32 registers a consumer thread for them")
    if cfg.joint and (wt != 2 or cfg.bn > 128):
        raise ValueError("joint is GeGLU's one-wgmma form: GeGLU only, bn at most 128 (2 * bn wgmma columns)")
    if cfg.cluster not in (1, 2):
        raise ValueError("cluster must be 1 or 2")
    if cfg.cluster > 1 and (not cfg.persistent or cfg.persistent % 2 or cfg.stagger):
        raise ValueError("2-CTA clusters need a persistent kernel over an even number of blocks and no stagger")


def build_gemm_manual(N: int, K: int, cfg: GemmWSConfig = GemmWSConfig(), bias: bool = False, act: str = "none",
                      rope_cols: int = 0, geglu: bool = False, dtype: str = "bfloat16"):
    """The TileLang PrimFunc main(A[M,K], W[N,K], Bias[N] f32, C[M,N]) (A, W, C `dtype`: bfloat16 or float16), M
    dynamic; C = act(A @ W^T + Bias) with the bias read only when `bias`.

    rope_cols > 0 (Wqkv): main(A, W, Bias, C, Pos[M] i32, Cos[P,32] f32, Sin[P,32] f32), and every 64-column head
    below rope_cols is rotated in the epilogue from its staged (rounded) value with fp32 math, as kernels/rope.py
    does to the stored output. geglu (ModernBERT's Wi): main(A, Wi[2N,K], C[M,N]) with C = gelu(A @ Wi[:N]^T) *
    (A @ Wi[N:]^T): one A tile feeds two accumulators (cfg.bn columns of each half), as kernels/geglu.py."""
    from .gemm import ACTS, apply_act

    wt = 2 if geglu else 1
    check_config(cfg, wt)
    if act not in ACTS:
        raise ValueError("act must be one of %s, got %r" % (ACTS, act))
    if rope_cols and (rope_cols % EPI_COLS or act != "none" or geglu or cfg.epilogue(wt) != "chunk"):
        raise ValueError("a RoPE epilogue needs rope_cols a multiple of 64, no activation and a chunked epilogue")
    if geglu and (bias or act != "none"):
        raise ValueError("the GeGLU form takes no bias or activation")
    tilelang, T = _tl.tl()
    bm, bn, bk, S = cfg.bm, cfg.bn, cfg.bk, cfg.stages
    hm = bm // 2                          # rows per consumer warpgroup
    DT, F32, I32 = dtype, _tl.F32, _tl.I32
    M = T.dynamic("M")
    Pn = T.dynamic("P")
    nbn = T.ceildiv(N, bn)
    k_iters = T.ceildiv(K, bk)
    acc_regs = hm * bn // 128             # fp32 accumulator registers per consumer thread (per accumulator)
    epi = cfg.epilogue(wt)
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

    @T.macro
    def release(empty, s):
        # a consumer warp frees stage s: with clusters, in both blocks (the multicast refills both at once)
        if CL == 2:
            T.mbarrier_arrive(empty[s], 0)
            T.mbarrier_arrive(empty[s], 1)
        else:
            T.mbarrier_arrive(empty[s])

    @T.macro
    def produce(A, W, A0_s, A1_s, W_s, Wg_s, full, empty, by, bx, it):
        # one tile's k-steps; `it` counts the tiles this block has done before (persistent), so the ring's
        # slot and parity run on across tiles
        for k in T.serial(k_iters):
            g = it * k_iters + k
            s = g % S
            T.mbarrier_wait_parity(empty[s], ((g // S) & 1) ^ 1)
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
    def epilogue(C, Bias, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, by, bx, grp):
        r0 = by * bm + grp * hm
        if epi == "chunk":
            # EPI_COLS columns at a time through a double buffer (each store is its own bulk group): before a
            # buffer is rewritten, the store from it two chunks ago must have read it (wait until at most one
            # group, the other buffer's, is pending; only the issuing thread has groups)
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

    @T.macro
    def consume(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos, Sin, by, bx,
                it, grp, lane):
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
        for k in T.serial(k_iters):
            g = it * k_iters + k
            s = g % S
            T.mbarrier_wait_parity(full[s], (g // S) & 1)
            if geglu and not joint:
                # C_l takes the GELU half, Cx_l the gate half
                T.wgmma_gemm(Ag_s[s, :, :], W_s[s, :, :], C_l, transpose_B=True, clear_accum=(k == 0))
                T.wgmma_gemm(Ag_s[s, :, :], Wg_s[s, :, :], Cx_l, transpose_B=True, clear_accum=(k == 0))
            else:
                T.wgmma_gemm(Ag_s[s, :, :], W_s[s, :, :], C_l, transpose_B=True, clear_accum=(k == 0))
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
                release(empty, (it * k_iters + k_iters - 1) % S)
        T.warpgroup_fence_operand(C_l, num_regs=acc_regs)
        if geglu and not joint:
            T.warpgroup_fence_operand(Cx_l, num_regs=acc_regs)
        if joint:
            # the gate half into a fragment of its own: a parallel loop must index a fragment one way only, and
            # column j + bn sits in the thread that holds column j, so this is a renaming of registers
            for i, j in T.Parallel(hm, bn):
                Cx_l[i, j] = C_l[i, bn + j]
        epilogue(C, Bias, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, by, bx, grp)

    @T.macro
    def consumer(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos, Sin, ids,
                 grp, lane):
        T.set_max_nreg(CONSUMER_REGS, 1)
        if P:
            for w in T.serial(n_waves):
                t = w * (P // CL) + ids // CL
                if t < n_tiles:
                    consume(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos,
                            Sin, t // nbn * CL + ids % CL, t % nbn, w, grp, lane)
        else:
            consume(C, Bias, Ag_s, W_s, Wg_s, C_l, Cx_l, Cg_s, Cs_l, Sn_l, Xr_l, full, empty, go, Pos, Cos, Sin,
                    ids[1], ids[0], 0, grp, lane)
        T.tma_store_wait(0)   # the staging tile (shared memory) must outlive the last store's reads

    @T.macro
    def body(A, W, Bias, C, Pos, Cos, Sin):
        grid = (P,) if P else (nbn, T.ceildiv(M, bm))
        # (cluster_dims=1: no cluster, an ordinary launch)
        with T.ClusterKernel(*grid, cluster_dims=CL, threads=PRODUCER_THREADS + 256) as ids:
            A0_s = T.alloc_shared((S, hm, bk), DT)
            A1_s = T.alloc_shared((S, hm, bk), DT)
            W_s = T.alloc_shared((S, 2 * bn if joint else bn, bk), DT)
            Wg_s = T.alloc_shared((S, bn, bk), DT) if geglu and not joint else None
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
            empty = T.alloc_cluster_barrier([CONSUMER_WARPS * 2] * S) if CL > 1 else \
                T.alloc_barrier([CONSUMER_WARPS] * S)
            go = T.alloc_barrier([CONSUMER_WARPS // 2]) if stagger else None   # the first consumer's 4 warps
            ring = (A0_s, A1_s, W_s) + ((Wg_s,) if Wg_s is not None else ())
            layouts = {b: tilelang.layout.make_swizzled_layout(b) for b in ring}
            if epi != "alias":
                layouts.update({b: tilelang.layout.make_swizzled_layout(b) for b in (C0_s, C1_s)})
            T.annotate_layout(layouts)
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
                         Sin, ids, 0, lane)
            else:
                consumer(C, Bias, A1_s, W_s, Wg_s, C1_l, C1x_l, C1_s, cs[2], cs[3], xr[1], full, empty, go, Pos, Cos,
                         Sin, ids, 1, lane)
            if CL > 1:
                # neither block exits while the other may still arrive on its barriers
                T.cluster_sync()

    if geglu:
        @T.prim_func
        def main_geglu(A: T.Tensor((M, K), DT), Wi: T.Tensor((NW, K), DT), C: T.Tensor((M, N), DT)):
            body(A, Wi, None, C, None, None, None)
        return main_geglu

    if rope_cols:
        @T.prim_func
        def main_rope(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
                      C: T.Tensor((M, N), DT), Pos: T.Tensor((M,), I32),
                      Cos: T.Tensor((Pn, 32), F32), Sin: T.Tensor((Pn, 32), F32)):
            body(A, W, Bias, C, Pos, Cos, Sin)
        return main_rope

    @T.prim_func
    def main(A: T.Tensor((M, K), DT), W: T.Tensor((N, K), DT), Bias: T.Tensor((N,), F32),
             C: T.Tensor((M, N), DT)):
        body(A, W, Bias, C, None, None, None)

    return main


def pass_configs() -> dict:
    """TileLang pass configs: no automatic warp specialisation (it would re-split the roles), no automatic
    thread-sync insertion (a __syncthreads in one role's branch would deadlock; every sync here is explicit)."""
    return {"tl.disable_warp_specialized": True, "tl.disable_thread_storage_sync": True}


def gemm_manual_kernel(N: int, K: int, cfg: GemmWSConfig = GemmWSConfig(), bias: bool = False, act: str = "none",
                       rope_cols: int = 0, geglu: bool = False, dtype: torch.dtype = torch.bfloat16):
    """The compiled hand-warp-specialised GEMM for (N, K, cfg, bias, act, RoPE columns, GeGLU, dtype), built once
    per process."""
    d = _tl.dt(dtype)
    extra = {} if d == _tl.BF16 else {"i": d}
    if bias:
        extra["b"] = 1
    if act != "none":
        extra["a"] = act
    if rope_cols:
        extra["r"] = rope_cols
    name = _tl.kernel_name("lf_geglu_ws" if geglu else "lf_gemmws", n=N, k=K, c=cfg.tag(), **extra)
    return _tl.memo(("gemm_manual", N, K, cfg, bias, act, rope_cols, geglu, d),
                    lambda: _tl.compile_func(lambda: build_gemm_manual(N, K, cfg, bias, act, rope_cols, geglu, d),
                                             name, pass_configs=pass_configs()))


# What the forward uses for more than gemm.SMALL_M tokens on Hopper (one persistent block per SM, in 2-CTA clusters
# that share each W tile through TMA multicast): 128 x 256 x 64 tiles, 4 stages, output 64 columns at a time, Wqkv's
# RoPE in registers; GeGLU 128 x 128 (of each half) x 64, 4 stages, one joint n=256 product, a whole staged tile;
# both wait for each k-step's batch (inflight=0: as fast or 1-3% faster than one batch in flight on the H200).
# Twelfth session (H200, bench/fast_path.py): Wqkv + RoPE 0.650 ms in registers against 0.672 through shared memory;
# GeGLU joint 590-617 TF/s against 573-602 for two n=128 products. Thirteenth: the clusters took Wqkv + RoPE from
# 0.644 to 0.625 ms and GeGLU from 1.174 to 1.150 ms, and the offline forward from 649k to 660k tokens/s (the
# N = 1024 products run in one block: CLUSTER_MIN_N). Staggered consumers measured -2% to +3% per shape across two
# runs: an alternative only.
GEMM = GemmWSConfig(bm=128, bn=256, bk=64, stages=4, persistent=132, inflight=0, rope_regs=True, cluster=2)
GEGLU = GemmWSConfig(bm=128, bn=128, bk=64, stages=4, persistent=132, inflight=0, joint=True, cluster=2)
# Other configs bench/fast_path.py times beside the defaults (keyed by geglu) and runs when faster
ALTERNATIVES: dict[bool, tuple[GemmWSConfig, ...]] = {
    False: (replace(GEMM, cluster=1), replace(GEMM, cluster=1, stagger=3)),
    True: (replace(GEGLU, cluster=1),),
}
# The clusters pay where the W tiles stream from L2 for every block: GeGLU and the wide plain products (Wqkv and the
# head's in_proj, N = 3072; its FFN1, 4096). For the N = 1024 products (Wo, MLP Wo, the head's FFN2) the one-block
# kernel measured 1-6% faster in three calls of four and equal in the fourth (thirteenth session), so `pick` runs
# those without clusters.
CLUSTER_MIN_N = 2048
# Measured winners that `pick` prefers to the default: per product ((geglu, N, K) -> config), else per form (geglu ->
# config); bench/fast_path.py fills it in the process it benchmarks, as kernels/gemm.py's TUNED
TUNED: dict = {}


def enabled() -> bool:
    """Whether the forward uses these kernels: on Hopper (sm_90a) unless LAYA_FLEET_MANUAL_GEMM=0."""
    return os.environ.get("LAYA_FLEET_MANUAL_GEMM", "1") != "0" and _tl.is_hopper()


def sm_count() -> int:
    """Streaming multiprocessors of the current CUDA device (132 on the H100 / H200 SXM; that without a GPU)."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    return 132


def pick(M: int, N: int, in_dtype: torch.dtype, out_dtype: torch.dtype, geglu: bool = False,
         K: int | None = None) -> GemmWSConfig | None:
    """The config the forward runs an M-row product of N output columns (K deep) with, or None for the other kernels
    (few rows: gemm.SMALL tiles; an fp32 output or N < 64: the scorer's last layer; not Hopper; switched off)."""
    from .gemm import SMALL_M

    if M <= SMALL_M or N < 64 or in_dtype != out_dtype or not enabled():
        return None
    base = TUNED.get((geglu, N, K)) or TUNED.get(geglu)
    if base is None:
        base = GEGLU if geglu else GEMM if N >= CLUSTER_MIN_N else replace(GEMM, cluster=1)
    n = sm_count()
    if base.cluster > 1 and n % base.cluster:   # every block of a persistent cluster launch has its pair
        base = replace(base, cluster=1)
    return base if base.persistent == n else replace(base, persistent=n)


__all__ = ["GemmWSConfig", "GEMM", "GEGLU", "ALTERNATIVES", "TUNED", "CLUSTER_MIN_N", "build_gemm_manual",
           "gemm_manual_kernel", "check_config", "enabled", "sm_count", "pick"]
