"""The fused DecisionModel forward over a packed token stream, replayed from CUDA graphs.

Packing: a batch of rows becomes one stream of tokens with no padding between rows; the host builds,
per batch, the token ids, each token's position inside its row (RoPE), its question type and row id,
cu_seqlens and the attention tile table, and sends them in one copy. The stream is padded at the end
to a token bucket; padding tokens belong to no row and are never read back.

Per token bucket one CUDA graph runs the whole encoder and decision head (every op a TileLang kernel:
GEMM with bias/activation epilogue, GEMM + GeGLU, residual add + LayerNorm, RoPE, packed attention)
and the scorer's logits. After the head's last attention only the marker and [CLS] tokens are read back, so that
layer's output projection, feed-forward and the scorer run on those rows alone (gathered, at most 1/8 of the
bucket; a batch with more falls back to every row: each bucket has a graph for both). Activations live in one set of
static buffers sized for the largest bucket and shared by every graph (one forward runs at a time, under a lock).
A second, small graph per (row bucket, marker bucket) gathers marker logits and [CLS] states and runs the action
head in torch.
`warmup(max_batch_tokens)` captures every graph up front, into one shared memory pool.

`ops="torch"` swaps every kernel for its torch reference (same packing, same buffers): a debugging
aid that also runs on CPU, which is how the CPU tests check the packing against the eager model.
"""

from __future__ import annotations

import copy
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from model.backends.base import HALF, BackendUnavailable, dtype_named
from model.network import confidence_features
from model.sequence import Row

from . import _tl
from . import attention as _attn
from . import geglu as _geglu
from . import gemm as _gemm
from . import gemm_manual as _gm
from . import layernorm as _ln
from . import rope as _rope

log = logging.getLogger(__name__)

OPS = ("gemm", "geglu", "add_ln", "rope", "attention")
DEFAULT_MAX_BATCH_TOKENS = 16384
SCORER_PAD = 16       # the scorer's 1-wide output layer runs as a 16-wide GEMM (zero rows) with fp32 output
# After the decision head's last attention only the marker and [CLS] tokens are read, so the rest of that layer and
# the scorer run on those rows alone, gathered into at most Tb / GATHER_DIV rows (a batch with more, short rows full
# of options, runs them on Tb rows); LAYA_FLEET_GATHER_HEAD=0 always takes Tb rows. Each token bucket has a graph for
# either capacity.
GATHER_DIV = 8
GATHER_HEAD = os.environ.get("LAYA_FLEET_GATHER_HEAD", "1") != "0"


def gather_capacity(Tb: int) -> int:
    """The rows the head's last layer runs on in a gathered forward of bucket Tb."""
    return max(1, Tb // GATHER_DIV) if GATHER_HEAD else Tb


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to max_tokens (rounded up to 64): steps of 64 to 512, then 8 per octave (a batch
    pads at most 12.5%, 6% on average; 10 x 3 rows of 512 tokens fill the 15360 bucket exactly)."""
    top = max(64, -(-int(max_tokens) // 64) * 64)
    out = list(range(64, min(top, 512), 64))
    e = 512
    while e < top:
        out.extend(v for v in range(e, 2 * e, e // 8) if v < top)
        e *= 2
    out.append(top)
    return sorted(set(out))


def row_capacity(tokens: int) -> int:
    """How many rows a token bucket takes (its attention grid has this many spare tiles for the rows'
    partial tiles; batches of rows averaging under 16 tokens move up to a larger bucket)."""
    return min(tokens, max(8, tokens // 16))


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << max(0, int(n) - 1).bit_length())


@dataclass
class FastStats:
    """Counters of one fast forward engine."""

    forwards: int = 0
    chunks: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    graphs: int = 0
    tail_graphs: int = 0
    captures_after_warmup: int = 0
    eager_tails: int = 0
    warmup_s: float = 0.0
    compile_s: float = 0.0
    buckets: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy."""
        return dict(self.__dict__, buckets=list(self.buckets))


class _Layer:
    """Weights of one encoder or head layer on the device (GEMM weights in the activation dtype, norms and
    biases fp32)."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


def kernel_specs(d: int, heads: int, inter: int, ffn: int, windows, eps: float = 1e-5, head_eps=(1e-5,),
                 qkv_bias: bool = False, out_bias: bool = False, norm_bias: bool = False,
                 attn_cfg: _attn.AttnConfig = _attn.DEFAULT,
                 dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, tuple]]:
    """Every (op, builder args) the forward of a model of this shape launches (both tile regimes); `dtype` is
    the activations' and GEMM weights' (bf16, or fp16: those specs carry it as a last argument)."""
    specs: list[tuple[str, tuple]] = []
    adt = dtype
    half = () if dtype == torch.bfloat16 else (dtype,)  # bf16 specs keep their historical form
    for g, gg in ((_gemm.SMALL, _geglu.SMALL), (None, _geglu.pick_config(_gemm.SMALL_M + 1, inter, d))):
        def cfg(M: int, N: int, K: int, g=g) -> _gemm.GemmConfig:
            return g if g is not None else _gemm.pick_config(M, N, K)

        big = _gemm.SMALL_M + 1
        qkv_cfg = cfg(big, 3 * d, d)   # Wqkv rotates Q and K in its epilogue (RoPE fused) when the tile allows
        qkv = (3 * d, d, qkv_bias, "none", qkv_cfg, adt) + ((adt, 2 * d) if qkv_cfg.bn % 64 == 0 else half)
        prods = [(3 * d, d, qkv_bias, "none", 2 * d), (d, d, out_bias, "none", 0), (d, inter, out_bias, "none", 0),
                 (3 * d, d, True, "none", 0), (d, d, True, "none", 0), (ffn, d, True, "relu", 0),
                 (d, ffn, True, "none", 0), (d, d, True, "gelu", 0)]
        ws = _gm.pick(big, 3 * d, adt, adt) if g is None else None
        if ws is not None:
            # Hopper, many rows: the hand-warp-specialised kernels (kernels/gemm_manual.py); RoPE always fused
            specs += [("gemm_ws", (N, K, _gm.pick(big, N, adt, adt, K=K), b, a, r, False, adt))
                      for N, K, b, a, r in prods]
            specs.append(("gemm_ws", (inter, d, _gm.pick(big, inter, adt, adt, geglu=True, K=d), False, "none", 0,
                                      True, adt)))
            continue
        specs += [("gemm", qkv),
                  ("gemm", (d, d, out_bias, "none", cfg(big, d, d), adt, *half)),
                  ("geglu", (inter, d, gg, *half)),
                  ("gemm", (d, inter, out_bias, "none", cfg(big, d, inter), adt, *half)),
                  ("gemm", (3 * d, d, True, "none", cfg(big, 3 * d, d), adt, *half)),
                  ("gemm", (d, d, True, "none", cfg(big, d, d), adt, *half)),
                  ("gemm", (ffn, d, True, "relu", cfg(big, ffn, d), adt, *half)),
                  ("gemm", (d, ffn, True, "none", cfg(big, d, ffn), adt, *half)),
                  ("gemm", (d, d, True, "gelu", cfg(big, d, d), adt, *half))]
    specs.append(("gemm", (SCORER_PAD, d, True, "none", _gemm.NARROW, torch.float32, *half)))
    ln = (None, dtype) if half else ()  # add_ln's (cfg, residual dtype)
    specs += [("add_ln", (d, "inplace", norm_bias, eps, adt, *ln)), ("add_ln", (d, "add", norm_bias, eps, adt, *ln)),
              ("add_ln", (d, "add_inplace", norm_bias, eps, adt, *ln))]
    for e in sorted(set(head_eps)):
        specs += [("add_ln", (d, "plain", True, e, adt, *ln)), ("add_ln", (d, "add", True, e, adt, *ln))]
    specs.append(("rope", (heads, _rope.RopeConfig(), dtype) if half else (heads,)))
    for win in sorted(set(windows) | {0}):
        specs.append(("attention", (heads, win, attn_cfg, *half)))
    specs.append(("attention", (max(1, d // 64), 0, attn_cfg, *half)))
    return list(dict.fromkeys(specs))


def spec_op(spec: tuple[str, tuple]) -> str:
    """The forward op (a key of OPS, which `ops` sets to TileLang or torch) a kernel spec serves: a manual GEMM
    spec serves `gemm`, or `geglu` in its GeGLU form."""
    kind, args = spec
    if kind == "gemm_ws":
        return "geglu" if args[6] else "gemm"
    return kind


BUILDERS = {"gemm": _gemm.gemm_kernel, "gemm_ws": _gm.gemm_manual_kernel, "geglu": _geglu.geglu_kernel,
            "add_ln": _ln.add_ln_kernel,
            "rope": _rope.rope_kernel, "attention": _attn.attention_kernel}


def compile_specs(specs: list[tuple[str, tuple]], workers: int | None = None) -> float:
    """Compile (or load from TileLang's cache) every kernel in specs, in parallel; returns seconds."""
    t = time.perf_counter()
    _tl.tl()  # import on this thread first: it sets the cache directory
    n = workers or max(1, min(len(specs), os.cpu_count() or 1))
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(lambda s: BUILDERS[s[0]](*s[1]), specs))
    return time.perf_counter() - t


class FastForward:
    """Static buffers, weights and CUDA graphs for the packed forward of one DecisionModel."""

    def __init__(self, model: torch.nn.Module, bundle: Any, device: torch.device, *, ops: str | dict = "tilelang",
                 use_graphs: bool | None = None, max_batch_tokens: int | None = None,
                 act_dtype: torch.dtype | None = None, attn_cfg: _attn.AttnConfig = _attn.DEFAULT,
                 compile_workers: int | None = None):
        self.device = torch.device(device)
        self.ops = self._resolve_ops(ops)
        uses_tl = "tilelang" in self.ops.values()
        if uses_tl:
            if self.device.type != "cuda":
                raise BackendUnavailable("the TileLang kernels need a CUDA device, got %s" % self.device)
            ok, why = _tl.available()
            if not ok:
                raise BackendUnavailable("tilelang is not importable (%s)" % why)
        if act_dtype is not None:  # the TileLang kernels take bf16 or fp16; the torch ops fp32 too
            act_dtype = dtype_named(act_dtype, "act_dtype", HALF if uses_tl else HALF + (torch.float32,))
        self.act_dtype = act_dtype or (torch.bfloat16 if uses_tl else torch.float32)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.attn_cfg = attn_cfg
        self.pad_id = int(bundle.tokenizer.pad_token_id)
        self._load_weights(model, bundle)
        self.stats = FastStats()
        self._lock = threading.RLock()
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}   # (token bucket, head rows)
        self._tail_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._warm = False
        self._ran: set[bool] = set()   # tile regimes (small / large token counts) run outside a capture
        self._prof: list | None = None
        self.T_max = 0
        self._alloc(max_batch_tokens or DEFAULT_MAX_BATCH_TOKENS)
        if uses_tl:
            t = time.perf_counter()
            self._compile_all(compile_workers)
            self.stats.compile_s = time.perf_counter() - t

    # -- set-up ---------------------------------------------------------------------------------
    @staticmethod
    def _resolve_ops(ops: str | dict) -> dict[str, str]:
        if isinstance(ops, str):
            ops = {k: ops for k in OPS}
        out = {k: "tilelang" for k in OPS}
        for k, v in dict(ops).items():
            if k not in OPS or v not in ("tilelang", "torch"):
                raise ValueError("ops maps %s to 'tilelang' or 'torch', got %r: %r" % (list(OPS), k, v))
            out[k] = v
        return out

    def _load_weights(self, model: torch.nn.Module, bundle: Any) -> None:
        enc = model.encoder
        cfg = enc.config
        if getattr(cfg, "model_type", None) != "modernbert":
            raise BackendUnavailable("the fast path implements ModernBERT-family encoders, got %r"
                                     % getattr(cfg, "model_type", None))
        d, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
        if d % heads or d // heads != _attn.HEAD_DIM:
            raise BackendUnavailable("the kernels need head_dim 64, got %d / %d" % (d, heads))
        if getattr(cfg, "hidden_activation", "gelu") != "gelu":
            raise BackendUnavailable("the GeGLU kernel implements exact GELU, got %r" % cfg.hidden_activation)
        if getattr(cfg, "mlp_bias", False):
            raise BackendUnavailable("the GeGLU kernel has no bias (mlp_bias=True)")
        if model.head is None or d % 64:
            raise BackendUnavailable("the fast path needs the decision head with d a multiple of 64")
        dev, adt = self.device, self.act_dtype
        self.d, self.heads, self.inter = d, heads, int(cfg.intermediate_size)
        self.head_heads = max(1, d // 64)
        self.eps = float(cfg.norm_eps)
        self.max_len = min(int(bundle.max_len), int(getattr(cfg, "max_position_embeddings", 1 << 30)))
        window = getattr(cfg, "sliding_window", None) or int(cfg.local_attention) // 2

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=dev, dtype=adt).contiguous()

        def f(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(device=dev, dtype=torch.float32).contiguous()

        emb = enc.embeddings
        self.emb = f(emb.tok_embeddings.weight)
        self.emb_norm = (f(emb.norm.weight), f(getattr(emb.norm, "bias", None)))
        rot = enc.rotary_emb
        self.rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        types = list(cfg.layer_types)
        for lt in sorted(set(types)):
            inv = getattr(rot, "%s_inv_freq" % lt)
            scaling = float(getattr(rot, "%s_attention_scaling" % lt, 1.0))
            self.rope_tables[lt] = _rope.rope_tables_from_inv_freq(inv, self.max_len, scaling, dev)
        self.layers = []
        for i, layer in enumerate(enc.layers):
            norm = layer.attn_norm if i > 0 else None
            self.layers.append(_Layer(
                attn_norm=None if norm is None else (f(norm.weight), f(getattr(norm, "bias", None))),
                wqkv=w(layer.attn.Wqkv.weight), bqkv=f(layer.attn.Wqkv.bias),
                wo=w(layer.attn.Wo.weight), bo=f(layer.attn.Wo.bias),
                mlp_norm=(f(layer.mlp_norm.weight), f(getattr(layer.mlp_norm, "bias", None))),
                wi=w(layer.mlp.Wi.weight), wo2=w(layer.mlp.Wo.weight), bo2=f(layer.mlp.Wo.bias),
                window=int(window) if types[i] == "sliding_attention" else 0, rope=types[i]))
        fn = enc.final_norm
        self.final_norm = (f(fn.weight), f(getattr(fn, "bias", None)))
        self.head_layers = []
        for hl in model.head.layers:
            a = hl.self_attn
            self.head_layers.append(_Layer(
                norm1=(f(hl.norm1.weight), f(hl.norm1.bias), float(hl.norm1.eps)),
                norm2=(f(hl.norm2.weight), f(hl.norm2.bias), float(hl.norm2.eps)),
                win=w(a.in_proj_weight), bin=f(a.in_proj_bias), wout=w(a.out_proj.weight), bout=f(a.out_proj.bias),
                w1=w(hl.linear1.weight), b1=f(hl.linear1.bias), w2=w(hl.linear2.weight), b2=f(hl.linear2.bias)))
        self.ffn = int(model.head.layers[0].linear1.out_features)
        sc = model.scorer
        self.scorer_norm = (f(sc[0].weight), f(sc[0].bias), float(sc[0].eps))
        self.scorer_w1, self.scorer_b1 = w(sc[1].weight), f(sc[1].bias)
        w2 = torch.zeros(SCORER_PAD, d)
        w2[0] = sc[3].weight.detach().float()[0]
        b2 = torch.zeros(SCORER_PAD)
        b2[0] = sc[3].bias.detach().float()[0]
        self.scorer_w2, self.scorer_b2 = w(w2), f(b2)
        self.type_emb = f(model.type_emb.weight)
        self.act_head = copy.deepcopy(model.act_head).float().to(dev).eval().requires_grad_(False)

    def _alloc(self, max_tokens: int) -> None:
        """(Re)allocate the static buffers for buckets up to max_tokens; drops every captured graph."""
        T = token_buckets(max(int(max_tokens), self.max_len))[-1]
        if T <= self.T_max:
            return
        self._graphs.clear()
        self._tail_graphs.clear()
        self._pool = None
        self._warm = False
        self._ran = set()
        dev, adt, d = self.device, self.act_dtype, self.d
        self.T_max = T
        self.buckets = token_buckets(T)
        self.R_max = row_capacity(T)
        self.K_max = _pow2(max(2, self.max_len // 4), 2)
        n_int = self._int_size(T)
        pin = dev.type == "cuda"
        self._ints = torch.zeros(n_int, dtype=torch.int32, device=dev)
        rb = _pow2(self.R_max)
        n_tail = rb * (self.K_max + 1)
        self._tail = torch.zeros(n_tail, dtype=torch.int32, device=dev)
        # two host staging slots: a multi-chunk forward stages chunk k + 1 on the CPU while the GPU runs chunk k
        # (slot 0 doubles as the staging buffer of warm-up and profile, which run one chunk at a time)
        self._slots = [(torch.zeros(n_int, dtype=torch.int32, pin_memory=pin),
                        torch.zeros(n_tail, dtype=torch.int32, pin_memory=pin)) for _ in range(2)]
        self._slot_done: list[Any] = [None, None]   # the CUDA event after the last chunk that used each slot
        self._ints_host, self._tail_host = self._slots[0]
        # zero-filled so stale padding rows are always finite (attention multiplies them by p = 0)
        # X, O and S have one row more: row T is where the gathered head's padding rows go (never read back)
        self.X = torch.zeros(T + 1, d, dtype=torch.float32, device=dev)
        self.Y = torch.zeros(T, d, dtype=adt, device=dev)
        self.QKV = torch.zeros(T, 3 * d, dtype=adt, device=dev)
        self.O = torch.zeros(T + 1, d, dtype=adt, device=dev)
        self.R = torch.zeros(T, d, dtype=adt, device=dev)
        self.G = torch.zeros(T * max(self.inter, self.ffn, d), dtype=adt, device=dev)
        self.S = torch.zeros(T + 1, SCORER_PAD, dtype=torch.float32, device=dev)
        self.Sg = torch.zeros(T, SCORER_PAD, dtype=torch.float32, device=dev)
        self._zero_bias = torch.zeros(max(3 * d, self.ffn, self.inter, SCORER_PAD), dtype=torch.float32, device=dev)

    def _kernel_specs(self) -> list[tuple[str, tuple]]:
        """Every (op, args) this model's forward launches through TileLang."""
        ly = self.layers[0]
        specs = kernel_specs(self.d, self.heads, self.inter, self.ffn, {x.window for x in self.layers}, self.eps,
                             {hl.norm1[2] for hl in self.head_layers} | {hl.norm2[2] for hl in self.head_layers}
                             | {self.scorer_norm[2]}, ly.bqkv is not None, ly.bo is not None,
                             self.emb_norm[1] is not None, self.attn_cfg, self.act_dtype)
        return [sp for sp in specs if self.ops[spec_op(sp)] == "tilelang"]

    def _compile_all(self, workers: int | None) -> None:
        try:
            compile_specs(self._kernel_specs(), workers)
        except Exception as e:  # nvcc missing, unsupported arch, a TileLang lowering error
            raise BackendUnavailable("compiling the TileLang kernels failed: %s: %s" % (type(e).__name__, e)) from e

    # -- ops (TileLang kernel or torch reference, writing into static buffers) --------------------
    def _mark(self, kind: str):
        """Start a timed region when profiling (see `profile`); returns a token for `_done`."""
        if self._prof is None:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return kind, ev

    def _done(self, tok) -> None:
        if tok is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._prof.append((tok[0], tok[1], ev))

    def _gemm(self, a, w, bias, out, act="none"):
        tok = self._mark("gemm %dx%d" % (w.shape[0], a.shape[1]))
        if self.ops["gemm"] == "tilelang":
            M, N = a.shape[0], w.shape[0]
            b = bias if bias is not None else self._zero_bias[:N]
            ws = _gm.pick(M, N, a.dtype, out.dtype, K=a.shape[1])
            if ws is not None:
                _gm.gemm_manual_kernel(N, a.shape[1], ws, bias is not None, act, 0, False, a.dtype)(a, w, b, out)
            else:
                cfg = _gemm.pick_config(M, N, a.shape[1])
                _gemm.gemm_kernel(N, a.shape[1], bias is not None, act, cfg, out.dtype, a.dtype)(a, w, b, out)
        else:
            out.copy_(_gemm.gemm_ref(a, w, bias, act, out.dtype))
        self._done(tok)

    def _fused_rope(self, M: int) -> bool:
        """Whether Wqkv's GEMM rotates Q and K in its epilogue at M tokens (both ops TileLang, a 64-wide tile)."""
        return (self.ops["gemm"] == "tilelang" and self.ops["rope"] == "tilelang"
                and (_gm.pick(M, 3 * self.d, self.act_dtype, self.act_dtype, K=self.d) is not None
                     or _gemm.pick_config(M, 3 * self.d, self.d).bn % 64 == 0))

    def _qkv(self, a, ly, pos, table, out):
        """Wqkv and RoPE: one GEMM with a rotating epilogue, or the GEMM then the RoPE op."""
        if not self._fused_rope(a.shape[0]):
            self._gemm(a, ly.wqkv, ly.bqkv, out)
            self._rope(out, pos, table)
            return
        tok = self._mark("gemm %dx%d+rope" % (ly.wqkv.shape[0], a.shape[1]))
        N, K = ly.wqkv.shape
        b = ly.bqkv if ly.bqkv is not None else self._zero_bias[:N]
        ws = _gm.pick(a.shape[0], N, a.dtype, out.dtype, K=K)
        if ws is not None:
            kern = _gm.gemm_manual_kernel(N, K, ws, ly.bqkv is not None, "none", 2 * self.d, False, a.dtype)
        else:
            cfg = _gemm.pick_config(a.shape[0], N, K)
            kern = _gemm.gemm_kernel(N, K, ly.bqkv is not None, "none", cfg, out.dtype, a.dtype, 2 * self.d)
        kern(a, ly.wqkv, b, out, pos, table[0], table[1])
        self._done(tok)

    def _geglu(self, a, wi, out):
        tok = self._mark("geglu %dx%d" % (wi.shape[0] // 2, a.shape[1]))
        if self.ops["geglu"] == "tilelang":
            Fd = wi.shape[0] // 2
            ws = _gm.pick(a.shape[0], Fd, a.dtype, out.dtype, geglu=True, K=a.shape[1])
            if ws is not None:
                _gm.gemm_manual_kernel(Fd, a.shape[1], ws, False, "none", 0, True, a.dtype)(a, wi, out)
            else:
                cfg = _geglu.pick_config(a.shape[0], Fd, a.shape[1])
                _geglu.geglu_kernel(Fd, a.shape[1], cfg, a.dtype)(a, wi, out)
        else:
            out.copy_(_geglu.geglu_ref(a, wi))
        self._done(tok)

    def _add_ln(self, x, r, norm, eps, y, mode):
        tok = self._mark("add_ln")
        wt, b = norm[0], norm[1]
        if self.ops["add_ln"] == "tilelang":
            rr = r if r is not None else self.R[:x.shape[0]]   # not read, but the host stub checks it
            _ln.add_ln_kernel(x.shape[1], mode, b is not None, eps, y.dtype, r_dtype=rr.dtype)(
                x, rr, wt, b if b is not None else wt, y)
        else:
            xn, yn = _ln.add_ln_ref(x, r, wt, b, eps, mode, y.dtype)
            if mode != "plain":
                x.copy_(xn)
            y.copy_(yn)
        self._done(tok)

    def _rope(self, qkv, pos, table):
        tok = self._mark("rope")
        cos, sin = table
        if self.ops["rope"] == "tilelang":
            _rope.rope_kernel(self.heads, dtype=qkv.dtype)(qkv, pos, cos, sin)
        else:
            qkv.copy_(_rope.rope_ref(qkv, pos, cos, sin, self.heads))
        self._done(tok)

    def _attention(self, qkv, v, heads, window, out):
        tok = self._mark("attention %s" % ("window %d" % window if window else "full %d heads" % heads))
        if self.ops["attention"] == "tilelang":
            _attn.attention_kernel(heads, window, self.attn_cfg, qkv.dtype)(qkv, v["cu"], v["tiles"], out)
        else:
            out.copy_(_attn.attention_dense(qkv, v["trow"], v["pos"], heads, window))
        self._done(tok)

    @torch.no_grad()
    def profile(self, rows: Sequence[Row], repeats: int = 3) -> dict:
        """GPU time per op kind of one eager forward of `rows` (one chunk): {bucket, tokens, total_ms,
        ops: {kind: ms}, other_ms}; needs CUDA. Medians over `repeats` runs."""
        rows = list(rows)
        self._check(rows)
        with self._lock:
            total = sum(len(r.ids) for r in rows)
            Tb = self.bucket_for(total, len(rows))
            _, g = self._stage(rows, Tb)
            self._ints[:self._int_size(Tb)].copy_(self._ints_host[:self._int_size(Tb)])
            self._body(Tb, g)
            runs = []
            for _ in range(repeats):
                self._prof = []
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                self._body(Tb, g)
                t1.record()
                torch.cuda.synchronize(self.device)
                ops: dict[str, float] = {}
                for kind, a, b in self._prof:
                    ops[kind] = ops.get(kind, 0.0) + a.elapsed_time(b)
                runs.append((t0.elapsed_time(t1), ops))
                self._prof = None
        runs.sort(key=lambda r: r[0])
        tot, ops = runs[len(runs) // 2]
        return {"bucket": Tb, "tokens": total, "rows": len(rows), "head_rows": g, "total_ms": tot, "ops": ops,
                "other_ms": tot - sum(ops.values())}

    # -- the forward over static buffers (what each graph captures) ------------------------------
    def _views(self, Tb: int) -> dict[str, torch.Tensor]:
        R = row_capacity(Tb)
        nt = -(-Tb // self.attn_cfg.bm) + R
        ints = self._ints
        o = 4 * Tb
        e = o + R + 2 + 2 * nt
        return {"ids": ints[0:Tb], "pos": ints[Tb:2 * Tb], "ttype": ints[2 * Tb:3 * Tb], "trow": ints[3 * Tb:o],
                "cu": ints[o:o + R + 2], "tiles": ints[o + R + 2:e].view(nt, 2), "gidx": ints[e:e + Tb]}

    def _int_size(self, Tb: int) -> int:
        R = row_capacity(Tb)
        return 5 * Tb + R + 2 + 2 * (-(-Tb // self.attn_cfg.bm) + R)

    def _body(self, Tb: int, g: int) -> None:
        """The encoder and head over bucket Tb; the head's last layer after its attention, and the scorer, on the
        g rows listed in gidx (marker and [CLS] tokens, then padding pointing at the scratch row T_max)."""
        v = self._views(Tb)
        X, Y, QKV, Ob, R = self.X[:Tb], self.Y[:Tb], self.QKV[:Tb], self.O[:Tb], self.R[:Tb]
        torch.index_select(self.emb, 0, v["ids"], out=X)
        self._add_ln(X, None, self.emb_norm, self.eps, Y, "inplace")
        n = len(self.layers)
        for i, ly in enumerate(self.layers):
            self._qkv(Y, ly, v["pos"], self.rope_tables[ly.rope], QKV)
            self._attention(QKV, v, self.heads, ly.window, Ob)
            self._gemm(Ob, ly.wo, ly.bo, R)
            self._add_ln(X, R, ly.mlp_norm, self.eps, Y, "add")
            G = self.G[:Tb * self.inter].view(Tb, self.inter)
            self._geglu(Y, ly.wi, G)
            self._gemm(G, ly.wo2, ly.bo2, R)
            if i + 1 < n:
                self._add_ln(X, R, self.layers[i + 1].attn_norm, self.eps, Y, "add")
            else:
                self._add_ln(X, R, self.final_norm, self.eps, Y, "add_inplace")
        X.add_(self.type_emb.index_select(0, v["ttype"]))
        hn = len(self.head_layers)
        h0 = self.head_layers[0]
        self._add_ln(X, None, h0.norm1[:2], h0.norm1[2], Y, "plain")
        F1 = self.G[:Tb * self.ffn].view(Tb, self.ffn)
        for j, hl in enumerate(self.head_layers):
            self._gemm(Y, hl.win, hl.bin, QKV)
            self._attention(QKV, v, self.head_heads, 0, Ob)
            if j + 1 == hn:
                self._head_tail(hl, v["gidx"][:g], g)
                return
            self._gemm(Ob, hl.wout, hl.bout, R)
            self._add_ln(X, R, hl.norm2[:2], hl.norm2[2], Y, "add")
            self._gemm(Y, hl.w1, hl.b1, F1, "relu")
            self._gemm(F1, hl.w2, hl.b2, R)
            nxt = self.head_layers[j + 1].norm1
            self._add_ln(X, R, nxt[:2], nxt[2], Y, "add")

    def _head_tail(self, hl: Any, gi: torch.Tensor, g: int) -> None:
        """The head's last layer after its attention, and the scorer, on the g gathered rows `gi` (token indices);
        their residual rows and scores are written back to X and S at those indices. The free QKV buffer holds
        the gathered residual (fp32) and attention output."""
        d = self.d
        flat = self.QKV.view(-1)
        Xg = flat.view(torch.float32)[:g * d].view(g, d)
        off = g * d * 4 // flat.element_size()
        Og = flat[off:off + g * d].view(g, d)
        torch.index_select(self.O, 0, gi, out=Og)
        torch.index_select(self.X, 0, gi, out=Xg)
        Rg, Yg = self.R[:g], self.Y[:g]
        Fg = self.G[:g * self.ffn].view(g, self.ffn)
        self._gemm(Og, hl.wout, hl.bout, Rg)
        self._add_ln(Xg, Rg, hl.norm2[:2], hl.norm2[2], Yg, "add")
        self._gemm(Yg, hl.w1, hl.b1, Fg, "relu")
        self._gemm(Fg, hl.w2, hl.b2, Rg)
        self._add_ln(Xg, Rg, self.scorer_norm[:2], self.scorer_norm[2], Yg, "add")
        Hg = self.G[:g * d].view(g, d)
        self._gemm(Yg, self.scorer_w1, self.scorer_b1, Hg, "gelu")
        self._gemm(Hg, self.scorer_w2, self.scorer_b2, self.Sg[:g])
        idx = gi.long()
        self.X.index_copy_(0, idx, Xg)
        self.S.index_copy_(0, idx, self.Sg[:g])

    def _tail_body(self, nb: int, kb: int, ints: torch.Tensor | None = None) -> torch.Tensor:
        ints = self._tail if ints is None else ints
        mk = ints[:nb * kb].view(nb, kb)
        cls = ints[nb * kb:nb * kb + nb]
        valid = mk >= 0
        s = self.S[:, 0]
        logits = s.index_select(0, mk.clamp(min=0).reshape(-1)).view(nb, kb).masked_fill(~valid, -1e4)
        feats = confidence_features(logits, valid)
        h0 = self.X.index_select(0, cls)
        act = self.act_head(torch.cat([h0, feats], -1)).float()
        return torch.cat([logits, torch.softmax(act, -1)[:, :1]], 1)

    # -- host side --------------------------------------------------------------------------------
    def bucket_for(self, tokens: int, rows: int) -> int:
        """The smallest token bucket holding `tokens` tokens in `rows` rows (ValueError if none does)."""
        for b in self.buckets:
            if b >= tokens and row_capacity(b) >= rows:
                return b
        raise ValueError("%d tokens in %d rows exceed the largest bucket (%d tokens, %d rows)"
                         % (tokens, rows, self.T_max, self.R_max))

    def _stage(self, rows: Sequence[Row], Tb: int, host: torch.Tensor | None = None) -> tuple[np.ndarray, int]:
        """Fill a host staging buffer (default: slot 0's) for one chunk; returns cu_seqlens (int64, n + 1) and the
        rows the head's last layer runs on (gather_capacity(Tb), or Tb when more tokens are read back)."""
        n = len(rows)
        lens = np.fromiter((len(r.ids) for r in rows), dtype=np.int64, count=n)
        total = int(lens.sum())
        R = row_capacity(Tb)
        nt = -(-Tb // self.attn_cfg.bm) + R
        st = (self._ints_host if host is None else host).numpy()
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        if all(r.arr is not None and len(r.arr) == len(r.ids) for r in rows):   # rows from SequenceBuilder
            np.concatenate([r.arr for r in rows], out=st[0:total])
        else:
            st[0:total] = np.fromiter(itertools.chain.from_iterable(r.ids for r in rows), dtype=np.int32,
                                      count=total)
        st[total:Tb] = self.pad_id
        starts = np.repeat(cu[:-1], lens)
        st[Tb:Tb + total] = np.arange(total) - starts
        st[Tb + total:2 * Tb] = 0
        st[2 * Tb:2 * Tb + total] = np.repeat(np.fromiter((r.qtype for r in rows), dtype=np.int64, count=n), lens)
        st[2 * Tb + total:3 * Tb] = 0
        st[3 * Tb:3 * Tb + total] = np.repeat(np.arange(n), lens)
        st[3 * Tb + total:4 * Tb] = -1
        o = 4 * Tb
        st[o:o + n + 1] = cu
        st[o + n + 1:o + R + 2] = total
        e = o + R + 2 + 2 * nt
        st[o + R + 2:e] = _attn.tile_table(lens, self.attn_cfg.bm, nt, empty_row=R).reshape(-1)
        # the tokens read back (every marker, every [CLS]), then the scratch row T_max; when they do not fit in the
        # gathered capacity (or repeat markers past Tb), every token of the bucket, in order
        ks = np.fromiter((len(r.markers) for r in rows), dtype=np.int64, count=n)
        k = int(ks.sum())
        gid = st[e:e + Tb]
        cap = gather_capacity(Tb)
        if k + n > cap:
            gid[:] = np.arange(Tb)
            return cu, Tb
        gid[:k] = np.fromiter(itertools.chain.from_iterable(r.markers for r in rows), dtype=np.int64, count=k) \
            + np.repeat(cu[:-1], ks)
        gid[k:k + n] = cu[:-1]
        gid[k + n:] = self.T_max
        return cu, cap

    @staticmethod
    def _stage_tail(rows: Sequence[Row], cu: np.ndarray, nb: int, kb: int, st: np.ndarray) -> None:
        """Write marker token indices [nb, kb] (-1 = none) and [CLS] token indices [nb] into st."""
        mk = st[:nb * kb].reshape(nb, kb)
        mk.fill(-1)
        for i, r in enumerate(rows):
            if r.markers:
                mk[i, :len(r.markers)] = np.asarray(r.markers, dtype=np.int64) + cu[i]
        cls = st[nb * kb:nb * kb + nb]
        cls.fill(0)
        cls[:len(rows)] = cu[:-1]

    def _check(self, rows: Sequence[Row]) -> None:
        for i, r in enumerate(rows):
            n = len(r.ids)
            if n == 0:
                raise ValueError("row %d has no tokens" % i)
            if n > self.max_len:
                raise ValueError("row %d has %d tokens; the fast backend takes at most %d tokens per row "
                                 "(max_len of this checkpoint)" % (i, n, self.max_len))
            if r.markers and (min(r.markers) < 0 or max(r.markers) >= n):
                raise ValueError("row %d has a marker outside its %d tokens" % (i, n))
            if r.qtype not in (0, 1, 2):
                raise ValueError("row %d has question type %r (expected 0, 1 or 2)" % (i, r.qtype))

    def _chunks(self, rows: Sequence[Row], max_tokens: int | None = None) -> list[Sequence[Row]]:
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError("max_chunk_tokens must be a positive integer, got %r" % (max_tokens,))
        cap = self.T_max if max_tokens is None else min(self.T_max, max_tokens)
        out, start, total = [], 0, 0
        for i, r in enumerate(rows):
            n = len(r.ids)
            if i > start and (total + n > cap or i - start >= self.R_max):
                out.append(rows[start:i])
                start, total = i, 0
            total += n
        out.append(rows[start:])
        return out

    def _side_run(self, fn, *args):
        if self.device.type != "cuda":
            return fn(*args)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            out = fn(*args)
        torch.cuda.current_stream(self.device).wait_stream(s)
        return out

    def _capture(self, fn, *args):
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            out = fn(*args)
        return g, out

    def _encoder(self, Tb: int, gb: int) -> None:
        if not self.use_graphs:
            self._body(Tb, gb)
            return
        g = self._graphs.get((Tb, gb))
        if g is None:
            if self._warm:
                self.stats.captures_after_warmup += 1
                log.warning("fast backend: capturing a graph for %d tokens after warm-up", Tb)
            # Every kernel's first call (module load, launch attributes) stays outside a capture: one real run
            # per tile regime (the GEMM tiles change at SMALL_M tokens) instead of one per bucket, so warm-up
            # captures the 8-per-octave buckets for about the cost of capturing alone (the GPU tests compare
            # graphs with eager runs).
            regime = (Tb <= _gemm.SMALL_M, gb <= _gemm.SMALL_M)
            if regime not in self._ran:
                self._side_run(self._body, Tb, gb)
                self._ran.add(regime)
            g, _ = self._capture(self._body, Tb, gb)
            self._graphs[(Tb, gb)] = g
            self.stats.graphs = len(self._graphs)
        g.replay()

    def _tail_run(self, nb: int, kb: int) -> torch.Tensor:
        if not self.use_graphs:
            return self._tail_body(nb, kb)
        ent = self._tail_graphs.get((nb, kb))
        if ent is None:
            if self._warm:
                self.stats.captures_after_warmup += 1
            self._side_run(self._tail_body, nb, kb)
            ent = self._capture(self._tail_body, nb, kb)
            self._tail_graphs[(nb, kb)] = ent
            self.stats.tail_graphs = len(self._tail_graphs)
        ent[0].replay()
        return ent[1]

    @torch.no_grad()
    def _launch_chunk(self, rows: Sequence[Row], slot: int) -> tuple[torch.Tensor, Any, int, int]:
        """Stage one chunk in host slot `slot` and queue its GPU work (encoder graph, tail, the copy of its
        outputs to pinned host memory) without waiting for it; returns (host outputs, done event, kmax, kb)."""
        n = len(rows)
        total = sum(len(r.ids) for r in rows)
        Tb = self.bucket_for(total, n)
        cuda = self.device.type == "cuda"
        ints_host, tail_host = self._slots[slot]
        if self._slot_done[slot] is not None:   # the chunk that last used this slot has read it
            self._slot_done[slot].synchronize()
        cu, gb = self._stage(rows, Tb, ints_host)
        size = self._int_size(Tb)
        self._ints[:size].copy_(ints_host[:size], non_blocking=True)
        self._encoder(Tb, gb)
        kmax = max((len(r.markers) for r in rows), default=0)
        nb = _pow2(n)
        kb = _pow2(kmax, 2)
        m = nb * (kb + 1)
        if kb <= self.K_max:
            self._stage_tail(rows, cu, nb, kb, tail_host.numpy())
            self._tail[:m].copy_(tail_host[:m], non_blocking=True)
            res = self._tail_run(nb, kb)
        else:  # more markers than any tail graph holds: run the (small) tail eagerly
            st = np.empty(m, dtype=np.int32)
            self._stage_tail(rows, cu, nb, kb, st)
            self.stats.eager_tails += 1
            res = self._tail_body(nb, kb, torch.from_numpy(st).to(self.device))
        # res is a static buffer the next chunk's tail overwrites: copy it out now (stream order keeps the copy
        # ahead of that overwrite)
        out = torch.empty((n, res.shape[1]), dtype=res.dtype, pin_memory=cuda)
        out.copy_(res[:n], non_blocking=cuda)
        done = None
        if cuda:
            done = torch.cuda.Event()
            done.record()
        self._slot_done[slot] = done
        self.stats.chunks += 1
        self.stats.tokens += total
        self.stats.padded_tokens += Tb
        return out, done, kmax, kb

    @staticmethod
    def _collect(pending: tuple[torch.Tensor, Any, int, int]) -> tuple[np.ndarray, np.ndarray]:
        out, done, kmax, kb = pending
        if done is not None:
            done.synchronize()
        o = out.numpy()
        return np.ascontiguousarray(o[:, :kmax]), np.ascontiguousarray(o[:, kb])

    def forward(self, rows: Sequence[Row], max_chunk_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows: (logits [N, kmax] float32 with -1e4 past each row's k, P(action 0) [N] float32). Rows are cut
        into chunks of at most min(T_max, max_chunk_tokens) tokens (a longer row is a chunk of its own)."""
        rows = list(rows)
        if not rows:
            return np.zeros((0, 0), np.float32), np.zeros((0,), np.float32)
        self._check(rows)
        kmax = max(len(r.markers) for r in rows)
        with self._lock:
            self.stats.forwards += 1
            # every chunk is queued before any is collected: while the GPU runs chunk k the host stages chunk
            # k + 1 (two staging slots; a slot is refilled only after its previous chunk's GPU work is done)
            pending = [self._launch_chunk(c, i % 2) for i, c in enumerate(self._chunks(rows, max_chunk_tokens))]
            parts = [self._collect(p) for p in pending]
        logits = np.full((len(rows), kmax), -1e4, dtype=np.float32)
        pos = 0
        for lg, _ in parts:
            logits[pos:pos + lg.shape[0], :lg.shape[1]] = lg
            pos += lg.shape[0]
        return logits, np.concatenate([p for _, p in parts]).astype(np.float32)

    @torch.no_grad()
    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Capture every token-bucket graph up to max_batch_tokens and every tail graph; returns seconds."""
        t = time.perf_counter()
        with self._lock:
            if max_batch_tokens:
                self._alloc(max_batch_tokens)
            if not self.use_graphs:
                # one real forward per kernel configuration: loads every module before traffic
                small = [b for b in self.buckets if b <= _gemm.SMALL_M]
                for Tb in sorted(set(small[-1:]) | {self.buckets[-1]}):
                    self._warm_rows(Tb)
            else:  # each capture is preceded by a real run of the same bucket (see _encoder)
                for Tb in reversed(self.buckets):   # largest first, so the pool is sized once
                    _, gb = self._stage(self._synthetic(Tb), Tb)
                    self._ints[:self._int_size(Tb)].copy_(self._ints_host[:self._int_size(Tb)])
                    for g in sorted({gb, Tb}):   # the gathered head's two capacities
                        if (Tb, g) not in self._graphs:
                            self._encoder(Tb, g)
                for nb in (1 << i for i in range(_pow2(self.R_max).bit_length())):
                    for kb in (1 << i for i in range(1, self.K_max.bit_length())):
                        if (nb, kb) not in self._tail_graphs:
                            self._tail_host[:nb * (kb + 1)].fill_(0)
                            self._tail[:nb * (kb + 1)].copy_(self._tail_host[:nb * (kb + 1)])
                            self._tail_run(nb, kb)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._warm = True
            self.stats.buckets = list(self.buckets)
        self.stats.warmup_s = time.perf_counter() - t
        return self.stats.warmup_s

    def _synthetic(self, Tb: int) -> list[Row]:
        """Rows that fill bucket Tb exactly (each at most max_len tokens, two markers)."""
        n = max(-(-Tb // self.max_len), 1)
        base, extra = divmod(Tb, n)
        return [Row([self.pad_id] * (base + (i < extra)), [0, 1], 0) for i in range(n)]

    def _warm_rows(self, Tb: int) -> None:
        rows = self._synthetic(Tb)
        _, gb = self._stage(rows, Tb)
        self._ints[:self._int_size(Tb)].copy_(self._ints_host[:self._int_size(Tb)])
        for g in sorted({gb, Tb}):
            self._side_run(self._body, Tb, g)


class FastBackend:
    """The `fast` backend: packed tokens, TileLang kernels, CUDA graphs (see the module docstring)."""

    name = "fast"
    packed = True

    def __init__(self, engine: FastForward):
        self.engine = engine
        self.device = engine.device
        self.max_tokens_per_row = engine.max_len

    def forward(self, rows: Sequence[Row], max_chunk_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows (see `Backend.forward`), in chunks of at most max_chunk_tokens tokens (default: the largest
        bucket), queued back to back."""
        return self.engine.forward(rows, max_chunk_tokens)

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Capture every graph for batches up to max_batch_tokens tokens; returns seconds spent."""
        return self.engine.warmup(max_batch_tokens)

    @property
    def chunk_tokens(self) -> int:
        """The most tokens one chunk holds (the largest bucket): a forward of more rows is cut into chunks of at
        most this many (or `max_chunk_tokens`), queued back to back (the host stages chunk k + 1 while the GPU
        runs chunk k)."""
        return self.engine.T_max

    @property
    def stats(self) -> FastStats:
        """Counters (graphs captured, captures after warm-up, tokens, padding)."""
        return self.engine.stats


def make_backend(model: torch.nn.Module, bundle: Any, device: torch.device, **options: Any) -> FastBackend:
    """The registered factory: a FastBackend, or BackendUnavailable naming why it cannot run here.

    Options: ops ("tilelang" | "torch" | {op: impl}), use_graphs, max_batch_tokens, compile_workers, attn_cfg,
    act_dtype (activations and GEMM weights: torch.bfloat16 or torch.float16 / "fp16"; on CUDA it defaults to the
    checkpoint's autocast dtype, see model.backends.base.cuda_amp_dtype)."""
    allowed = {"ops", "use_graphs", "max_batch_tokens", "compile_workers", "attn_cfg", "act_dtype"}
    unknown = set(options) - allowed
    if unknown:
        raise ValueError("unknown fast backend options %s (use %s)" % (sorted(unknown), sorted(allowed)))
    device = torch.device(device)
    if device.type != "cuda" and options.get("ops", "tilelang") != "torch":
        raise BackendUnavailable("the fast backend needs a CUDA device, got %s" % device)
    if device.type == "cuda" and options.get("act_dtype") is None and options.get("ops", "tilelang") != "torch":
        from model.backends.base import cuda_amp_dtype

        # the checkpoint's precision, like the eager, compile and aot backends and upstream Laya: amp_dtype
        # (bf16 in published checkpoints), $LAYA_FLEET_CUDA_AMP / $LAYA_CUDA_AMP, fp16 before compute capability 8
        options["act_dtype"] = cuda_amp_dtype(bundle.cfg, device)
    return FastBackend(FastForward(model, bundle, device, **options))


def flops_per_token(d: int, layers: int, inter: int, head_layers: int, ffn: int) -> float:
    """Matmul FLOPs per token of encoder + head + scorer (attention score/value terms excluded)."""
    enc = layers * 2.0 * (3 * d * d + d * d + 2 * inter * d + inter * d)
    head = head_layers * 2.0 * (3 * d * d + d * d + 2 * ffn * d)
    return enc + head + 2.0 * d * d


__all__ = ["FastForward", "FastBackend", "FastStats", "make_backend", "token_buckets", "row_capacity",
           "flops_per_token", "kernel_specs", "compile_specs", "BUILDERS", "OPS"]
