"""GEMM with an optional bias and activation epilogue: C[M,N] = act(A[M,K] @ W[N,K]^T + b).

A and W are bf16, accumulation is fp32, the bias is fp32 and C is bf16. M (the packed token count) is
a runtime symbol, so one compiled kernel serves every token bucket; N and K are compile-time constants.
W is an `nn.Linear` weight ([out, in]), read K-major (transpose_B), which is what wgmma wants on Hopper.
"""


from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import _tl

ACTS = ("none", "gelu", "relu")
INV_SQRT2 = 0.7071067811865476


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and schedule of one GEMM kernel."""

    bm: int = 128
    bn: int = 128
    bk: int = 64
    stages: int = 3
    threads: int = 256
    full_row: bool = True   # GemmWarpPolicy.FullRow: each warpgroup owns 64 rows x the whole block_N
    # persistent > 0: that many blocks (one per SM) loop over the output tiles (T.Persistent), so the
    # TMA producer loads the next tile while the consumers run this tile's epilogue
    persistent: int = 0
    # ws=False: no producer warpgroup; the same threads issue a software pipeline's cp.async loads, so a block
    # needs fewer registers and two share an SM (see BENCHMARKS.md, "GPU fast path")
    ws: bool = True

    def tag(self) -> str:
        """A short text form, e.g. 128x256x64s3t256r (p132: persistent over 132 blocks; n: not warp-specialised)."""
        pol = "r" if self.full_row else "q"
        pers = "p%d" % self.persistent if self.persistent else ""
        return "%dx%dx%ds%dt%d%s%s%s" % (self.bm, self.bn, self.bk, self.stages, self.threads, pol, pers,
                                         "" if self.ws else "n")


SMALL = GemmConfig(bm=64, bn=64, bk=128, stages=4, threads=128)
LARGE = GemmConfig(bm=128, bn=256, bk=64, stages=3, threads=256)
NARROW = GemmConfig(bm=128, bn=64, bk=64, stages=3, threads=256)   # N <= 64 (the scorer's last layer)
SMALL_M = 256   # token buckets up to this many rows use SMALL tiles (more blocks for few tokens)


def default_config(M: int, N: int) -> GemmConfig:
    """The untuned tile config of an M x N product: NARROW for tiny N, SMALL for few rows, else LARGE
    (kernels/tuning.py's `pick_gemm` prefers a measured winner)."""
    if N <= 64:
        return NARROW
    if M <= SMALL_M:
        return SMALL
    return LARGE


def gemm_ref(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none",
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference: act(a @ w.T + bias) computed in fp32, returned as out_dtype (default: a's dtype)."""
    y = a.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    if act == "gelu":
        y = F.gelu(y)
    elif act == "relu":
        y = F.relu(y)
    return y.to(out_dtype or a.dtype)


def apply_act(x, act: str, T):
    """The epilogue activation as a TileLang expression (exact-erf GELU, ReLU or identity)."""
    if act == "gelu":
        return 0.5 * x * (1.0 + T.erf(x * INV_SQRT2))
    if act == "relu":
        return T.max(x, 0.0)
    return x


def build_gemm(N: int, K: int, bias: bool = False, act: str = "none", cfg: GemmConfig = LARGE,
               out_dtype: str = "bfloat16", in_dtype: str = "bfloat16", rope_cols: int = 0):
    """The TileLang PrimFunc main(A[M,K] in_dtype, W[N,K] in_dtype, Bias[N] f32, C[M,N] out_dtype); in_dtype
    bfloat16 or float16, out_dtype one of those or float32.

    rope_cols > 0 (Wqkv: 2 * hidden, the Q and K heads) adds Pos[M] i32, Cos[P,32] f32, Sin[P,32] f32 and
    rotates every 64-column head below rope_cols in the epilogue, exactly as kernels/rope.py does to the
    stored output (the rounded value, fp32 math), so the packed QKV makes no second trip through memory."""
    if act not in ACTS:
        raise ValueError("act must be one of %s, got %r" % (ACTS, act))
    if cfg.bn % 16 or cfg.bk % 16:
        raise ValueError("block_N and block_K must be multiples of 16 (tilelang #2593, #2381)")
    if rope_cols and (cfg.bn % 64 or rope_cols % 64 or act != "none"):
        raise ValueError("a RoPE epilogue needs block_N and rope_cols multiples of 64 and no activation")
    _, T = _tl.tl()
    bm, bn, bk = cfg.bm, cfg.bn, cfg.bk
    M = T.dynamic("M")
    P = T.dynamic("P")
    policy = T.GemmWarpPolicy.FullRow if cfg.full_row else T.GemmWarpPolicy.Square
    IN, F32, I32 = in_dtype, _tl.F32, _tl.I32
    enter = _tl.pdl_enter()

    @T.macro
    def tile(A, W, Bias, C, A_s, W_s, C_l, C_s, C_r, bx, by, Pos, Cos, Sin):
        T.clear(C_l)
        for k in T.Pipelined(T.ceildiv(K, bk), num_stages=cfg.stages):
            T.copy(A[by * bm, k * bk], A_s)
            T.copy(W[bx * bn, k * bk], W_s)
            T.gemm(A_s, W_s, C_l, transpose_B=True, policy=policy)
        if bias:
            for i, j in T.Parallel(bm, bn):
                C_l[i, j] = apply_act(C_l[i, j] + Bias[bx * bn + j], act, T)
        else:
            for i, j in T.Parallel(bm, bn):
                C_l[i, j] = apply_act(C_l[i, j], act, T)
        T.copy(C_l, C_s)
        if rope_cols:
            if bx * bn < rope_cols:
                # Q / K heads: rotate the staged tile into a second buffer, then one bulk store (rotating C_s in
                # place makes TileLang put two barriers in every step of this loop)
                for i, h, d in T.Parallel(bm, bn // 64, 32):
                    p = Pos[T.min(by * bm + i, M - 1)]   # rows past M are never stored
                    x0 = T.Cast(F32, C_s[i, h * 64 + d])
                    x1 = T.Cast(F32, C_s[i, h * 64 + d + 32])
                    C_r[i, h * 64 + d] = T.Cast(out_dtype, x0 * Cos[p, d] - x1 * Sin[p, d])
                    C_r[i, h * 64 + d + 32] = T.Cast(out_dtype, x1 * Cos[p, d] + x0 * Sin[p, d])
                T.copy(C_r, C[by * bm, bx * bn])
            else:
                T.copy(C_s, C[by * bm, bx * bn])
        else:
            T.copy(C_s, C[by * bm, bx * bn])

    @T.macro
    def launch(A, W, Bias, C, Pos, Cos, Sin):
        # one block per output tile, or cfg.persistent blocks walking the tiles (T.Persistent)
        grid = (cfg.persistent,) if cfg.persistent else (T.ceildiv(N, bn), T.ceildiv(M, bm))
        with T.Kernel(*grid, threads=cfg.threads) as ids:
            A_s = T.alloc_shared((bm, bk), IN)
            W_s = T.alloc_shared((bn, bk), IN)
            C_l = T.alloc_fragment((bm, bn), F32)
            C_s = T.alloc_shared((bm, bn), out_dtype)
            # a persistent block keeps every buffer live across its tiles, so a second staging tile does not fit
            # beside the pipeline (278 KB for 128x256x64s3): it rotates in place, with TileLang's barriers
            C_r = (C_s if cfg.persistent else T.alloc_shared((bm, bn), out_dtype)) if rope_cols else None
            enter()
            if cfg.persistent:
                for by, bx in T.Persistent([T.ceildiv(M, bm), T.ceildiv(N, bn)], cfg.persistent, ids):
                    tile(A, W, Bias, C, A_s, W_s, C_l, C_s, C_r, bx, by, Pos, Cos, Sin)
            else:
                tile(A, W, Bias, C, A_s, W_s, C_l, C_s, C_r, ids[0], ids[1], Pos, Cos, Sin)

    if rope_cols:
        @T.prim_func
        def main_rope(A: T.Tensor((M, K), IN), W: T.Tensor((N, K), IN), Bias: T.Tensor((N,), F32),
                      C: T.Tensor((M, N), out_dtype), Pos: T.Tensor((M,), I32),
                      Cos: T.Tensor((P, 32), F32), Sin: T.Tensor((P, 32), F32)):
            launch(A, W, Bias, C, Pos, Cos, Sin)
        return main_rope

    @T.prim_func
    def main(A: T.Tensor((M, K), IN), W: T.Tensor((N, K), IN), Bias: T.Tensor((N,), F32),
             C: T.Tensor((M, N), out_dtype)):
        launch(A, W, Bias, C, None, None, None)

    return main


def gemm_kernel(N: int, K: int, bias: bool = False, act: str = "none", cfg: GemmConfig = LARGE,
                out_dtype: torch.dtype = torch.bfloat16, in_dtype: torch.dtype = torch.bfloat16, rope_cols: int = 0):
    """The compiled GEMM for (N, K, bias, act, cfg, out dtype, input dtype, RoPE columns), built once per
    process."""
    od, idt = _tl.dt(out_dtype), _tl.dt(in_dtype)
    extra = {} if idt == _tl.BF16 else {"i": idt}  # bf16 kernels keep their names (and cache entries)
    if rope_cols:
        extra["r"] = rope_cols
    name = _tl.kernel_name("lf_gemm", n=N, k=K, b=int(bias), a=act, c=cfg.tag(), o=od, **extra)
    return _tl.memo(("gemm", N, K, bias, act, cfg, od, idt, rope_cols),
                    lambda: _tl.compile_func(lambda: build_gemm(N, K, bias, act, cfg, od, idt, rope_cols), name,
                                             pass_configs=_tl.ws_pass_configs(cfg.ws)))


def gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: str = "none",
         out: torch.Tensor | None = None, cfg: GemmConfig | None = None) -> torch.Tensor:
    """Run the TileLang GEMM on CUDA tensors; returns `out` (allocated when None)."""
    M, K = a.shape
    N = w.shape[0]
    cfg = cfg or default_config(M, N)
    if out is None:
        out = torch.empty(M, N, dtype=a.dtype, device=a.device)
    b = bias if bias is not None else _zeros(N, a.device)
    gemm_kernel(N, K, bias is not None, act, cfg, out.dtype, a.dtype)(a, w, b, out)
    return out


_ZEROS: dict[tuple, torch.Tensor] = {}


def _zeros(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(n, dtype=torch.float32, device=device)
    return z


def gemm_flops(M: int, N: int, K: int) -> float:
    """Floating-point operations of one M x N x K product."""
    return 2.0 * M * N * K


__all__ = ["GemmConfig", "SMALL", "LARGE", "NARROW", "SMALL_M", "default_config", "gemm_ref", "build_gemm",
           "gemm_kernel", "gemm", "gemm_flops", "apply_act"]
