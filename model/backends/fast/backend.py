"""The `fast` backend: packed tokens, TileLang kernels, CUDA graphs per token bucket.

`FastForward` puts together the weights on the device (weights.py), the host-side packing (packing.py), the op
dispatch and layer body (forward.py) and the CUDA graphs (graphs.py); `FastBackend` is what the registry's
`make_backend` returns. `warmup(max_batch_tokens)` compiles every kernel and captures every graph up front.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kernels import _tl
from kernels import attention as _attn
from kernels.tuning import TABLE, Tuning
from model import settings
from model.backends import gpu_lock as _gpu_lock
from model.backends.base import HALF, BackendUnavailable, cuda_precision, dtype_named
from model.sequence import Row

from . import fp8 as _fp8
from .forward import ForwardOps
from .graphs import GraphRunner
from .packing import Packing
from .specs import OPS, PDL_MODES, compile_specs, kernel_specs, sm_count, spec_op, with_pdl
from .weights import DeviceWeights

DEFAULT_MAX_BATCH_TOKENS = 16384
def configure_tilelang(arch: str | None = None, pdl: str | None = None) -> str:
    """Point TileLang's kernel cache at this node's local cache dir (`model.cache.local_dir("tilelang")`) and
    set the target: `arch`, else $LAYA_FLEET_TL_ARCH, else the visible GPU's; returns the programmatic dependent
    launch mode (`pdl`, else $LAYA_FLEET_PDL: small, all or off), which kernel_specs and the forward read."""
    from model.cache import local_dir

    pdl = settings.get("LAYA_FLEET_PDL") if pdl is None else pdl
    if pdl not in PDL_MODES:
        raise ValueError("pdl is one of %s, got %r" % (", ".join(PDL_MODES), pdl))
    _tl.configure(cache_dir=local_dir("tilelang"), arch=arch or settings.get("LAYA_FLEET_TL_ARCH"),
                  pdl=pdl != "off")
    return pdl


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


class FastForward(ForwardOps, GraphRunner, Packing, DeviceWeights):
    """Static buffers, weights and CUDA graphs for the packed forward of one DecisionModel."""

    def __init__(self, model: torch.nn.Module, bundle: Any, device: torch.device, *, ops: str | dict = "tilelang",
                 use_graphs: bool | None = None, max_batch_tokens: int | None = None,
                 act_dtype: torch.dtype | None = None, attn_cfg: _attn.AttnConfig = _attn.DEFAULT,
                 compile_workers: int | None = None, tuning: Tuning = TABLE,
                 gpu_lock: _gpu_lock.GpuLock | None | str = "auto", fp8: bool = False, pdl: str | None = None):
        self.device = torch.device(device)
        if not isinstance(fp8, bool):   # a string such as "no" would read as on
            raise ValueError("fp8 is True or False, got %r" % (fp8,))
        if pdl is not None and pdl not in PDL_MODES:   # checked here too: the torch ops never read it
            raise ValueError("pdl is one of %s, got %r" % (", ".join(PDL_MODES), pdl))
        self.fp8 = fp8   # the encoder's GEMMs in e4m3 (fp8.py)
        if self.fp8:
            _fp8.check_device(self.device)
        self.ops = self._resolve_ops(ops)
        self.tuning = tuning
        uses_tl = "tilelang" in self.ops.values()
        if uses_tl:
            if self.device.type != "cuda":
                raise BackendUnavailable("the TileLang kernels need a CUDA device, got %s" % self.device)
            pdl = configure_tilelang(pdl=pdl)
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
        self.arch = _tl.target()["arch"] if uses_tl else "none"
        # which token buckets run the programmatic-dependent-launch builds (kernel_specs, _body)
        self.pdl = pdl if uses_tl and _tl.pdl_arch(self.arch) else "off"
        self.sms = sm_count(self.device) if self.device.type == "cuda" else 132
        self.pad_id = int(bundle.tokenizer.pad_token_id)
        self._load_weights(model, bundle)
        self.stats = FastStats()
        self._lock = threading.RLock()
        # held across processes from a forward's launch to its results ("auto": the CUDA device's, none on CPU)
        if isinstance(gpu_lock, str) and gpu_lock != "auto":
            raise ValueError("gpu_lock is 'auto', None or a GpuLock, got %r" % gpu_lock)
        self.gpu_lock = _gpu_lock.for_device(self.device) if gpu_lock == "auto" else gpu_lock
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

    def _kernel_specs(self) -> list[tuple[str, tuple]]:
        """Every (op, args) this model's forward launches through TileLang."""
        ly = self.layers[0]
        specs = kernel_specs(self.d, self.heads, self.inter, self.ffn, {x.window for x in self.layers}, self.eps,
                             {hl.norm1[2] for hl in self.head_layers} | {hl.norm2[2] for hl in self.head_layers}
                             | {self.scorer_norm[2]}, ly.bqkv is not None, ly.bo is not None,
                             self.emb_norm[1] is not None, self.attn_cfg, self.act_dtype, table=self.tuning,
                             arch=self.arch, sms=self.sms, pdl=self.pdl, max_tokens=self.T_max, ln_fold=self.fold)
        if self.fp8:
            specs += with_pdl(self._fp8_specs(), self.pdl)
        return [sp for sp in specs if self.ops[spec_op(sp)] == "tilelang"]

    def _fp8_specs(self) -> list[tuple[str, tuple]]:
        """The FP8 precision's kernels of this model (fp8.kernel_specs)."""
        ly = self.layers[0]
        return _fp8.kernel_specs(self.d, self.inter, (ly.bqkv is not None, ly.bo is not None, ly.bo2 is not None),
                                 self.act_dtype, arch=self.arch, sms=self.sms, table=self.tuning, eps=self.eps,
                                 norm_bias=self.emb_norm[1] is not None)

    def _compile_all(self, workers: int | None) -> None:
        try:
            compile_specs(self._kernel_specs(), workers)
        except Exception as e:  # nvcc missing, unsupported arch, a TileLang lowering error
            raise BackendUnavailable("compiling the TileLang kernels failed: %s: %s" % (type(e).__name__, e)) from e

    def _grown(self) -> None:
        """The buffers grew to larger buckets (warm-up with a larger budget): build the kernels only those run
        (kernel_specs' max_tokens), in parallel now rather than one by one at their first launch."""
        if "tilelang" in self.ops.values():
            t = time.perf_counter()
            self._compile_all(None)   # kernels already built come from the process's memo
            self.stats.compile_s += time.perf_counter() - t


class FastBackend:
    """The `fast` backend: packed tokens, TileLang kernels, CUDA graphs (see the module docstring)."""

    name = "fast"
    packed = True

    def __init__(self, engine: FastForward):
        self.engine = engine
        self.device = engine.device

    @property
    def precision(self) -> str:
        """What the forward computes in: "bfloat16" / "float16" / "float32" (the activations and GEMMs), or
        "fp8-e4m3" (the encoder's GEMMs in e4m3, the rest bfloat16)."""
        return "fp8-e4m3" if self.engine.fp8 else str(self.engine.act_dtype).removeprefix("torch.")

    @property
    def max_tokens_per_row(self) -> int:
        """The most tokens one row may hold (the encoder's positions, within the buffers): a body `max_len` above
        the checkpoint's is honoured as the eager backend and upstream's server honour it."""
        return self.engine.max_row_tokens

    def forward(self, rows: Sequence[Row], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows (see `Backend.forward`), in chunks of at most max_tokens tokens (default: the largest
        bucket), queued back to back."""
        return self.engine.forward(rows, max_tokens)

    def launch(self, rows: Sequence[Row]):
        """`forward(rows)` queued without waiting (`forward.Launched`: poll `ready()`, then `collect()`), or None
        when it takes more than one chunk or another forward is running (see `FastForward.launch`)."""
        return self.engine.launch(rows)

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Capture every graph for batches up to max_batch_tokens tokens; returns seconds spent."""
        return self.engine.warmup(max_batch_tokens)

    @property
    def chunk_tokens(self) -> int:
        """The most tokens one chunk holds (the largest bucket): a forward of more rows is cut into chunks of at
        most this many (or `max_tokens`), queued back to back (the host stages chunk k + 1 while the GPU
        runs chunk k)."""
        return self.engine.T_max

    @property
    def stats(self) -> FastStats:
        """Counters (graphs captured, captures after warm-up, tokens, padding)."""
        return self.engine.stats


def make_backend(model: torch.nn.Module, bundle: Any, device: torch.device, **options: Any) -> FastBackend:
    """The registered factory: a FastBackend, or BackendUnavailable naming why it cannot run here.

    Options: ops ("tilelang" | "torch" | {op: impl}), use_graphs, max_batch_tokens, compile_workers, attn_cfg,
    tuning (a kernels.tuning.Tuning table; default the committed one), gpu_lock (a model.backends.gpu_lock.GpuLock,
    or None for none; default the CUDA device's: one process's forward on a GPU at a time), act_dtype (activations
    and GEMM weights: torch.bfloat16 or torch.float16 / "fp16"; on CUDA it defaults to the checkpoint's autocast
    dtype, see model.backends.base.cuda_precision), fp8 (the encoder's GEMMs in e4m3, see fp8.py; on CUDA it defaults
    to the checkpoint's precision being fp8), pdl (which token buckets use programmatic dependent launch: "small",
    "all" or "off"; default $LAYA_FLEET_PDL)."""
    allowed = {"ops", "use_graphs", "max_batch_tokens", "compile_workers", "attn_cfg", "act_dtype", "tuning",
               "gpu_lock", "fp8", "pdl"}
    unknown = set(options) - allowed
    if unknown:
        raise ValueError("unknown fast backend options %s (use %s)" % (sorted(unknown), sorted(allowed)))
    device = torch.device(device)
    if device.type != "cuda" and options.get("ops", "tilelang") != "torch":
        raise BackendUnavailable("the fast backend needs a CUDA device, got %s" % device)
    if device.type == "cuda" and options.get("act_dtype") is None and options.get("ops", "tilelang") != "torch":
        # the checkpoint's precision, like the eager, compile and aot backends and upstream Laya: amp_dtype
        # (bf16 in published checkpoints), $LAYA_FLEET_CUDA_AMP / $LAYA_CUDA_AMP, fp16 before compute capability 8
        prec = cuda_precision(bundle.cfg, device)
        options["act_dtype"] = torch.float16 if prec == "fp16" else torch.bfloat16
        options.setdefault("fp8", prec == "fp8")
    return FastBackend(FastForward(model, bundle, device, **options))


def flops_per_token(d: int, layers: int, inter: int, head_layers: int, ffn: int) -> float:
    """Matmul FLOPs per token of encoder + head + scorer (attention score/value terms excluded)."""
    enc = layers * 2.0 * (3 * d * d + d * d + 2 * inter * d + inter * d)
    head = head_layers * 2.0 * (3 * d * d + d * d + 2 * ffn * d)
    return enc + head + 2.0 * d * d


__all__ = ["FastForward", "FastBackend", "FastStats", "make_backend", "configure_tilelang", "flops_per_token"]
