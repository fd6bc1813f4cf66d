"""Flash attention over packed variable-length rows, reading the packed QKV buffer directly.

QKV is [Ttok, 3 * H * 64] (Q | K | V, head-major) for every token of every row back to back, with no
padding between rows; Cu[R + 1] holds the rows' start offsets (cu_seqlens). The grid walks a host-built
tile table, Tiles[NT, 2] = (row, first query position of a block_M tile), so no block is spent on a
row's missing tail; padding entries point at an empty row (Cu[row] == Cu[row + 1]) and do nothing.
Keys are masked by the row's length and, on local layers, by |i - j| <= window (positions within the
row); window = 0 means full attention (global layers and the decision head). Scale is 1/sqrt(64).
O is [Ttok, H * 64]; only real query rows are written.
"""

from dataclasses import dataclass

import numpy as np
import torch

from . import _tl

HEAD_DIM = 64
LOG2E = 1.4426950408889634
NEG = -1.0e30


@dataclass(frozen=True)
class AttnConfig:
    """Query/key tile sizes, pipeline depth and threads."""

    bm: int = 64
    bn: int = 64
    stages: int = 1
    threads: int = 128
    guard: bool = False   # load the Q tile only for tiles that hold queries: padding tiles run no key block
    ws: bool = True       # TileLang's automatic warp specialisation; False lets several blocks share an SM
    lean: bool = False    # masks only on edge key blocks, the softmax scale folded into the exponent
    occupancy: int = 0    # > 0: ask ptxas for that many blocks an SM (__launch_bounds__), capping registers
    overlap: bool = False  # FA3-style: block j's QK^T and softmax overlap block j-1's PV (build_attention_overlap)
    hp: int = 1           # overlapped: heads a block walks in turn, the next head's loads issued under this one's

    def tag(self) -> str:
        """A short text form, e.g. 64x64s1t128 (g suffix when guarded, n when not warp-specialised, l lean, oN
        occupancy N, v overlapped, hN N heads a block)."""
        return "%dx%ds%dt%d%s%s%s%s%s%s" % (self.bm, self.bn, self.stages, self.threads, "g" if self.guard else "",
                                            "" if self.ws else "n", "l" if self.lean else "",
                                            "o%d" % self.occupancy if self.occupancy else "",
                                            "v" if self.overlap else "", "h%d" % self.hp if self.hp > 1 else "")


UNGUARDED = AttnConfig()
WARP_SPECIALISED = AttnConfig(stages=2, guard=True)
UNSPECIALISED = AttnConfig(guard=True, ws=False)
LEAN = AttnConfig(guard=True, ws=False, lean=True)
OVERLAP = AttnConfig(guard=True, ws=False, lean=True, overlap=True)
# the fastest correct kernel of the sweep (bench/fastpath_sweep.py; see BENCHMARKS.md, "GPU fast path")
DEFAULT = OVERLAP


def tile_table(lengths, bm: int, capacity: int | None = None, empty_row: int | None = None) -> np.ndarray:
    """(row, q0) pairs covering every row in block_M steps, int32 [n, 2]; padded to `capacity` with
    (empty_row, 0) entries (empty_row must index a zero-length row of Cu)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = (lengths + bm - 1) // bm
    n = int(counts.sum())
    rows = np.repeat(np.arange(len(lengths), dtype=np.int32), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    q0 = ((np.arange(n) - first) * bm).astype(np.int32)
    cap = n if capacity is None else capacity
    if cap < n:
        raise ValueError("tile table needs %d entries, capacity is %d" % (n, cap))
    out = np.empty((cap, 2), dtype=np.int32)
    out[:n, 0] = rows
    out[:n, 1] = q0
    out[n:, 0] = len(lengths) if empty_row is None else empty_row
    out[n:, 1] = 0
    return out


def attention_ref(qkv: torch.Tensor, cu: torch.Tensor, heads: int, window: int = 0) -> torch.Tensor:
    """Reference: per-row dense softmax attention in fp32 with the same masks; returns [Ttok, H*64].

    Tokens outside every row are returned as zeros."""
    Ttok = qkv.shape[0]
    x = qkv.float().view(Ttok, 3, heads, HEAD_DIM)
    out = torch.zeros(Ttok, heads * HEAD_DIM, dtype=torch.float32, device=qkv.device)
    cu_l = [int(v) for v in cu.tolist()]
    for s, e in zip(cu_l[:-1], cu_l[1:]):
        if e <= s:
            continue
        q, k, v = (x[s:e, i].transpose(0, 1) for i in range(3))  # [H, L, 64]
        sc = (q @ k.transpose(1, 2)) * HEAD_DIM ** -0.5
        if window > 0:
            p = torch.arange(e - s, device=qkv.device)
            sc = sc.masked_fill((p[:, None] - p[None, :]).abs() > window, float("-inf"))
        o = torch.softmax(sc, -1) @ v
        out[s:e] = o.transpose(0, 1).reshape(e - s, -1)
    return out.to(qkv.dtype)


def attention_dense(qkv: torch.Tensor, tok_row: torch.Tensor, pos: torch.Tensor, heads: int,
                    window: int = 0) -> torch.Tensor:
    """Torch attention over the packed stream with a dense [Ttok, Ttok] mask (same row, and |i-j| <= window
    when window > 0); fp32 math, returned as qkv's dtype. No host sync, so it can be graph-captured.
    Padding tokens share row id -1 and attend among themselves (finite, never read)."""
    Ttok = qkv.shape[0]
    x = qkv.float().view(Ttok, 3, heads, HEAD_DIM)
    q, k, v = (x[:, i].transpose(0, 1) for i in range(3))  # [H, T, 64]
    keep = tok_row[:, None] == tok_row[None, :]
    if window > 0:
        keep = keep & ((pos[:, None] - pos[None, :]).abs() <= window)
    o = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=keep[None, None])
    return o[0].transpose(0, 1).reshape(Ttok, heads * HEAD_DIM).to(qkv.dtype)


def _block_steps(T, window: int, bm: int, bn: int, scale: float, lean: bool):
    """Two per-key-block steps as TileLang macros, shared by the kernels: `mask(s, kb, q0, L)` (the lean kernels':
    raw scores, only a block crossing the row's end or the window's edge is masked, a block-uniform test) and
    `online(s, m, m_prev, sc, ms, rs, lsum)` (scores -> probabilities relative to the new running max, sc the old
    max's correction, lsum updated; lean: raw scores and max, the scale folded into the exponent's FFMA)."""

    @T.macro
    def mask(s, kb, q0, L):
        edge = kb * bn + bn > L
        if window > 0:
            edge = edge | (kb * bn + bn - 1 - q0 > window) | (q0 + bm - 1 - kb * bn > window)
            if edge:
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.if_then_else((kb * bn + j < L) & (q0 + i - kb * bn - j <= window)
                                             & (kb * bn + j - q0 - i <= window), s[i, j], NEG)
        else:
            if edge:
                for i, j in T.Parallel(bm, bn):
                    s[i, j] = T.if_then_else(kb * bn + j < L, s[i, j], NEG)

    @T.macro
    def online(s, m, m_prev, sc, ms, rs, lsum):
        T.copy(m, m_prev)
        T.reduce_max(s, m, dim=1, clear=False)
        if lean:
            # m is in raw units: the scale multiplies both terms of the exponent (a masked score, -1e30 * c, still
            # underflows to 0 once the row has met a real key)
            for i in T.Parallel(bm):
                sc[i] = T.exp2((m_prev[i] - m[i]) * scale)
                ms[i] = m[i] * scale
            for i, j in T.Parallel(bm, bn):
                s[i, j] = T.exp2(s[i, j] * scale - ms[i])
        else:
            for i in T.Parallel(bm):
                sc[i] = T.exp2(m_prev[i] - m[i])
            for i, j in T.Parallel(bm, bn):
                s[i, j] = T.exp2(s[i, j] - m[i])
        T.reduce_sum(s, rs, dim=1)
        for i in T.Parallel(bm):
            lsum[i] = lsum[i] * sc[i] + rs[i]

    return mask, online


def build_attention(heads: int, window: int = 0, cfg: AttnConfig = DEFAULT, dtype: str = "bfloat16"):
    """The PrimFunc main(QKV[Ttok,3H*64] dtype, Cu[NC] i32, Tiles[NT,2] i32, O[Ttok,H*64] dtype); dtype bfloat16
    or float16 (the probabilities enter the second product in it too)."""
    if cfg.overlap:
        return build_attention_overlap(heads, window, cfg, dtype)
    if cfg.hp != 1:
        raise ValueError("several heads a block (hp) is a form of the overlapped kernel only; got %s" % cfg.tag())
    _, T = _tl.tl()
    enter = _tl.pdl_enter()
    bm, bn = cfg.bm, cfg.bn
    Ttok = T.dynamic("Ttok")
    NC = T.dynamic("NC")
    NT = T.dynamic("NT")
    D = HEAD_DIM
    HD = heads * D
    scale = D ** -0.5 * LOG2E
    DT, F32, I32 = dtype, _tl.F32, _tl.I32
    mask, online = _block_steps(T, window, bm, bn, scale, cfg.lean)

    @T.prim_func
    def main(QKV: T.Tensor((Ttok, 3 * HD), DT), Cu: T.Tensor((NC,), I32), Tiles: T.Tensor((NT, 2), I32),
             Out: T.Tensor((Ttok, HD), DT)):
        with T.Kernel(NT, heads, threads=cfg.threads) as (bt, bh):
            if cfg.occupancy:
                T.annotate_min_blocks_per_sm(cfg.occupancy)
            enter()
            Q_s = T.alloc_shared((bm, D), DT)
            K_s = T.alloc_shared((bn, D), DT)
            V_s = T.alloc_shared((bn, D), DT)
            O_s = T.alloc_shared((bm, D), DT)
            s = T.alloc_fragment((bm, bn), F32)
            s_c = T.alloc_fragment((bm, bn), DT)
            acc = T.alloc_fragment((bm, D), F32)
            m = T.alloc_fragment((bm,), F32)
            m_prev = T.alloc_fragment((bm,), F32)
            sc = T.alloc_fragment((bm,), F32)
            rs = T.alloc_fragment((bm,), F32)
            lsum = T.alloc_fragment((bm,), F32)
            ms = T.alloc_fragment((bm,), F32) if cfg.lean else None

            row = Tiles[bt, 0]
            q0 = Tiles[bt, 1]
            start = Cu[row]
            L = Cu[row + 1] - start

            if cfg.guard:
                if q0 < L:
                    T.copy(QKV[start + q0, bh * D], Q_s)
            else:
                T.copy(QKV[start + q0, bh * D], Q_s)
            T.fill(acc, 0)
            T.fill(lsum, 0)
            T.fill(m, NEG)
            # Unguarded: at least one key block, even for an empty padding tile, because the Q tile's
            # bulk copy is only waited on inside the loop. Guarded: no copy and no key block there.
            lo_min = 0 if cfg.guard else 1
            if window > 0:
                k_lo = T.max(0, q0 - window) // bn
                k_hi = T.max(k_lo + lo_min, T.min(T.ceildiv(L, bn), T.ceildiv(q0 + bm + window, bn)))
            else:
                k_lo = 0
                k_hi = T.max(lo_min, T.ceildiv(L, bn))
            for kb in T.Pipelined(k_lo, k_hi, num_stages=cfg.stages):
                T.copy(QKV[start + kb * bn, HD + bh * D], K_s)
                if cfg.lean:
                    T.gemm(Q_s, K_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    mask(s, kb, q0, L)
                else:
                    T.clear(s)
                    T.gemm(Q_s, K_s, s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                    if window > 0:
                        for i, j in T.Parallel(bm, bn):
                            s[i, j] = T.if_then_else(
                                (kb * bn + j < L) & (q0 + i - kb * bn - j <= window) & (kb * bn + j - q0 - i <= window),
                                s[i, j] * scale, NEG)
                    else:
                        for i, j in T.Parallel(bm, bn):
                            s[i, j] = T.if_then_else(kb * bn + j < L, s[i, j] * scale, NEG)
                T.copy(QKV[start + kb * bn, 2 * HD + bh * D], V_s)
                online(s, m, m_prev, sc, ms, rs, lsum)
                T.copy(s, s_c)
                for i, j in T.Parallel(bm, D):
                    acc[i, j] = acc[i, j] * sc[i]
                T.gemm(s_c, V_s, acc, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(bm, D):
                acc[i, j] = acc[i, j] / T.max(lsum[i], 1e-30)
            T.copy(acc, O_s)
            for i, j in T.Parallel(bm, D):
                if q0 + i < L:
                    Out[start + q0 + i, bh * D + j] = O_s[i, j]

    return main


def check_overlap_config(cfg: AttnConfig) -> None:
    """Raise ValueError for an overlapped config build_attention_overlap cannot build."""
    if not (cfg.bm == cfg.bn == 64 and cfg.threads == 128 and cfg.guard and cfg.lean and not cfg.ws
            and cfg.stages == 1 and cfg.hp >= 1):
        raise ValueError("the overlapped attention is one warpgroup on 64 x 64 tiles, guarded, lean, not "
                         "warp-specialised, stages=1 (its double buffering is its own), hp >= 1 heads a block; got "
                         "%s, hp=%r" % (cfg.tag(), cfg.hp))


def build_attention_overlap(heads: int, window: int = 0, cfg: AttnConfig = OVERLAP, dtype: str = "bfloat16"):
    """build_attention's PrimFunc (same signature and result) with FA3's intra-warpgroup pipelining written out.

    Per key block j (of n): one block-wide sync (every warp is past the products that read the buffers about to be
    refilled), TMA loads of V_j and K_{j+1} into the other halves of two-slot rings (mbarrier each), then QK_j^T
    and P_{j-1} V_{j-1} issued back to back; the wait for the first leaves the second on the tensor cores while
    this block's softmax runs; then the wait for PV, P_j to 16 bits and the accumulator's rescale. Block 0's QK^T
    runs before the loop, the last PV after it. No automatic thread-sync insertion: every sync is explicit.

    cfg.hp > 1: a block takes hp heads of its query tile in turn as one run of hp * n key blocks, so the next
    head's Q (a two-slot ring) and first K / V load under this head's last blocks instead of in a prologue of their
    own; at a head's first block the previous head's last PV is waited for and its output written before the
    softmax state restarts. The last block of heads may hold fewer (heads need not be a multiple of hp)."""
    tilelang, T = _tl.tl()
    enter = _tl.pdl_enter()
    check_overlap_config(cfg)
    bm = bn = 64
    hp = cfg.hp
    multi = hp > 1
    Ttok = T.dynamic("Ttok")
    NC = T.dynamic("NC")
    NT = T.dynamic("NT")
    D = HEAD_DIM
    HD = heads * D
    scale = D ** -0.5 * LOG2E
    DT, F32, I32 = dtype, _tl.F32, _tl.I32
    regs = bm * bn // 128          # fp32 registers a thread holds of a 64 x 64 fragment
    mask, online = _block_steps(T, window, bm, bn, scale, True)

    @T.macro
    def softmax(s, m, m_prev, sc, ms, rs, lsum, kb, q0, L):
        # raw scores in s -> probabilities (fp32, relative to the new running max); sc: the old max's correction
        mask(s, kb, q0, L)
        online(s, m, m_prev, sc, ms, rs, lsum)

    @T.macro
    def load(QKV, buf, slot, bar, bi, j, part, start, k_lo, n, h0):
        # key block j of the run (part 1: K, 2: V) into slot `slot` of its ring: head h0 + j // n when a block
        # walks several heads, block k_lo + j % n of it
        c = part * HD + (h0 + T.truncdiv(j, n) if multi else h0) * D
        r = start + (k_lo + (T.truncmod(j, n) if multi else j)) * bn
        T.tma_copy(QKV[r:r + bn, c:c + D], buf[slot, :, :], barrier=bar[bi])
        T.barrier_arrive(bar[bi])

    @T.macro
    def step(s, s_c, acc, m, m_prev, sc, ms, rs, lsum, kb, q0, L):
        # this block's softmax under the previous block's PV, then P to 16 bits and the accumulator rescaled
        softmax(s, m, m_prev, sc, ms, rs, lsum, kb, q0, L)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc, num_regs=regs)
        T.copy(s, s_c)
        for i, j in T.Parallel(bm, D):
            acc[i, j] = acc[i, j] * sc[i]

    @T.macro
    def finish(Out, acc, lsum, O_s, slot, start, q0, L, h):
        # the head's output: normalise, stage in O_s[slot], then only the tile's real query rows to global memory.
        # Several heads a block stage in the V slot the last PV read, free until the next block's sync: every warp
        # must be past that PV before it is overwritten
        for i, j in T.Parallel(bm, D):
            acc[i, j] = acc[i, j] / T.max(lsum[i], 1e-30)
        if multi:
            T.sync_threads()
            T.copy(acc, O_s[slot, :, :])
            T.sync_threads()
            for i, j in T.Parallel(bm, D):
                if q0 + i < L:
                    Out[start + q0 + i, h * D + j] = O_s[slot, i, j]
            T.fence_proxy_async()   # these generic accesses before the TMA load that refills the slot
        else:
            T.copy(acc, O_s)
            T.sync_threads()
            for i, j in T.Parallel(bm, D):
                if q0 + i < L:
                    Out[start + q0 + i, h * D + j] = O_s[i, j]

    @T.prim_func
    def main(QKV: T.Tensor((Ttok, 3 * HD), DT), Cu: T.Tensor((NC,), I32), Tiles: T.Tensor((NT, 2), I32),
             Out: T.Tensor((Ttok, HD), DT)):
        with T.Kernel(NT, -(-heads // hp), threads=128) as (bt, bg):
            if cfg.occupancy:
                T.annotate_min_blocks_per_sm(cfg.occupancy)
            enter()
            Q_s = T.alloc_shared((2, bm, D) if multi else (bm, D), DT)
            K_s = T.alloc_shared((2, bn, D), DT)
            V_s = T.alloc_shared((2, bn, D), DT)
            O_s = V_s if multi else T.alloc_shared((bm, D), DT)   # so four blocks still fit an SM
            s = T.alloc_fragment((bm, bn), F32)
            s_c = T.alloc_fragment((bm, bn), DT)
            acc = T.alloc_fragment((bm, D), F32)
            m = T.alloc_fragment((bm,), F32)
            m_prev = T.alloc_fragment((bm,), F32)
            sc = T.alloc_fragment((bm,), F32)
            rs = T.alloc_fragment((bm,), F32)
            lsum = T.alloc_fragment((bm,), F32)
            ms = T.alloc_fragment((bm,), F32)
            # Q slot 0; K slots 0, 1; V slots 0, 1; Q slot 1 when a block walks several heads (every thread arrives)
            bar = T.alloc_barrier([128] * (6 if multi else 5))
            T.annotate_layout({b: tilelang.layout.make_swizzled_layout(b) for b in (Q_s, K_s, V_s)})

            row = Tiles[bt, 0]
            q0 = Tiles[bt, 1]
            start = Cu[row]
            L = Cu[row + 1] - start
            h0 = bg * hp
            if window > 0:
                k_lo = T.max(0, q0 - window) // bn
                k_hi = T.min(T.ceildiv(L, bn), T.ceildiv(q0 + bm + window, bn))
            else:
                k_lo = 0
                k_hi = T.ceildiv(L, bn)
            n = k_hi - k_lo
            na = T.min(hp, heads - h0) * n if multi else n    # key blocks of the block's whole run

            if q0 < L:   # a padding tile (or a row's missing tail) does nothing; here n >= 1
                if multi:
                    T.tma_copy(QKV[start + q0:start + q0 + bm, h0 * D:h0 * D + D], Q_s[0, :, :], barrier=bar[0])
                else:
                    T.tma_copy(QKV[start + q0:start + q0 + bm, h0 * D:h0 * D + D], Q_s, barrier=bar[0])
                T.barrier_arrive(bar[0])
                load(QKV, K_s, 0, bar, 1, 0, 1, start, k_lo, n, h0)
                load(QKV, V_s, 0, bar, 3, 0, 2, start, k_lo, n, h0)
                if na > 1:
                    load(QKV, K_s, 1, bar, 2, 1, 1, start, k_lo, n, h0)
                    if multi:
                        if n == 1:   # block 1 starts the second head
                            T.tma_copy(QKV[start + q0:start + q0 + bm, h0 * D + D:h0 * D + 2 * D], Q_s[1, :, :],
                                       barrier=bar[5])
                            T.barrier_arrive(bar[5])
                T.fill(acc, 0)
                T.fill(lsum, 0)
                T.fill(m, NEG)
                T.mbarrier_wait_parity(bar[0], 0)
                T.mbarrier_wait_parity(bar[1], 0)
                if multi:
                    T.wgmma_gemm(Q_s[0, :, :], K_s[0, :, :], s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                 clear_accum=True)
                else:
                    T.wgmma_gemm(Q_s, K_s[0, :, :], s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                 clear_accum=True)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(s, num_regs=regs)
                softmax(s, m, m_prev, sc, ms, rs, lsum, k_lo, q0, L)
                T.copy(s, s_c)
                for it in T.serial(1, na):
                    kb = k_lo + T.truncmod(it, n) if multi else k_lo + it
                    b = it % 2
                    # every warp has waited for the products that read K slot 1 - b (block it - 1's QK^T), V
                    # slot b (block it - 2's PV) and the Q slot about to be refilled (two heads back)
                    T.sync_threads()
                    load(QKV, V_s, b, bar, 3 + b, it, 2, start, k_lo, n, h0)
                    if it + 1 < na:
                        load(QKV, K_s, 1 - b, bar, 2 - b, it + 1, 1, start, k_lo, n, h0)
                        if multi:
                            # the next head's Q, into the slot of the head before this one
                            if T.truncmod(it + 1, n) == 0:
                                hr = T.truncdiv(it + 1, n)
                                T.tma_copy(QKV[start + q0:start + q0 + bm, (h0 + hr) * D:(h0 + hr) * D + D],
                                           Q_s[hr % 2, :, :], barrier=bar[hr % 2 * 5])
                                T.barrier_arrive(bar[hr % 2 * 5])
                    T.mbarrier_wait_parity(bar[1 + b], (it // 2) & 1)
                    if multi:
                        if T.truncmod(it, n) == 0:
                            T.mbarrier_wait_parity(bar[T.truncdiv(it, n) % 2 * 5], (T.truncdiv(it, n) // 2) & 1)
                        T.wgmma_gemm(Q_s[T.truncdiv(it, n) % 2, :, :], K_s[b, :, :], s, transpose_B=True,
                                     policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    else:
                        T.wgmma_gemm(Q_s, K_s[b, :, :], s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow,
                                     clear_accum=True)
                    T.mbarrier_wait_parity(bar[4 - b], ((it - 1) // 2) & 1)
                    T.wgmma_gemm(s_c, V_s[1 - b, :, :], acc, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)               # QK^T done; PV of the previous block still running
                    T.warpgroup_fence_operand(s, num_regs=regs)
                    if multi:
                        if T.truncmod(it, n) == 0:
                            # a new head: the last one's PV done, its output out, the softmax state restarted
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc, num_regs=regs)
                            finish(Out, acc, lsum, O_s, 1 - b, start, q0, L, h0 + T.truncdiv(it, n) - 1)
                            T.fill(acc, 0)
                            T.fill(lsum, 0)
                            T.fill(m, NEG)
                            softmax(s, m, m_prev, sc, ms, rs, lsum, kb, q0, L)
                            T.copy(s, s_c)
                        else:
                            step(s, s_c, acc, m, m_prev, sc, ms, rs, lsum, kb, q0, L)
                    else:
                        step(s, s_c, acc, m, m_prev, sc, ms, rs, lsum, kb, q0, L)
                T.mbarrier_wait_parity(bar[3 + (na - 1) % 2], ((na - 1) // 2) & 1)
                T.wgmma_gemm(s_c, V_s[(na - 1) % 2, :, :], acc, policy=T.GemmWarpPolicy.FullRow)
                T.wait_wgmma(0)
                T.warpgroup_fence_operand(acc, num_regs=regs)
                finish(Out, acc, lsum, O_s, (na - 1) % 2 if multi else 0, start, q0, L,
                       h0 + T.truncdiv(na - 1, n) if multi else h0)

    return main


def attention_kernel(heads: int, window: int = 0, cfg: AttnConfig = DEFAULT, dtype: torch.dtype = torch.bfloat16):
    """The compiled attention kernel for (heads, window, cfg, dtype), built once per process."""
    d = _tl.dt(dtype)
    extra = {} if d == _tl.BF16 else {"i": d}  # bf16 kernels keep their names (and cache entries)
    name = _tl.kernel_name("lf_attn", h=heads, w=window, c=cfg.tag(), **extra)
    return _tl.memo(("attn", heads, window, cfg, d),
                    lambda: _tl.compile_func(lambda: build_attention(heads, window, cfg, d), name, fast_math=True,
                                             pass_configs=_tl.ws_pass_configs(cfg.ws, not cfg.overlap)))


def attention(qkv: torch.Tensor, cu: torch.Tensor, tiles: torch.Tensor, heads: int, window: int = 0,
              out: torch.Tensor | None = None, cfg: AttnConfig = DEFAULT) -> torch.Tensor:
    """Run the packed attention on CUDA tensors; returns `out` (zero-initialised when None)."""
    if out is None:
        out = torch.zeros(qkv.shape[0], heads * HEAD_DIM, dtype=qkv.dtype, device=qkv.device)
    attention_kernel(heads, window, cfg, qkv.dtype)(qkv, cu, tiles, out)
    return out


def attention_flops(lengths, heads: int, window: int = 0) -> float:
    """Useful FLOPs (QK^T and PV) of one attention call over rows of these lengths."""
    total = 0.0
    for n in lengths:
        n = int(n)
        if window > 0:
            i = np.arange(n)
            keys = float((np.minimum(n - 1, i + window) - np.maximum(0, i - window) + 1).sum())
        else:
            keys = float(n * n)
        total += 4.0 * heads * HEAD_DIM * keys
    return total


__all__ = ["AttnConfig", "DEFAULT", "LEAN", "OVERLAP", "UNSPECIALISED", "UNGUARDED", "WARP_SPECIALISED",
           "HEAD_DIM", "tile_table", "attention_ref", "attention_dense", "build_attention", "build_attention_overlap",
           "check_overlap_config", "attention_kernel", "attention", "attention_flops"]
