"""LayerNorm folded into the GEMMs around it, for the encoder's pre-norm layers (bias-free norms, ModernBERT's).

Unfused, each half-layer ends X += R (R the branch's rounded output) and Y = LN(X) * gamma, the next GEMM's input;
that pass reads and writes the fp32 stream. Folded, the GEMM that makes the branch output adds it to the stream in
its epilogue ("residual": X += A @ W^T + bias, and writes X rounded, P = p(X)), and the next GEMM multiplies P by
W' = p(W * gamma) and normalises the product ("fold"): LN(x) W^T = rstd * (x W'^T - mu * colsum(W')), with mu and
rstd from the rows of P it reads anyway. kernels/gemm_manual.py runs both forms (`ln`); the row sums are shifted
by the row's first element, so a mean far from zero does not cancel the variance. This file holds the weight
preparation, the torch references and the two TileLang macros gemm_manual inlines.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prepare(w: torch.Tensor, gamma: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(W' = W * gamma over its input columns, in `dtype`; its row sums, fp32, of the rounded values the GEMM
    multiplies), for a weight W[N, K] that follows a LayerNorm of scale gamma[K] and no shift."""
    wp = (w.float() * gamma.float()[None, :]).to(dtype)
    return wp.contiguous(), wp.float().sum(1).contiguous()


def fold_ref(a: torch.Tensor, w: torch.Tensor, cs: torch.Tensor, bias: torch.Tensor | None,
             eps: float) -> torch.Tensor:
    """Reference of the fold, fp32: rstd * (a @ w^T - mu * cs) + bias, mu and rstd (two-pass) from a's rows as
    given (the rounded stream)."""
    x = a.float()
    mu = x.mean(1, keepdim=True)
    rstd = torch.rsqrt((x - mu).square().mean(1, keepdim=True) + eps)
    y = rstd * (x @ w.float().t() - mu * cs.float()[None, :])
    return y if bias is None else y + bias.float()


def geglu_fold_ref(a: torch.Tensor, wi: torch.Tensor, cs: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference of the GeGLU fold: gelu(h[:, :F]) * h[:, F:] with h = `fold_ref(a, wi, cs)`, in a's dtype."""
    x, gate = fold_ref(a, wi, cs, None, eps).chunk(2, -1)
    return (F.gelu(x) * gate).to(a.dtype)


def residual_ref(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of the residual form: (x + a @ w^T + bias in fp32, that rounded to a's dtype); x is not touched."""
    y = x.float() + a.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y, y.to(a.dtype)


def macros(T, ln: str, N: int, K: int, M, bm: int, bn: int, bk: int, geglu: bool, bias: bool, eps: float,
           barrier: int):
    """gemm_manual's two LN macros for a bm x bn tile (two consumer warpgroups of bm / 2 rows), bk-deep k-steps:
    row_sums(Ag_s, st, s, k, wid, buf), run by each consumer thread (wid: its index in the warpgroup; buf: 8 local
    16-bit elements) on stage s of k-step k, adds its share of its row's shifted sums to st (st[0] sum, st[1] sum
    of squares, st[2] the shift);
    apply_ln(Bias, C_l, Cx_l, Cs, X, St_s, st, by, bx, grp, wid) applies the fold or the residual add to the
    warpgroup's accumulators (St_s: shared (2, bm / 2, 2) f32, each row's mean and rstd; `barrier` + grp: the
    warpgroup's named barrier)."""
    F32 = "float32"
    hm = bm // 2
    tpr = 128 // hm           # consumer threads summing one row (bk // tpr columns each a k-step)
    fold, resid = ln == "fold", ln == "residual"

    @T.macro
    def row_sums(Ag_s, st, s, k, wid, buf):
        if k == 0:
            st[2] = T.Cast(F32, Ag_s[s, wid // tpr, 0])
        for q in T.unroll(bk // tpr // 8):
            c0 = (wid % tpr) * (bk // tpr) + q * 8
            for e in T.vectorized(8):   # one 16-byte load: a swizzle atom keeps 8 elements in a row together
                buf[e] = Ag_s[s, wid // tpr, c0 + e]
            for e in T.unroll(8):
                v = T.Cast(F32, buf[e]) - st[2]
                if K % bk:   # columns past K are zero-filled by TMA and are not the row's
                    v = T.if_then_else(k * bk + c0 + e < K, v, T.float32(0))
                st[0] = st[0] + v
                st[1] = st[1] + v * v

    @T.macro
    def apply_ln(Bias, C_l, Cx_l, Cs, X, St_s, st, by, bx, grp, wid):
        if fold:
            # the row's mean and rstd to shared memory, for the threads that hold its accumulator elements
            if tpr == 2:
                st[0] = st[0] + T.shfl_xor(st[0], 1)
                st[1] = st[1] + T.shfl_xor(st[1], 1)
            if wid % tpr == 0:
                St_s[grp, wid // tpr, 0] = st[2] + st[0] * (1.0 / K)
                St_s[grp, wid // tpr, 1] = T.rsqrt(
                    T.max(st[1] * (1.0 / K) - st[0] * (1.0 / K) * (st[0] * (1.0 / K)), T.float32(0)) + eps)
            T.sync_threads(barrier + grp, 128)
            for i, j in T.Parallel(hm, bn):
                C_l[i, j] = St_s[grp, i, 1] * (C_l[i, j] - St_s[grp, i, 0] * Cs[T.min(bx * bn + j, N - 1)])
            if geglu:
                for i, j in T.Parallel(hm, bn):
                    Cx_l[i, j] = St_s[grp, i, 1] * (Cx_l[i, j] - St_s[grp, i, 0] * Cs[N + T.min(bx * bn + j, N - 1)])
            elif bias:
                for i, j in T.Parallel(hm, bn):
                    C_l[i, j] = C_l[i, j] + Bias[T.min(bx * bn + j, N - 1)]
        if resid:
            # one thread owns each element of X, so its read-modify-write needs no sync
            r0 = by * bm + grp * hm
            for i, j in T.Parallel(hm, bn):
                C_l[i, j] = C_l[i, j] + X[T.min(r0 + i, M - 1), T.min(bx * bn + j, N - 1)]
            if bias:
                for i, j in T.Parallel(hm, bn):
                    C_l[i, j] = C_l[i, j] + Bias[T.min(bx * bn + j, N - 1)]
            for i, j in T.Parallel(hm, bn):
                if r0 + i < M and bx * bn + j < N:
                    X[r0 + i, bx * bn + j] = C_l[i, j]

    return row_sums, apply_ln


__all__ = ["prepare", "fold_ref", "geglu_fold_ref", "residual_ref", "macros"]
