"""Per-row (per-token) FP8 quantisation for the FP8 precision's GEMM inputs, one pass over the activations.

`quant_rows`: A[M, K] (bf16 / fp16) -> Q[M, K] e4m3 and S[M] fp32 with A[i] ~ Q[i] * S[i], S[i] = max|A[i]| / 448.
`geglu_quant`: P[M, 2F] (the Wi product, bf16) -> ModernBERT's GeGLU gelu(P[:, :F]) * P[:, F:] in fp32, rounded to
P's dtype and quantised the same way: the rounding point of the e4m3 GeGLU GEMM's epilogue (kernels/gemm_manual.py,
which rounds the scaled Wi product and stores the GeGLU in 16 bits), so both FP8 GeGLU paths quantise one tensor.

A block owns bm rows and walks them in bk-column chunks twice: the first keeps each thread's running absolute
maximum and reduces it over the row once at the end, the second (its reads mostly served by L2) divides, clamps to
e4m3's range and stores. The math is that of
model/backends/fast/fp8.py's torch form (`quantize_rows`, `geglu`), which the tests hold these kernels to.
"""

from dataclasses import dataclass

import torch

from . import _tl

FP8 = "float8_e4m3fn"
E4M3_MAX = 448.0
MIN_AMAX = 1e-12          # a zero row gets a tiny scale, so it quantises to zeros rather than NaNs
INV_SQRT2 = 0.7071067811865476


@dataclass(frozen=True)
class QuantConfig:
    """Rows per block, columns per chunk and threads per block."""

    bm: int = 16
    bk: int = 64
    threads: int = 128

    def tag(self) -> str:
        """A short text form, e.g. 16r64c128t."""
        return "%dr%dc%dt" % (self.bm, self.bk, self.threads)


DEFAULT = QuantConfig()


def fits(K: int, cfg: QuantConfig = DEFAULT) -> bool:
    """Whether rows of K columns walk in whole chunks (the forward uses the torch form otherwise)."""
    return K % cfg.bk == 0


def quant_rows_ref(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (e4m3 [M, K], scales [M] fp32)."""
    a = a.float()
    # a tensor divisor: torch turns division by a Python number into a product with its rounded reciprocal on
    # CUDA, one ulp off the kernel's (and IEEE's) quotient often enough to move a rounding tie
    amax = a.abs().amax(dim=1).clamp(min=MIN_AMAX)
    s = amax / torch.full_like(amax, E4M3_MAX)
    return (a / s[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def geglu_quant_ref(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: the GeGLU of P[M, 2F] in fp32, rounded to P's dtype where that is 16-bit, quantised per row."""
    x, gate = p.float().chunk(2, -1)
    h = torch.nn.functional.gelu(x) * gate
    return quant_rows_ref(h.to(p.dtype) if p.dtype in (torch.bfloat16, torch.float16) else h)


def build_quant(K: int, geglu: bool = False, in_dtype: str = _tl.BF16, cfg: QuantConfig = DEFAULT):
    """The TileLang PrimFunc main(A[M, K or 2K] in_dtype, Q[M, K] e4m3, S[M] f32); geglu: A is the Wi product and
    row i of what is quantised is gelu(A[i, :K]) * A[i, K:], rounded to in_dtype."""
    if K % cfg.bk:
        raise ValueError("K = %d must be a multiple of the chunk width %d" % (K, cfg.bk))
    _, T = _tl.tl()
    enter = _tl.pdl_enter()
    bm, bk, nk = cfg.bm, cfg.bk, K // cfg.bk
    M = T.dynamic("M")
    F32 = _tl.F32
    width = 2 * K if geglu else K

    @T.macro
    def load(A, x, g, bx, k):   # chunk k of rows bx * bm.. into x, as fp32 (their GeGLU, rounded to in_dtype)
        T.copy(A[bx * bm, k * bk], x)
        if geglu:
            T.copy(A[bx * bm, K + k * bk], g)
            for i, j in T.Parallel(bm, bk):
                x[i, j] = T.Cast(F32, T.Cast(in_dtype, 0.5 * x[i, j] * (1.0 + T.erf(x[i, j] * INV_SQRT2)) * g[i, j]))

    @T.prim_func
    def main(A: T.Tensor((M, width), in_dtype), Q: T.Tensor((M, K), FP8), S: T.Tensor((M,), F32)):
        with T.Kernel(T.ceildiv(M, bm), threads=cfg.threads) as bx:
            x = T.alloc_fragment((bm, bk), F32)
            g = T.alloc_fragment((bm, bk), F32)
            q = T.alloc_fragment((bm, bk), FP8)
            amax = T.alloc_fragment((bm, bk), F32)   # each thread's running maximum; one reduction at the end
            scale = T.alloc_fragment((bm,), F32)
            enter()
            T.clear(amax)
            for k in T.serial(nk):
                load(A, x, g, bx, k)
                for i, j in T.Parallel(bm, bk):
                    amax[i, j] = T.max(amax[i, j], T.abs(x[i, j]))
            T.reduce_max(amax, scale, dim=1)
            for i in T.Parallel(bm):
                scale[i] = T.max(scale[i], MIN_AMAX) / E4M3_MAX
            for k in T.serial(nk):   # the same chunk again (mostly from L2), now divided by its row's scale
                load(A, x, g, bx, k)
                for i, j in T.Parallel(bm, bk):
                    x[i, j] = T.clamp(x[i, j] / scale[i], -E4M3_MAX, E4M3_MAX)
                T.copy(x, q)
                T.copy(q, Q[bx * bm, k * bk])
            for i in T.Parallel(bm):
                S[bx * bm + i] = scale[i]

    return main


def quant_kernel(K: int, geglu: bool = False, in_dtype: torch.dtype = torch.bfloat16, cfg: QuantConfig = DEFAULT):
    """The compiled kernel for one (K, geglu, input dtype, cfg), built once per process."""
    idt = _tl.dt(in_dtype)
    name = _tl.kernel_name("lf_quant", k=K, g=int(geglu), i=idt, c=cfg.tag())
    return _tl.memo(("quant", K, geglu, idt, cfg), lambda: _tl.compile_func(lambda: build_quant(K, geglu, idt, cfg),
                                                                             name))


def quant(a: torch.Tensor, geglu: bool = False, cfg: QuantConfig = DEFAULT) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the kernel on a CUDA tensor: (e4m3 [M, K], scales [M] fp32), K = a's width (half of it for geglu)."""
    M, W = a.shape
    K = W // 2 if geglu else W
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=a.device)
    s = torch.empty(M, dtype=torch.float32, device=a.device)
    quant_kernel(K, geglu, a.dtype, cfg)(a, q, s)
    return q, s


__all__ = ["QuantConfig", "DEFAULT", "fits", "quant", "quant_kernel", "build_quant", "quant_rows_ref",
           "geglu_quant_ref"]
