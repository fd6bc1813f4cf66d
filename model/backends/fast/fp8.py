"""The fast forward's FP8 precision (opt-in): the encoder's four GEMMs a layer in e4m3 with fp32 accumulation.

Scaling: each weight row (output channel) by its own absolute maximum, fixed at load; each activation row (token) by
its own, measured as the row is quantised. The norms that feed the GEMMs write e4m3 rows and their scales
(kernels/layernorm.py); attention's and the GeGLU's outputs go through kernels/quant.py. On Hopper, for more than
small_m rows, the products run on kernels/gemm_manual.py's hand-warp-specialised kernels with e4m3 operands (scales
applied to the accumulator, Wqkv's RoPE and Wi's GeGLU in the epilogue); otherwise on `torch._scaled_mm` with the
two scale vectors (cuBLASLt's FP8 GEMM on sm_89+; the same call runs on CPU, where the tests check the numerics, or
the same product in fp32 ops where the CPU call takes no scale vectors), whose GeGLU then comes from the whole Wi
product in the quantisation pass. With torch ops every step has its reference form. Everything else stays as in
bf16: the fp32 residual stream, attention and its softmax, the decision head and scorer (whose GEMMs are a sliver of
the FLOPs and whose outputs are the answers).

Per-token activation scales follow the rows' own range (one large token does not flatten the others' resolution)
and per-channel weight scales each output column's; e4m3 keeps 3 mantissa bits, so a product's relative error is
about 2^-4 against bf16's 2^-8: BENCHMARKS.md reports what that does to the answers next to bf16 and fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import gemm_manual as _gm
from kernels import layernorm as _ln
from kernels import quant as _quant
from kernels import tuning as _tuning

E4M3 = torch.float8_e4m3fn
E4M3_MAX = _quant.E4M3_MAX
MIN_CAPABILITY = (8, 9)   # FP8 tensor cores: Ada and Hopper on


@dataclass
class Fp8Weight:
    """A GEMM weight W[N, K] as e4m3 `q` and its per-output-channel dequantisation `scale` [1, N] fp32."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def kernel_specs(d: int, inter: int, biases: tuple[bool, bool, bool] = (False, False, False),
                 dtype: torch.dtype = torch.bfloat16, *, arch: str, sms: int, table=None, eps: float = 1e-5,
                 norm_bias: bool = False) -> list[tuple[str, tuple]]:
    """The FP8 precision's kernels of an encoder of width d and GeGLU width inter (biases: Wqkv's, Wo's, MLP Wo's;
    the norms' eps and bias): the norms that feed its GEMMs with e4m3 outputs, the per-token quantisation of the
    other GEMM inputs (attention's output, the GeGLU's, cuBLAS's GeGLU from the Wi product) and, on Hopper for many
    rows, the e4m3 hand-warp-specialised products."""
    table = table or _tuning.TABLE
    ln = (_tuning.pick_add_ln(d, table), dtype)
    specs = [("add_ln", (d, mode, norm_bias, eps, E4M3, *ln)) for mode in ("inplace", "add")]
    specs += [("quant", (K, g, dtype)) for K, g in ((d, False), (inter, False), (inter, True)) if _quant.fits(K)]
    for N, K, b, rope, g in ((3 * d, d, biases[0], 2 * d, False), (d, d, biases[1], 0, False),
                             (inter, d, False, 0, True), (d, inter, biases[2], 0, False)):
        cfg = _tuning.pick_gemm_ws8(table.small_m + 1, N, g, K, arch=arch, sms=sms, table=table)
        if cfg is not None:
            specs.append(("gemm_ws", (N, K, cfg, b, "none", rope, g, dtype, True)))
    return specs


def check_device(device: torch.device) -> None:
    """ValueError when `device` is a GPU without FP8 tensor cores (before compute capability 8.9)."""
    if device.type != "cuda":
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(idx)
    if tuple(cap) < MIN_CAPABILITY:
        raise ValueError("fp8 needs a GPU of compute capability 8.9 or later (FP8 tensor cores); %s is %d.%d"
                         % (torch.cuda.get_device_name(idx), cap[0], cap[1]))


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """W[N, K] (any float dtype, on its device) as an Fp8Weight with one scale per output channel."""
    q, s = _quant.quant_rows_ref(w.detach())
    return Fp8Weight(q.contiguous(), s.view(1, -1).contiguous())


def quantize_rows(a: torch.Tensor, impl: str = "torch", geglu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A[M, K] as (e4m3 [M, K], dequantisation scales [M, 1] fp32), one scale per row (token); geglu: A is the Wi
    product [M, 2F] and what is quantised its GeGLU [M, F]. impl "tilelang": kernels/quant.py's kernel (CUDA, K a
    whole number of its chunks), else the torch form."""
    K = a.shape[1] // 2 if geglu else a.shape[1]
    if impl == "tilelang" and a.is_cuda and _quant.fits(K):
        q, s = _quant.quant(a, geglu)
    else:
        q, s = (_quant.geglu_quant_ref if geglu else _quant.quant_rows_ref)(a)
    return q, s.view(-1, 1)


def add_ln(x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, b: torch.Tensor | None, eps: float, mode: str,
           impl: str, r_like: torch.Tensor | None, cfg=None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/layernorm.py's add + LayerNorm (X updated per `mode`) with its output quantised per row from the fp32
    value: (e4m3 [M, D], scales [M, 1]). impl "tilelang": one kernel of config `cfg` (default: the committed
    table's; `r_like` stands in for an absent residual input, unread), else the torch reference then
    `quant_rows_ref`."""
    M, D = x.shape
    if impl == "tilelang":
        q = torch.empty(M, D, dtype=E4M3, device=x.device)
        s = torch.empty(M, dtype=torch.float32, device=x.device)
        rr = r if r is not None else r_like[:M]
        cfg = cfg or _tuning.pick_add_ln(D)
        _ln.add_ln_kernel(D, mode, b is not None, eps, E4M3, cfg, rr.dtype)(x, rr, w, b if b is not None else w, q, s)
        return q, s.view(-1, 1)
    xn, yn = _ln.add_ln_ref(x, r, w, b, eps, mode, torch.float32)
    if mode != "plain":
        x.copy_(xn)
    q, s = _quant.quant_rows_ref(yn)
    return q, s.view(-1, 1)


def dequantised_product(q: tuple[torch.Tensor, torch.Tensor], w: Fp8Weight) -> torch.Tensor:
    """The scaled product in fp32 torch ops, rounded to bf16: e4m3 x e4m3 products are exact in fp32, so only the
    summation order differs from `torch._scaled_mm`."""
    return ((q[0].float() @ w.q.float().t()) * q[1] * w.scale).bfloat16()


_cpu_rowwise: bool | None = None


def cpu_takes_row_scales() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes per-row and per-channel scales (torch 2.11's takes one scale a
    tensor and fails an internal assert on vectors). Probed once."""
    global _cpu_rowwise
    if _cpu_rowwise is None:
        a = torch.ones(16, 16, dtype=E4M3)
        try:
            torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
            _cpu_rowwise = True
        except RuntimeError:
            _cpu_rowwise = False
    return _cpu_rowwise


def _scaled(q: tuple[torch.Tensor, torch.Tensor], w: Fp8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    if q[0].device.type == "cpu" and not cpu_takes_row_scales():
        y = dequantised_product(q, w)
        return y if out is None else out.copy_(y)
    return torch._scaled_mm(q[0], w.q.t(), scale_a=q[1], scale_b=w.scale, out_dtype=torch.bfloat16, out=out)


def ws_product(q: tuple[torch.Tensor, torch.Tensor], w: Fp8Weight, out: torch.Tensor, cfg,
               bias: torch.Tensor | None = None, zero: torch.Tensor | None = None, rope: tuple | None = None,
               geglu: bool = False) -> torch.Tensor:
    """The product on Hopper's hand-warp-specialised kernel (kernels/gemm_manual.py, e4m3 operands, `cfg` from
    kernels.tuning.pick_gemm_ws8) into bf16 `out`: plus `bias` (`zero`, a zero vector of at least N, stands in for
    none), RoPE'd over the first `rope[0]` columns with rope = (columns, Pos, Cos, Sin), or ModernBERT's GeGLU of
    the Wi product (`out` [M, F])."""
    N, K = (w.shape[0] // 2 if geglu else w.shape[0]), w.shape[1]
    kern = _gm.gemm_manual_kernel(N, K, cfg, bias is not None, "none", rope[0] if rope else 0, geglu, out.dtype,
                                  fp8=True)
    sa, sb = q[1].view(-1), w.scale.view(-1)
    if geglu:   # Wi has no bias in ModernBERT: the GeGLU kernel takes none
        kern(q[0], w.q, out, sa, sb)
        return out
    b = bias if bias is not None else zero[:N]
    if rope:
        kern(q[0], w.q, b, out, *rope[1:], sa, sb)
    else:
        kern(q[0], w.q, b, out, sa, sb)
    return out


def matmul(a: torch.Tensor | tuple, w: Fp8Weight, impl: str = "torch") -> torch.Tensor:
    """a @ W^T in FP8 (a quantised per row, or already an (e4m3, scales) pair), fp32 accumulation, bf16 out."""
    return _scaled(a if isinstance(a, tuple) else quantize_rows(a, impl), w)


def gemm(a: torch.Tensor | tuple, w: Fp8Weight, bias: torch.Tensor | None = None, act: str = "none",
         impl: str = "torch", out: torch.Tensor | None = None, ws=None, zero: torch.Tensor | None = None
         ) -> torch.Tensor:
    """act(a @ W^T + bias) with the product in FP8, into `out` (its dtype) or as a new fp32 tensor. With a
    hand-warp-specialised config `ws` (a bf16 `out`, no activation) the product runs there (`ws_product`), else a
    bf16 `out` with no bias or activation (the encoder's products) takes cuBLAS's product directly."""
    q = a if isinstance(a, tuple) else quantize_rows(a, impl)
    if ws is not None and out is not None and out.dtype == torch.bfloat16 and act == "none":
        return ws_product(q, w, out, ws, bias, zero)
    if out is not None and out.dtype == torch.bfloat16 and bias is None and act == "none" and out.is_contiguous():
        return _scaled(q, w, out)
    y = _scaled(q, w).float()
    if bias is not None:
        y = y + bias
    if act == "gelu":
        y = F.gelu(y)
    elif act == "relu":
        y = F.relu(y)
    return y if out is None else out.copy_(y)


def geglu(a: torch.Tensor | tuple, wi: Fp8Weight, impl: str = "torch", geglu_impl: str = "torch", ws=None,
          out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ModernBERT's GeGLU gelu(a @ Wi[:F]^T) * (a @ Wi[F:]^T) with the product in FP8, returned quantised per row
    for the next GEMM: (e4m3 [M, F], scales [M, 1]). impl quantises `a`, geglu_impl the GeGLU. Every path computes
    one tensor: the Wi product rounded to bf16, its GeGLU in fp32 rounded to bf16, then quantised. With a
    hand-warp-specialised config `ws`, the kernel's GeGLU epilogue (halves rounded first) writes it to bf16 `out`
    [M, F]; otherwise `quant.geglu_quant_ref` or its kernel round it in registers."""
    if ws is not None and out is not None:
        q = a if isinstance(a, tuple) else quantize_rows(a, impl)
        return quantize_rows(ws_product(q, wi, out, ws, geglu=True), geglu_impl)
    return quantize_rows(matmul(a, wi, impl), geglu_impl, geglu=True)


__all__ = ["Fp8Weight", "E4M3_MAX", "kernel_specs", "check_device", "quantize_weight", "quantize_rows", "ws_product",
           "dequantised_product", "cpu_takes_row_scales",
           "matmul", "gemm", "geglu"]
