"""Tiles and schedule of kernels/gemm_manual.py's hand-warp-specialised GEMM: `GemmWSConfig`, the rules a config
must meet (`check_config`), how its output is staged and how much shared memory it takes, and the shipped
defaults. Pure Python: nothing here imports TileLang."""

from dataclasses import dataclass

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
    inflight: int = 1       # wgmma batches kept in flight across k-steps: 1 (release the previous stage) or 0
    joint: bool = False     # GeGLU: both halves' W tiles in one stage tile, one 2*bn-column wgmma a k-step
    stagger: int = 0        # k-steps the second consumer starts behind the first, so their epilogues alternate
    rope_regs: bool = False  # RoPE form: rotate each Q/K head in registers before staging, not in shared memory
    cluster: int = 1        # persistent: 2 = blocks in 2-CTA pairs sharing each W tile by TMA multicast
    pingpong: bool = False  # persistent: the consumers take a tile's two row halves in turn (one's epilogue under
                            # the other's products); W is loaded once a half

    def tag(self) -> str:
        """A short text form, e.g. 128x256x64s4 (p132: persistent over 132 blocks; w0: inflight=0; j: joint; gN:
        stagger N; q: RoPE in registers; c2: 2-CTA clusters with the W tiles multicast; pp: ping-pong)."""
        return "%dx%dx%ds%d%s%s%s%s%s%s%s" % (self.bm, self.bn, self.bk, self.stages,
                                            "p%d" % self.persistent if self.persistent else "",
                                            "" if self.inflight else "w0", "j" if self.joint else "",
                                            "g%d" % self.stagger if self.stagger else "", "q" if self.rope_regs else "",
                                            "c%d" % self.cluster if self.cluster > 1 else "",
                                            "pp" if self.pingpong else "")

    def epilogue(self, wt: int = 1, ab: int = 2) -> str:
        """How the consumers stage their output for the TMA store: "alias" (non-persistent, stages * bk == bn,
        16-bit operands: onto their own A half-ring, free once their last wgmma batch is done), "full" (a bf16
        bm x bn tile of its own) or "chunk" (a double-buffered bm x EPI_COLS tile, stored EPI_COLS columns at a
        time: what a persistent 4-stage 128x256x64 ring leaves room for). ab: bytes an operand element (1: e4m3)."""
        if not self.persistent and self.stages * self.bk == self.bn and ab == 2:
            return "alias"
        if self._ring_bytes(wt, ab) + self.bm * self.bn * 2 <= SMEM_LIMIT - 1024:
            return "full"
        return "chunk"

    def _ring_bytes(self, wt: int = 1, ab: int = 2) -> int:
        return self.stages * (self.bm + wt * self.bn) * self.bk * ab

    def smem_bytes(self, wt: int = 1, ab: int = 2) -> int:
        """Dynamic shared memory: the ring (wt weight tiles a stage: 2 for GeGLU; ab bytes an element) and the
        staging tiles (16-bit); the mbarriers are static."""
        epi = self.epilogue(wt, ab)
        return self._ring_bytes(wt, ab) + {"alias": 0, "full": self.bm * self.bn * 2,
                                         "chunk": 2 * self.bm * EPI_COLS * 2}[epi]


def check_config(cfg: GemmWSConfig, wt: int = 1, ab: int = 2) -> None:
    """Raise ValueError for a config this kernel cannot build (wt weight tiles a stage: 2 for GeGLU; ab bytes an
    operand element: 2, or 1 for e4m3)."""
    if cfg.bm not in (128, 256):
        raise ValueError("bm must be 128 or 256 (two consumer warpgroups of 64 or 128 rows)")
    if cfg.bn % 16 or cfg.bn > 256 or cfg.bk % (32 // ab) or cfg.bk * ab > 128:
        raise ValueError("bn must be a multiple of 16 up to 256 and bk a multiple of %d up to %d (one 128-byte "
                         "swizzle atom per row)" % (32 // ab, 128 // ab))
    if cfg.stages < 2:
        raise ValueError("stages must be at least 2")
    if cfg.inflight not in (0, 1):
        raise ValueError("inflight must be 0 or 1")
    if not 0 <= cfg.stagger < cfg.stages:
        raise ValueError("stagger must be 0 or more and below stages (the ring bounds how far apart the consumers "
                         "run)")
    if cfg.bn % EPI_COLS and cfg.epilogue(wt, ab) == "chunk":
        raise ValueError("a chunked epilogue needs bn to be a multiple of %d" % EPI_COLS)
    if cfg.smem_bytes(wt, ab) > SMEM_LIMIT - 1024:
        raise ValueError("%s needs %d bytes of shared memory (the H200 has %d)" % (
            cfg.tag(), cfg.smem_bytes(wt, ab), SMEM_LIMIT))
    if wt == 2 and cfg.bm // 2 * cfg.bn * 2 // 128 > 128:
        raise ValueError("GeGLU keeps two accumulators: at most 128 fp32 registers a consumer thread for them")
    if cfg.joint and (wt != 2 or cfg.bn > 128):
        raise ValueError("joint is GeGLU's one-wgmma form: GeGLU only, bn at most 128 (2 * bn wgmma columns)")
    if cfg.cluster not in (1, 2):
        raise ValueError("cluster must be 1 or 2")
    if cfg.cluster > 1 and (not cfg.persistent or cfg.persistent % 2 or cfg.stagger):
        raise ValueError("2-CTA clusters need a persistent kernel over an even number of blocks and no stagger")
    if cfg.pingpong and (not cfg.persistent or cfg.stagger or not cfg.inflight):
        raise ValueError("ping-pong needs a persistent kernel, no stagger and inflight=1 (one consumer at a time "
                         "keeps the tensor cores busy only with a batch in flight)")


# The defaults for more than gemm.SMALL_M rows on Hopper: persistent 2-CTA clusters, Wqkv's RoPE in registers,
# GeGLU as one joint n=256 product (see BENCHMARKS.md, "GPU fast path")
GEMM = GemmWSConfig(bm=128, bn=256, bk=64, stages=4, persistent=132, inflight=0, rope_regs=True, cluster=2)
GEGLU = GemmWSConfig(bm=128, bn=128, bk=64, stages=4, persistent=132, inflight=0, joint=True, cluster=2)
# Clusters pay where W streams from L2 for every block (GeGLU, N >= 2048); narrower products run one block a tile
CLUSTER_MIN_N = 2048
# e4m3 operands: the same tiles with 128-byte (128-element) k-steps; the GEMM's ring then leaves room for the
# chunked epilogue only (which Wqkv's RoPE needs), the GeGLU's for a full staging tile, as in bf16
GEMM8 = GemmWSConfig(bm=128, bn=256, bk=128, stages=4, persistent=132, inflight=0, rope_regs=True, cluster=2)
GEGLU8 = GemmWSConfig(bm=128, bn=128, bk=128, stages=4, persistent=132, inflight=0, joint=True, cluster=2)


__all__ = ["GemmWSConfig", "GEMM", "GEGLU", "GEMM8", "GEGLU8", "CLUSTER_MIN_N", "check_config", "PRODUCER_REGS",
           "CONSUMER_REGS", "EPI_BARRIER", "PRODUCER_THREADS", "CONSUMER_WARPS", "EPI_COLS", "SMEM_LIMIT"]
