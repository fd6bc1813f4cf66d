"""GEMM + GeGLU, ModernBERT's MLP up-projection: C[M,F] = gelu(A @ Wi[:F]^T) * (A @ Wi[F:]^T).

Wi is the `mlp.Wi` weight [2F, K]: its first F rows feed the exact-erf GELU, its last F rows the gate
(`input, gate = Wi(x).chunk(2, -1)`). One A tile feeds two accumulators, so the [M, 2F] intermediate
never reaches memory. F need not be a multiple of the tile (2624 = 41 x 64): the tail tile's extra
columns read rows of the other half or past the end (zero-filled) and are never stored.
"""


from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _tl
from .gemm import SMALL_M, apply_act


@dataclass(frozen=True)
class GegluConfig:
    """Tile shape and schedule of the GeGLU kernel (block_N counts output columns)."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    stages: int = 3
    threads: int = 256
    full_row: bool = True
    persistent: int = 0   # > 0: that many blocks loop over the tiles (see gemm.GemmConfig.persistent)
    ws: bool = True       # False: no producer warpgroup (see gemm.GemmConfig.ws)

    def tag(self) -> str:
        """A short text form, e.g. 128x128x64s3t256r (p132: persistent over 132 blocks; n: not warp-specialised)."""
        pol = "r" if self.full_row else "q"
        pers = "p%d" % self.persistent if self.persistent else ""
        return "%dx%dx%ds%dt%d%s%s%s" % (self.bm, self.bn, self.bk, self.stages, self.threads, pol, pers,
                                         "" if self.ws else "n")


SMALL = GegluConfig(bm=64, bn=64, bk=128, stages=3, threads=128)
LARGE = GegluConfig(bm=128, bn=128, bk=64, stages=4, threads=256)   # the sweep winner: BENCHMARKS.md


def default_config(M: int) -> GegluConfig:
    """The untuned tile config of an M-row GeGLU: SMALL for few rows, else LARGE (kernels/tuning.py's
    `pick_geglu` prefers a measured winner)."""
    return SMALL if M <= SMALL_M else LARGE


def geglu_ref(a: torch.Tensor, wi: torch.Tensor) -> torch.Tensor:
    """Reference: gelu(a @ wi[:F].T) * (a @ wi[F:].T) in fp32, returned as a's dtype."""
    y = a.float() @ wi.float().t()
    x, gate = y.chunk(2, -1)
    return (F.gelu(x) * gate).to(a.dtype)


def build_geglu(Fd: int, K: int, cfg: GegluConfig = LARGE, dtype: str = "bfloat16"):
    """The TileLang PrimFunc main(A[M,K], Wi[2F,K], C[M,F]), all `dtype` (bfloat16 or float16)."""
    if cfg.bn % 16 or cfg.bk % 16:
        raise ValueError("block_N and block_K must be multiples of 16")
    _, T = _tl.tl()
    enter = _tl.pdl_enter()
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    M = T.dynamic("M")
    policy = T.GemmWarpPolicy.FullRow if cfg.full_row else T.GemmWarpPolicy.Square
    DT, F32 = dtype, _tl.F32

    @T.macro
    def tile(A, Wi, C, A_s, Wx_s, Wg_s, Cx, Cg, C_s, bx, by):
        T.clear(Cx)
        T.clear(Cg)
        for k in T.Pipelined(T.ceildiv(K, bk), num_stages=cfg.stages):
            T.copy(A[by * bm, k * bk], A_s)
            T.copy(Wi[bx * bn, k * bk], Wx_s)
            T.copy(Wi[Fd + bx * bn, k * bk], Wg_s)
            T.gemm(A_s, Wx_s, Cx, transpose_B=True, policy=policy)
            T.gemm(A_s, Wg_s, Cg, transpose_B=True, policy=policy)
        for i, j in T.Parallel(bm, bn):
            Cx[i, j] = apply_act(Cx[i, j], "gelu", T) * Cg[i, j]
        T.copy(Cx, C_s)
        T.copy(C_s, C[by * bm, bx * bn])

    @T.prim_func
    def main(A: T.Tensor((M, K), DT), Wi: T.Tensor((2 * Fd, K), DT), C: T.Tensor((M, Fd), DT)):
        # one block per output tile, or cfg.persistent blocks walking the tiles (T.Persistent)
        grid = (cfg.persistent,) if cfg.persistent else (T.ceildiv(Fd, bn), T.ceildiv(M, bm))
        with T.Kernel(*grid, threads=cfg.threads) as ids:
            A_s = T.alloc_shared((bm, bk), DT)
            Wx_s = T.alloc_shared((bn, bk), DT)
            Wg_s = T.alloc_shared((bn, bk), DT)
            Cx = T.alloc_fragment((bm, bn), F32)
            Cg = T.alloc_fragment((bm, bn), F32)
            C_s = T.alloc_shared((bm, bn), DT)
            enter()
            if cfg.persistent:
                for by, bx in T.Persistent([T.ceildiv(M, bm), T.ceildiv(Fd, bn)], cfg.persistent, ids):
                    tile(A, Wi, C, A_s, Wx_s, Wg_s, Cx, Cg, C_s, bx, by)
            else:
                tile(A, Wi, C, A_s, Wx_s, Wg_s, Cx, Cg, C_s, ids[0], ids[1])

    return main


def geglu_kernel(Fd: int, K: int, cfg: GegluConfig = LARGE, dtype: torch.dtype = torch.bfloat16):
    """The compiled GeGLU kernel for (F, K, cfg, dtype), built once per process."""
    d = _tl.dt(dtype)
    extra = {} if d == _tl.BF16 else {"i": d}  # bf16 kernels keep their names (and cache entries)
    name = _tl.kernel_name("lf_geglu", f=Fd, k=K, c=cfg.tag(), **extra)
    return _tl.memo(("geglu", Fd, K, cfg, d), lambda: _tl.compile_func(lambda: build_geglu(Fd, K, cfg, d), name,
                                                           pass_configs=_tl.ws_pass_configs(cfg.ws)))


def geglu(a: torch.Tensor, wi: torch.Tensor, out: torch.Tensor | None = None,
          cfg: GegluConfig | None = None) -> torch.Tensor:
    """Run the TileLang GeGLU on CUDA tensors; returns `out` (allocated when None)."""
    M, K = a.shape
    Fd = wi.shape[0] // 2
    cfg = cfg or default_config(M)
    if out is None:
        out = torch.empty(M, Fd, dtype=a.dtype, device=a.device)
    geglu_kernel(Fd, K, cfg, a.dtype)(a, wi, out)
    return out


__all__ = ["GegluConfig", "SMALL", "LARGE", "default_config", "geglu_ref", "build_geglu", "geglu_kernel", "geglu"]
