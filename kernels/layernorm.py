"""Fused residual add + LayerNorm over rows of an fp32 residual stream, with or without a bias.

Modes (X is the fp32 residual stream [M, D], R a bf16 branch output, Y the normalised output):
  "add":         X += R (written back), then Y = LN(X) * w (+ b)
  "plain":       Y = LN(X) * w (+ b)
  "inplace":     X = LN(X) * w (+ b), and Y = X in Y's dtype (the embedding norm, which starts the stream)
  "add_inplace": X = LN(X + R) * w (+ b), and Y = X in Y's dtype (the encoder's final norm)
Y is bf16 (the next GEMM's input) or fp32 (the final norm, which feeds the fp32 head stream). The mean
and variance are two-pass in fp32 registers: var = mean((x - mean)^2), then rsqrt(var + eps).
"""


from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _tl
from .quant import E4M3_MAX, FP8, MIN_AMAX  # one quantisation rule for the norm's e4m3 output and quant.py's

MODES = ("add", "plain", "inplace", "add_inplace")


@dataclass(frozen=True)
class LNConfig:
    """Rows per block and threads per block."""

    bm: int = 4
    threads: int = 128

    def tag(self) -> str:
        """A short text form, e.g. 4r128t."""
        return "%dr%dt" % (self.bm, self.threads)


def default_config(D: int) -> LNConfig:
    """Threads and rows per block for width D. The fragment layout TileLang infers for x[bm, D] splits D over
    the threads (float4 chunks, a power-of-two thread count per row for the all-reduce) only when D / 4 is a
    multiple of the thread count; otherwise every thread holds whole rows (D floats each, spilled to local
    memory, about 100x slower, e.g. at D = 768, mmBERT-base). So: threads = the largest power of two (32..64)
    dividing D / 4, and bm rows so that a thread holds about 32 floats of x (see BENCHMARKS.md, "GPU fast path")."""
    chunks = max(1, D // 4)
    threads = 64
    while threads > 32 and chunks % threads:
        threads //= 2
    bm = 1
    while bm < 8 and (2 * bm) * D <= 32 * threads:
        bm *= 2
    return LNConfig(bm=bm, threads=threads)


def add_ln_ref(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None, eps: float,
               mode: str = "add", out_dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: returns (new X fp32, Y in out_dtype) without touching the inputs."""
    x = x.float()
    if mode in ("add", "add_inplace"):
        x = x + r.float()
    y = F.layer_norm(x, (x.shape[-1],), w.float(), None if b is None else b.float(), eps)
    if mode in ("inplace", "add_inplace"):
        x = y
    return x, y.to(out_dtype)


def build_add_ln(D: int, mode: str = "add", bias: bool = False, eps: float = 1e-5, out_dtype: str = "bfloat16",
                 cfg: LNConfig | None = None, r_dtype: str = "bfloat16"):
    """The TileLang PrimFunc main(X[M,D] f32, R[M,D] r_dtype, W[D] f32, B[D] f32, Y[M,D] out_dtype);
    cfg None = default_config(D). out_dtype float8_e4m3fn (the FP8 precision's GEMM input) adds S[M] f32 last: each
    row of Y is quantised by its own scale S[i] = max|y_i| / 448 (kernels/quant.py's rule) from the fp32 value."""
    if mode not in MODES:
        raise ValueError("mode must be one of %s, got %r" % (MODES, mode))
    cfg = cfg or default_config(D)
    _, T = _tl.tl()
    enter = _tl.pdl_enter()
    bm = cfg.bm
    M = T.dynamic("M")
    RD, F32 = r_dtype, _tl.F32
    inv_d = 1.0 / D
    residual = mode in ("add", "add_inplace")
    to_x = mode in ("inplace", "add_inplace")
    fp8 = out_dtype == FP8

    @T.macro
    def body(X, R, Wt, Bs, Y, S):
        with T.Kernel(T.ceildiv(M, bm), threads=cfg.threads) as bx:
            x = T.alloc_fragment((bm, D), F32)
            t = T.alloc_fragment((bm, D), F32)
            mean = T.alloc_fragment((bm,), F32)
            var = T.alloc_fragment((bm,), F32)
            enter()
            T.copy(X[bx * bm, 0], x)
            if residual:
                T.copy(R[bx * bm, 0], t)
                for i, j in T.Parallel(bm, D):
                    x[i, j] = x[i, j] + t[i, j]
                if not to_x:
                    T.copy(x, X[bx * bm, 0])
            T.reduce_sum(x, mean, dim=1)
            for i in T.Parallel(bm):
                mean[i] = mean[i] * inv_d
            for i, j in T.Parallel(bm, D):
                t[i, j] = (x[i, j] - mean[i]) * (x[i, j] - mean[i])
            T.reduce_sum(t, var, dim=1)
            for i in T.Parallel(bm):
                var[i] = T.rsqrt(var[i] * inv_d + eps)
            if bias:
                for i, j in T.Parallel(bm, D):
                    t[i, j] = (x[i, j] - mean[i]) * var[i] * Wt[j] + Bs[j]
            else:
                for i, j in T.Parallel(bm, D):
                    t[i, j] = (x[i, j] - mean[i]) * var[i] * Wt[j]
            if to_x:
                T.copy(t, X[bx * bm, 0])
            if fp8:
                q = T.alloc_fragment((bm, D), FP8)
                T.reduce_absmax(t, mean, dim=1)   # mean is free now: the row's absolute maximum, then its scale
                for i in T.Parallel(bm):
                    mean[i] = T.max(mean[i], MIN_AMAX) / E4M3_MAX
                for i, j in T.Parallel(bm, D):
                    t[i, j] = T.clamp(t[i, j] / mean[i], -E4M3_MAX, E4M3_MAX)
                T.copy(t, q)
                T.copy(q, Y[bx * bm, 0])
                for i in T.Parallel(bm):
                    S[bx * bm + i] = mean[i]
            else:
                T.copy(t, Y[bx * bm, 0])

    if fp8:
        @T.prim_func
        def main8(X: T.Tensor((M, D), F32), R: T.Tensor((M, D), RD), Wt: T.Tensor((D,), F32), Bs: T.Tensor((D,), F32),
                  Y: T.Tensor((M, D), out_dtype), S: T.Tensor((M,), F32)):
            body(X, R, Wt, Bs, Y, S)
        return main8

    @T.prim_func
    def main(X: T.Tensor((M, D), F32), R: T.Tensor((M, D), RD), Wt: T.Tensor((D,), F32), Bs: T.Tensor((D,), F32),
             Y: T.Tensor((M, D), out_dtype)):
        body(X, R, Wt, Bs, Y, None)

    return main


def add_ln_kernel(D: int, mode: str = "add", bias: bool = False, eps: float = 1e-5,
                  out_dtype: torch.dtype = torch.bfloat16, cfg: LNConfig | None = None,
                  r_dtype: torch.dtype = torch.bfloat16):
    """The compiled kernel for one (D, mode, bias, eps, out dtype, cfg, residual-input dtype), built once per
    process (cfg None = default_config(D); kernels/tuning.py's `pick_add_ln` prefers a measured winner)."""
    cfg = cfg or default_config(D)
    od, rd = _tl.dt(out_dtype), _tl.dt(r_dtype)
    extra = {} if rd == _tl.BF16 else {"r": rd}  # bf16 kernels keep their names (and cache entries)
    name = _tl.kernel_name("lf_addln", d=D, m=mode, b=int(bias), e="%g" % eps, o=od, c=cfg.tag(), **extra)
    return _tl.memo(("add_ln", D, mode, bias, float(eps), od, cfg, rd),
                    lambda: _tl.compile_func(lambda: build_add_ln(D, mode, bias, eps, od, cfg, rd), name))


def add_ln(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None, eps: float,
           y: torch.Tensor, mode: str = "add") -> torch.Tensor:
    """Run the kernel in place on CUDA tensors (X updated per `mode`); returns y."""
    D = x.shape[1]
    half = y.dtype if y.dtype != torch.float32 else torch.bfloat16
    rr = r if r is not None else _dummy(x.shape[0], D, x.device, half)
    bb = b if b is not None else w
    add_ln_kernel(D, mode, b is not None, eps, y.dtype, r_dtype=rr.dtype)(x, rr, w, bb, y)
    return y


def _dummy(M: int, D: int, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    # R is not read outside the residual modes, but the host stub checks its shape and dtype
    return torch.empty(M, D, dtype=dtype, device=device)


__all__ = ["LNConfig", "MODES", "default_config", "add_ln_ref", "build_add_ln", "add_ln_kernel",
           "add_ln"]
