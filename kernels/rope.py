"""RoPE applied in place to the Q and K heads of a packed QKV buffer, with per-token positions.

QKV is [M, 3 * H * 64] laid out Q | K | V, head-major inside each (ModernBERT's Wqkv output). Token r
sits at position Pos[r] inside its own row, so packed rows of different lengths rotate correctly.
The per-layer theta lives in the Cos/Sin tables ([P, 32] fp32, one pair per theta), built once on
the host: NeoX / rotate-half style, x'[d] = x[d] cos - x[d+32] sin, x'[d+32] = x[d+32] cos + x[d] sin.
"""

from dataclasses import dataclass

import torch

from . import _tl

HEAD_DIM = 64
HALF = HEAD_DIM // 2


@dataclass(frozen=True)
class RopeConfig:
    """Tokens per block and threads per block."""

    bm: int = 8
    threads: int = 256

    def tag(self) -> str:
        """A short text form, e.g. 8r256t."""
        return "%dr%dt" % (self.bm, self.threads)


def rope_tables(theta: float, max_pos: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_pos, 32] fp32, for inv_freq = theta^(-2i/64) as transformers builds it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().contiguous().to(device), freqs.sin().contiguous().to(device)


def rope_tables_from_inv_freq(inv_freq: torch.Tensor, max_pos: int, scaling: float = 1.0,
                              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_pos, 32] fp32 from an encoder's own inv_freq buffer and attention scaling."""
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq.float().cpu()[None, :]
    return ((freqs.cos() * scaling).contiguous().to(device), (freqs.sin() * scaling).contiguous().to(device))


def rope_ref(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Reference: a rotated copy of qkv (fp32 math, rounded to qkv's dtype); V is left unchanged."""
    M = qkv.shape[0]
    x = qkv.float().view(M, 3, heads, HEAD_DIM).clone()
    c = cos[pos.long()][:, None, None, :]
    s = sin[pos.long()][:, None, None, :]
    qk = x[:, :2]
    x0, x1 = qk[..., :HALF].clone(), qk[..., HALF:].clone()
    qk[..., :HALF] = x0 * c - x1 * s
    qk[..., HALF:] = x1 * c + x0 * s
    x[:, :2] = qk
    return x.view(M, -1).to(qkv.dtype)


def build_rope(heads: int, cfg: RopeConfig = RopeConfig(), dtype: str = "bfloat16"):
    """The TileLang PrimFunc main(QKV[M, 3*H*64] dtype, Pos[M] i32, Cos[P,32] f32, Sin[P,32] f32), in place."""
    _, T = _tl.tl()
    enter = _tl.pdl_enter()
    bm = cfg.bm
    M = T.dynamic("M")
    P = T.dynamic("P")
    W = 3 * heads * HEAD_DIM
    pairs = 2 * heads * HALF
    DT, F32, I32 = dtype, _tl.F32, _tl.I32

    @T.prim_func
    def main(QKV: T.Tensor((M, W), DT), Pos: T.Tensor((M,), I32), Cos: T.Tensor((P, HALF), F32),
             Sin: T.Tensor((P, HALF), F32)):
        with T.Kernel(T.ceildiv(M, bm), threads=cfg.threads) as bx:
            enter()
            for i, c in T.Parallel(bm, pairs):
                r = bx * bm + i
                if r < M:
                    p = Pos[r]
                    d = c % HALF
                    c0 = (c // HALF) * HEAD_DIM + d
                    x0 = T.Cast(F32, QKV[r, c0])
                    x1 = T.Cast(F32, QKV[r, c0 + HALF])
                    cs = Cos[p, d]
                    sn = Sin[p, d]
                    QKV[r, c0] = T.Cast(DT, x0 * cs - x1 * sn)
                    QKV[r, c0 + HALF] = T.Cast(DT, x1 * cs + x0 * sn)

    return main


def rope_kernel(heads: int, cfg: RopeConfig = RopeConfig(), dtype: torch.dtype = torch.bfloat16):
    """The compiled in-place RoPE kernel for `heads` heads of 64 on a `dtype` buffer, built once per process."""
    d = _tl.dt(dtype)
    extra = {} if d == _tl.BF16 else {"i": d}  # bf16 kernels keep their names (and cache entries)
    name = _tl.kernel_name("lf_rope", h=heads, c=cfg.tag(), **extra)
    return _tl.memo(("rope", heads, cfg, d), lambda: _tl.compile_func(lambda: build_rope(heads, cfg, d), name))


def rope(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate Q and K of a CUDA qkv buffer in place; returns qkv."""
    rope_kernel(heads, dtype=qkv.dtype)(qkv, pos, cos, sin)
    return qkv


__all__ = ["RopeConfig", "HEAD_DIM", "rope_tables", "rope_tables_from_inv_freq", "rope_ref", "build_rope",
           "rope_kernel", "rope"]
