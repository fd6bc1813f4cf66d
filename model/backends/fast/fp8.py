"""The fast forward's FP8 precision (opt-in): the encoder's four GEMMs a layer in e4m3 with fp32 accumulation.

Scaling: each weight row (output channel) by its own absolute maximum, fixed at load; each activation row (token)
by its own, measured as the row is quantised. A product is then `torch._scaled_mm` with those two scale vectors
(cuBLASLt's FP8 tensor-core GEMM on sm_89+; the same call runs on CPU, so the numerics can be checked there),
and the bias, activation and GeGLU are applied to its bf16 output. Everything else stays as in bf16: the fp32
residual stream, LayerNorm, attention and its softmax, the decision head and scorer (whose GEMMs are a sliver of
the FLOPs and whose outputs are the answers).

Per-token activation scales follow the rows' own range (one large token does not flatten the others' resolution)
and per-channel weight scales each output column's; e4m3 keeps 3 mantissa bits, so a product's relative error is
about 2^-4 against bf16's 2^-8: BENCHMARKS.md reports what that does to the answers next to bf16 and fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
MIN_CAPABILITY = (8, 9)   # FP8 tensor cores: Ada and Hopper on


@dataclass
class Fp8Weight:
    """A GEMM weight W[N, K] as e4m3 `q` and its per-output-channel dequantisation `scale` [1, N] fp32."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def check_device(device: torch.device) -> None:
    """ValueError when `device` is a GPU without FP8 tensor cores (before compute capability 8.9)."""
    if device.type != "cuda":
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(idx)
    if tuple(cap) < MIN_CAPABILITY:
        raise ValueError("fp8 needs a GPU of compute capability 8.9 or later (FP8 tensor cores); %s is %d.%d"
                         % (torch.cuda.get_device_name(idx), cap[0], cap[1]))


def _scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row dequantisation scales [rows, 1] fp32: the row's absolute maximum over e4m3's largest value (a zero
    row gets a tiny positive scale, so it quantises to zeros rather than NaNs)."""
    return x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """W[N, K] (any float dtype, on its device) as an Fp8Weight with one scale per output channel."""
    w = w.detach().float()
    s = _scales(w)
    return Fp8Weight((w / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).contiguous(), s.t().contiguous())


def quantize_rows(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A[M, K] as (e4m3 [M, K], dequantisation scales [M, 1] fp32), one scale per row (token)."""
    s = _scales(a)
    return (a.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def matmul(a: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """a @ W^T in FP8 (a quantised per row), fp32 accumulation, bf16 out."""
    a8, sa = quantize_rows(a)
    return torch._scaled_mm(a8, w.q.t(), scale_a=sa, scale_b=w.scale, out_dtype=torch.bfloat16)


def gemm(a: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, act: str = "none") -> torch.Tensor:
    """act(a @ W^T + bias) with the product in FP8; fp32 result (the caller stores it in its buffer's dtype)."""
    y = matmul(a, w).float()
    if bias is not None:
        y = y + bias
    if act == "gelu":
        y = F.gelu(y)
    elif act == "relu":
        y = F.relu(y)
    return y


def geglu(a: torch.Tensor, wi: Fp8Weight) -> torch.Tensor:
    """gelu(a @ Wi[:F]^T) * (a @ Wi[F:]^T), ModernBERT's GeGLU, with the product in FP8; fp32 result."""
    x, gate = matmul(a, wi).float().chunk(2, -1)
    return F.gelu(x) * gate


__all__ = ["Fp8Weight", "E4M3_MAX", "check_device", "quantize_weight", "quantize_rows", "matmul", "gemm", "geglu"]
