"""`compile` (torch.compile) and `aot` (AOTInductor package) backends over the padded DecisionModel.

Shapes. Every batch is right-padded so that tokens are a multiple of 16 (at least 32) and markers at
least 2, and both are declared dynamic; rows are marked dynamic softly (inductor on CUDA may bound them
for a grid limit, which a declared range would turn into a compile error). The `compile` backend
passes tokens as a [rows, tokens/16, 16] view that the graph flattens back, so inductor knows
symbolically that L is a multiple of 16; that is what lets it hand ModernBERT's [rows, 1, L, L]
attention bias to the SDPA kernel as a broadcast view instead of materialising rows x heads x L x L
(its stride-alignment rule needs L % 8 == 0 to be provable). `aot` declares the same with
`torch.export.Dim` (tokens = 16 * t). Padding tokens/16, markers and (for `compile`) rows away from 1
avoids torch's 0/1 specialisation on those axes: a one-row batch is padded with a copy of its row and
runs in the batch graph, so `compile` builds a single graph in `warmup()` that serves every batch
(`single_row_graph=True` keeps a separate static single-row graph, two graphs to build). Duck sizing is
switched off while a compiled call runs, so equal sizes at trace time never tie axes.

Precision. CPU runs fp32 (answers within ~1e-5 of eager). On CUDA, `compile` keeps fp32 weights under
autocast in the checkpoint's half dtype like the eager backend (`cuda_amp_dtype`: its `amp_dtype`, or
$LAYA_FLEET_CUDA_AMP; fp32 residual stream), and `aot` packages a copy of the parameters in that dtype with
no autocast (the dtype-explicit action head is what makes that export work); RoPE buffers stay fp32.

Caches. `model.load` points inductor / Triton at node-local dirs and seeds them from the shared cache
before this backend compiles (`model.cache`); AOTI packages are keyed per (checkpoint, arch, torch,
CUDA, dtype), built by `laya-fleet aot` (or on a miss when `build=True` / LAYA_FLEET_AOT_BUILD=1) and
loaded with `torch._inductor.aoti_load_package`, which compiles nothing.
"""

from __future__ import annotations

import abc
import copy
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .. import cache as _cache
from ..sequence import Row
from .base import BackendUnavailable, collate, cuda_amp_dtype, dtype_named, outputs

log = logging.getLogger(__name__)

ALIGN = 16
MIN_TOKENS = 2 * ALIGN  # tokens/16 >= 2: a size-1 axis would be specialised
MIN_MARKERS = 2
MAX_ROWS = 1 << 20
PACKAGE = "model.pt2"
AOT_BUILD_ENV = "LAYA_FLEET_AOT_BUILD"
# (rows, tokens, markers): one batch graph and one single-row graph, pairwise-different sizes
WARMUP_SHAPES = ((3, 80, 4), (1, 48, 5))
WARMUP_MANY_ROWS = (512, 32, 2)
# Inductor's pad_mm pass asks "is this matmul compute bound?" of the symbolic rows x tokens size and guards
# on the answer (seen on CUDA: `2 <= rows <= 255`), so a dynamic graph gets split by row count: a third
# graph and another ~40 s of cold compile per split on an H200. The GEMM shapes here are already
# multiples of 16, so padding buys nothing.
INDUCTOR_CONFIG = {"shape_padding": False}


def _ceil(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_batch(rows: Sequence[Row], pad_id: int, min_rows: int = 1) -> tuple[dict[str, torch.Tensor], int]:
    """Collated tensors with tokens padded to a multiple of 16 (>= 32), markers to >= 2, rows to >= `min_rows`.

    Returns (tensors, the rows' real maximum marker count). Padding tokens are masked out and padding
    markers are masked (their logits are -1e4); padding rows repeat the last row and are dropped from the
    outputs, so answers do not change.
    """
    rows = list(rows)
    if len(rows) < min_rows:
        rows += [rows[-1]] * (min_rows - len(rows))
    b = collate(rows, pad_id)
    L = b["input_ids"].shape[1]
    Lp = max(MIN_TOKENS, _ceil(L, ALIGN))
    if Lp != L:
        b["input_ids"] = F.pad(b["input_ids"], (0, Lp - L), value=pad_id)
        b["attention_mask"] = F.pad(b["attention_mask"], (0, Lp - L), value=0)
    K = b["marker_pos"].shape[1]
    if K < MIN_MARKERS:
        b["marker_pos"] = F.pad(b["marker_pos"], (0, MIN_MARKERS - K), value=0)
        b["marker_mask"] = F.pad(b["marker_mask"], (0, MIN_MARKERS - K), value=False)
    return b, K


def _synthetic_rows(n: int, tokens: int, markers: int, fill_id: int) -> list[Row]:
    return [Row([fill_id] * tokens, list(range(1, markers + 1)), i % 3) for i in range(n)]


def half_copy(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A copy whose floating-point parameters are `dtype`; buffers (RoPE frequencies) stay as they are."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return m


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`half_copy` in bf16."""
    return half_copy(model, torch.bfloat16)


class _Padded(abc.ABC):
    """Shared glue: pad, run under a lock, slice markers back, convert outputs."""

    name = "padded"
    packed = False

    def __init__(self, bundle: Any, device: torch.device):
        self.device = device
        self.pad_id = bundle.tokenizer.pad_token_id
        self.fill_id = bundle.tokenizer.cls_token_id
        self.max_tokens_per_row = bundle.max_len
        self.t_max = max(2, _ceil(bundle.max_len, ALIGN) // ALIGN)
        self.k_max = max(MIN_MARKERS, bundle.max_len)
        self._lock = threading.Lock()
        self.warmup_s = 0.0
        self.min_rows = 1

    @abc.abstractmethod
    def _run(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled forward on a padded batch: (logits, act_logits) on the device."""

    @torch.no_grad()
    def forward(self, rows: Sequence[Row]) -> tuple[np.ndarray, np.ndarray]:
        """Score rows (see `Backend.forward`)."""
        n = len(rows)
        b, k = padded_batch(rows, self.pad_id, self.min_rows)
        b = {name: t.to(self.device, non_blocking=True) for name, t in b.items()}
        with self._lock:
            logits, act = self._run(b)
            return outputs(logits[:n, :k], act[:n])

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Run the warm-up shapes (batch and single row); returns seconds spent."""
        t = time.perf_counter()
        for n, tokens, markers in WARMUP_SHAPES:
            self.forward(_synthetic_rows(n, min(tokens, self.max_tokens_per_row), markers, self.fill_id))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t
        return self.warmup_s


# -- torch.compile ----------------------------------------------------------------------------------
PRECOMPILE_ENV = "LAYA_FLEET_COMPILE_PRECOMPILE"


class _AlignedGraph(torch.nn.Module):
    """The compiled graph's module for precompile (module level: torch pickles a reference to it): tokens arrive
    as [rows, tokens/16, 16] views, as in `CompileBackend._graph_aligned`.

    Autocast, where the backend uses it, is entered inside the graph, not around the call: a saved graph's
    guards check each input's dispatch keys, and an autocast context around the call adds AutocastCUDA to them,
    so a graph saved that way refused every batch in the process that loaded it (H200, torch 2.11)."""

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None = None, device_type: str = "cuda"):
        super().__init__()
        self.model = model
        self.autocast = autocast
        self.device_type = device_type

    def forward(self, ids3, att3, mpos, mmask, qtype):
        if self.autocast is None:
            return self.model(ids3.flatten(1), att3.flatten(1), mpos, mmask, qtype)
        with torch.autocast(self.device_type, dtype=self.autocast):
            return self.model(ids3.flatten(1), att3.flatten(1), mpos, mmask, qtype)


REGIONAL_ENV = "LAYA_FLEET_COMPILE_REGIONAL"


def _aligned_layer_step(h4, cos3, sin3, mask, p, eps: float, heads: int, head_dim: int):
    """`native.layer_step` on [rows, tokens/16, 16, ...] views that it flattens back, so inductor knows the
    token count is a multiple of 16 inside the region as it does in the whole graph (see the module doc)."""
    from ..native import layer_step

    B, t, a, d = h4.shape
    mask = mask.flatten(-2) if mask.dim() == 5 else mask.flatten(-2).flatten(2, 3)
    return layer_step(h4.reshape(B, t * a, d), cos3.flatten(0, 1), sin3.flatten(0, 1), mask, p, eps, heads,
                      head_dim)


class _RegionalStep:
    """The encoder's per-layer function, compiled once per kind of layer (regional compilation).

    `torch.compile` of the whole model traces and lowers every layer: on the H200 hosts a cold compile of
    mmBERT-base (22 layers) took 51-109 s of warm-up, nearly all of it single-threaded tracing and lowering.
    A layer is a plain function of tensors (`native.layer_step`, parameters passed in), so all layers of one
    kind share a graph: three graphs (layer 0, whose norm is the identity; full attention; windowed
    attention) whatever the depth. Embeddings, masks, RoPE tables, the final norm and the decision head run
    eagerly around them. Inputs are passed as multiple-of-16 views with rows and tokens/16 dynamic."""

    def __init__(self, mode: str | None = None):
        self.fn = torch.compile(_aligned_layer_step, fullgraph=True, dynamic=False, mode=mode)
        self._kinds: set[tuple[bool, bool]] = set()  # kinds of layer whose graph exists (marks only until then)

    def __call__(self, h, cos, sin, mask, p, eps, heads, head_dim):
        B, L, d = h.shape
        t = L // ALIGN
        h4 = h.view(B, t, ALIGN, d)
        cos3, sin3 = cos.view(t, ALIGN, -1), sin.view(t, ALIGN, -1)
        full = mask.shape[2] == 1
        m = mask.view(B, 1, 1, t, ALIGN) if full else mask.view(B, 1, t, ALIGN, t, ALIGN)
        kind = (full, p[0] is None)
        if kind not in self._kinds:  # the call that compiles this kind's graph: rows and tokens/16 dynamic
            for x, ds in ((h4, (0, 1)), (cos3, (0,)), (sin3, (0,)), (m, (0, 3) if full else (0, 2, 4))):
                for dim in ds:
                    torch._dynamo.maybe_mark_dynamic(x, dim)
            out = self.fn(h4, cos3, sin3, m, p, eps, heads, head_dim)
            self._kinds.add(kind)
            return out
        return self.fn(h4, cos3, sin3, m, p, eps, heads, head_dim)


class CompileBackend(_Padded):
    """torch.compile over the whole DecisionModel with dynamic rows, tokens (x16) and markers."""

    name = "compile"

    def __init__(self, model: torch.nn.Module, bundle: Any, device: torch.device, align: bool = True,
                 mode: str | None = None, dtype: torch.dtype | str | None = None, fullgraph: bool = True,
                 single_row_graph: bool = False, precompile: bool | None = None,
                 regional: bool | str | None = None):
        super().__init__(bundle, device)
        self.precompile = (os.environ.get(PRECOMPILE_ENV, "1") != "0") if precompile is None else bool(precompile)
        if regional is None:
            env = os.environ.get(REGIONAL_ENV, "auto").strip().lower() or "auto"
            if env not in ("0", "1", "auto"):
                raise ValueError("%s=%r: use 0, 1 or auto" % (REGIONAL_ENV, env))
            regional = {"0": False, "1": True}.get(env, "auto")
        self.regional = regional if regional == "auto" else bool(regional)
        self.regional_choice = "auto" if regional == "auto" else "set"
        self.precompile_state = "off"
        self.precompile_misses = 0  # batches the precompiled graph's guards refused (served by tracing)
        self._pre: Any = None  # the precompiled graph (torch.compile'd _AlignedGraph with a loaded AOT forward)
        # A batch of one row runs in the batch graph, padded to two rows (a size-1 axis would be specialised
        # into a graph of its own): one graph to compile cold and to re-trace warm instead of two. A second
        # row costs nothing measurable at that size; single_row_graph=True keeps the separate graph.
        self.min_rows = 1 if single_row_graph else 2
        if dtype is not None:
            dtype = dtype_named(dtype, "dtype")
        self.align = bool(align)
        if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
            model = half_copy(model, dtype)
            self.autocast = None
        elif device.type == "cuda" and dtype is None:
            # the eager CUDA path's numerics: fp32 weights under the checkpoint's autocast dtype
            self.autocast = cuda_amp_dtype(bundle.cfg, device)
        else:
            self.autocast = None
        self.model = model.to(device).eval()
        self.mode = mode
        self.fullgraph = fullgraph
        self.strict = True
        from ..native import NativeModernBert

        if self.regional is True and not self.align:
            raise ValueError("regional compilation feeds its layers [rows, tokens/16, 16] views: it needs align=True")
        if self.regional == "auto" and not self.align:
            self.regional, self.regional_choice = False, "auto: whole graph (align=False)"
        if self.regional == "auto":
            # the whole graph when its precompiled form is already here (seeded from the shared cache: a warm
            # start without tracing and the cheaper calls), else one graph per kind of layer (a cold compile
            # about half as long, a warm start that re-traces three small graphs)
            self.regional = False
            path = self.precompile_path()
            self.regional = not (path is not None and os.path.isfile(path))
            self.regional_choice = "auto: %s" % ("regional (no precompiled whole graph in the cache)"
                                                 if self.regional else "whole graph (precompiled in the cache)")
            log.info("compile backend: %s", self.regional_choice)
        if self.regional and not isinstance(getattr(self.model, "encoder", None), NativeModernBert):
            log.warning("compile backend: regional compilation needs the native encoder; compiling the whole model")
            self.regional = False
        if self.regional:
            self.model.encoder.step = _RegionalStep(mode)
            self._compiled = None
        else:
            self._compiled = self._compile(fullgraph)

    def _compile(self, fullgraph: bool):
        fn = self._graph_aligned if self.align else self._graph_plain
        return torch.compile(fn, dynamic=False, fullgraph=fullgraph, mode=self.mode)

    def _graph_aligned(self, ids3, att3, mpos, mmask, qtype):
        return self.model(ids3.flatten(1), att3.flatten(1), mpos, mmask, qtype)

    def _graph_plain(self, ids, att, mpos, mmask, qtype):
        return self.model(ids, att, mpos, mmask, qtype)

    def _args(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Fresh input views, marked: rows soft (>= 2), tokens/16 and markers declared while `strict`."""
        ids, att = b["input_ids"], b["attention_mask"]
        n = ids.shape[0]
        if self.align:
            ids, att = ids.view(n, -1, ALIGN), att.view(n, -1, ALIGN)
            tok = (2, self.t_max)
        else:
            ids, att = ids.view(ids.shape), att.view(att.shape)
            tok = (MIN_TOKENS, self.t_max * ALIGN)
        args = (ids, att, *(b[k].view(b[k].shape) for k in ("marker_pos", "marker_mask", "qtype")))
        if n > 1:  # (single_row_graph=True) a single row stays static: its own graph
            for t in args:
                # soft: inductor may bound rows (on CUDA it guarded rows <= 255, a grid limit, for
                # mmBERT-base), and a declared range would then fail the compile
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for i, t in enumerate(args[:4]):
            lo, hi = tok if i < 2 else (MIN_MARKERS, self.k_max)
            if self.strict:  # a specialisation fails loudly, once, at warm-up
                torch._dynamo.mark_dynamic(t, 1, min=lo, max=hi)
            else:
                torch._dynamo.maybe_mark_dynamic(t, 1)
        return args

    def _run(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.regional:  # the model runs eagerly; its layers call the compiled step
            args = (b["input_ids"], b["attention_mask"], b["marker_pos"], b["marker_mask"], b["qtype"])
            return self._call(args, self.model)
        if self._pre is not None:
            n = b["input_ids"].shape[0]
            args = (b["input_ids"].view(n, -1, ALIGN), b["attention_mask"].view(n, -1, ALIGN), b["marker_pos"],
                    b["marker_mask"], b["qtype"])
            try:
                return self._call(args, self._pre, autocast=False)  # the saved graph enters autocast itself
            except RuntimeError as e:
                if "GuardManager check failed" not in str(e):
                    raise
                # a shape outside what the saved graph was specialised for (inductor may bound rows on CUDA):
                # the traced path serves it (its graph comes from the FX cache or is compiled once)
                self.precompile_misses += 1
                if self.precompile_misses == 1:
                    log.warning("compile backend: the precompiled graph's guards refused a batch of %s (%s); "
                                "such batches are traced", tuple(args[0].shape), str(e).splitlines()[0][:200])
        try:
            return self._call(self._args(b))
        except Exception as e:
            if self.strict and "Constraints violated" in str(e):
                log.warning("compile backend: inductor specialised a declared axis (%s); declaring tokens and "
                            "markers softly, expect a recompile where it guards", str(e).splitlines()[0][:300])
                self.strict = False
                return self._call(self._args(b))
            if not isinstance(e, torch._dynamo.exc.Unsupported) or not self.fullgraph:
                raise
            # another transformers version may break the graph somewhere; still compile, in pieces
            log.warning("compile backend: no single graph (%s); compiling with graph breaks",
                        str(e).splitlines()[0][:200])
            self.fullgraph = False
            self._compiled = self._compile(False)
            return self._call(self._args(b))

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Build the batch and single-row graphs (on CUDA also a many-rows batch, in case inductor bounded
        rows for a grid limit); returns seconds spent."""
        t = time.perf_counter()
        self._setup_precompiled()
        super().warmup(max_batch_tokens)
        if self.device.type == "cuda":
            n, tokens, markers = WARMUP_MANY_ROWS
            self.forward(_synthetic_rows(n, tokens, markers, self.fill_id))
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t
        return self.warmup_s

    def _call(self, args, fn=None, autocast: bool = True):
        import contextlib

        from torch._inductor import config as inductor_config

        fn = self._compiled if fn is None else fn
        with torch.fx.experimental._config.patch(use_duck_shape=False), inductor_config.patch(INDUCTOR_CONFIG):
            with self._autocast() if autocast else contextlib.nullcontext():
                return fn(*args)

    def _autocast(self):
        import contextlib

        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    # -- precompile: the traced graph and its guards saved, so a warm start does not re-trace ------------------
    def precompile_path(self) -> str | None:
        """Where this model's precompiled graph lives: inside the node-local inductor dir (so it is published to
        and seeded from the shared cache with the FX graphs, under the same checkpoint / version / arch key),
        named by the options that change the graph. None where precompile does not apply."""
        import hashlib
        import json

        from ..native import NativeModernBert

        root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        if (not self.precompile or self.regional or not self.align or not self.fullgraph or self.mode is not None
                or not root
                or not isinstance(getattr(self.model, "encoder", None), NativeModernBert)):
            return None  # transformers' module cannot be precompiled: its guards are object-identity checks
        try:
            from torch._dynamo.aot_compile import ModelInput  # noqa: F401 - experimental, torch >= 2.10 or so
        except ImportError:
            return None
        # the saved graph is our traced code: the inductor artifact dir is keyed by the model sources already
        # (cache.code_fingerprint); the name repeats it for an inductor dir set by hand
        key = json.dumps([torch.__version__, self.device.type, str(self.autocast), str(self._param_dtype()),
                          self.min_rows, self.t_max, self.k_max, MIN_TOKENS, MIN_MARKERS, INDUCTOR_CONFIG,
                          _cache.code_fingerprint("model")])
        return os.path.join(root, "laya_precompiled", hashlib.sha256(key.encode()).hexdigest()[:32] + ".bin")

    def _param_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _setup_precompiled(self) -> None:
        """Load this model's precompiled graph, or build and save it; on any failure the traced path serves."""
        path = self.precompile_path()
        if path is None or self._pre is not None:
            return
        from torch._inductor import config as inductor_config

        graph = torch.compile(_AlignedGraph(self.model, self.autocast, self.device.type), fullgraph=True,
                              dynamic=False)
        t = time.perf_counter()
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True), torch.no_grad():
                if os.path.isfile(path):
                    with open(path, "rb") as fh:
                        graph._load_aot_compiled_module(fh.read())
                    self.precompile_state = "loaded"
                else:
                    from torch._dynamo.aot_compile import ModelInput

                    n, tokens, markers = WARMUP_SHAPES[0]
                    b, _ = padded_batch(_synthetic_rows(n, min(tokens, self.max_tokens_per_row), markers,
                                                        self.fill_id), self.pad_id, self.min_rows)
                    args = self._args({k: v.to(self.device) for k, v in b.items()})
                    with torch.fx.experimental._config.patch(use_duck_shape=False), \
                            inductor_config.patch(INDUCTOR_CONFIG):
                        graph._aot_compile([ModelInput(args, {}, [])])
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    tmp = "%s.%d.tmp" % (path, os.getpid())
                    graph._save_aot_compiled_module(tmp)
                    os.replace(tmp, path)
                    self.precompile_state = "built"
        except Exception as e:  # noqa: BLE001 - experimental torch API: the traced path still works
            log.warning("compile backend: precompile unavailable (%s: %s); tracing instead", type(e).__name__,
                        str(e).splitlines()[0][:200] if str(e) else "")
            self.precompile_state = "failed: %s" % type(e).__name__
            return
        self._pre = graph
        log.info("compile backend: precompiled graph %s in %.1fs (%s)", self.precompile_state,
                 time.perf_counter() - t, path)


def make_compile_backend(model: torch.nn.Module, bundle: Any, device: torch.device, **options: Any) -> CompileBackend:
    """The `compile` backend (options: align=True, mode=None, dtype=None|"bf16", fullgraph=True,
    single_row_graph=False, precompile=None: $LAYA_FLEET_COMPILE_PRECOMPILE, default on, regional=None:
    $LAYA_FLEET_COMPILE_REGIONAL, default "auto": the whole graph when its precompiled form is already in the
    (seeded) cache, else one graph per kind of encoder layer (a cold compile in a fraction of the time); 1 or
    True: always regional; 0 or False: always the whole graph)."""
    known = {"align", "mode", "dtype", "fullgraph", "single_row_graph", "precompile", "regional"}
    return CompileBackend(model, bundle, device, **{k: v for k, v in options.items() if k in known})


# -- AOTInductor ------------------------------------------------------------------------------------
def aot_dtype(bundle: Any, device: torch.device) -> torch.dtype:
    """The package's parameter dtype: the checkpoint's CUDA autocast dtype (`cuda_amp_dtype`) on CUDA, fp32 on
    CPU."""
    device = torch.device(device)
    return cuda_amp_dtype(bundle.cfg, device) if device.type == "cuda" else torch.float32


def aot_variant(device: torch.device, dtype: torch.dtype | None = None) -> str:
    """The package's dtype variant: bf16 / fp16 parameters on CUDA (bf16 when not given), fp32 on CPU."""
    if torch.device(device).type != "cuda":
        return "fp32"
    return {torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "bf16")


def aot_key(checkpoint_hash: str, device: torch.device, dtype: torch.dtype | None = None) -> _cache.ArtifactKey:
    """The shared-cache key of a checkpoint's AOTI package for this device (arch, torch, CUDA, dtype)."""
    return _cache.artifact_key("aoti", checkpoint_hash, device, variant=aot_variant(device, dtype))


def export_model(model: torch.nn.Module, bundle: Any, device: torch.device):
    """torch.export of the model for `device` with dynamic rows, tokens (16 * t) and markers; returns the
    ExportedProgram (parameters in the checkpoint's half dtype on CUDA, `aot_dtype`; no autocast)."""
    from torch.export import Dim

    device = torch.device(device)
    m = (half_copy(model, aot_dtype(bundle, device)) if device.type == "cuda" else model).to(device).eval()
    t_max = max(2, _ceil(bundle.max_len, ALIGN) // ALIGN)
    rows = Dim("rows", min=1, max=MAX_ROWS)
    t = Dim("t", min=2, max=t_max)
    k = Dim("k", min=MIN_MARKERS, max=max(MIN_MARKERS, bundle.max_len))
    tokens = ALIGN * t
    ds = {"input_ids": {0: rows, 1: tokens}, "attention_mask": {0: rows, 1: tokens},
          "marker_pos": {0: rows, 1: k}, "marker_mask": {0: rows, 1: k}, "qtype": {0: rows}}
    n, L, K = WARMUP_SHAPES[0]
    b, _ = padded_batch(_synthetic_rows(n, min(L, bundle.max_len), K, bundle.tokenizer.cls_token_id),
                        bundle.tokenizer.pad_token_id)
    args = tuple(b[x].to(device) for x in ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype"))
    with torch.no_grad():
        return torch.export.export(m, args, dynamic_shapes=ds)


def _ensure_configured(cache_dir: str | None) -> _cache.CacheSession:
    cur = _cache.current()
    if cur is not None and (cache_dir is None or cur.cache_dir == _cache.resolve_cache_dir(cache_dir)):
        return cur
    return _cache.configure(cache_dir)


def local_package_path(key: _cache.ArtifactKey, cache_dir: str | None = None) -> str:
    """Where this node keeps the package for `key`: `<local>/aoti/<key name>/model.pt2`."""
    return os.path.join(_cache.local_dir("aoti", cache_dir), key.name, PACKAGE)


def build_aot_package(checkpoint: str, cache_dir: str | None = None, device: str | torch.device = "cuda",
                      model: torch.nn.Module | None = None, bundle: Any = None, force: bool = False) -> str:
    """Export and package a checkpoint with AOTInductor and publish it to the shared cache.

    Idempotent: a valid package already in the shared cache (or this node's) is reused unless `force`.
    Returns the package path in the shared cache when it is there, else the node-local path.
    """
    from ..bundle import checkpoint_hash, load_model, open_bundle

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("AOTI package for CUDA asked, but CUDA is not available (use --device cpu)")
    session = _ensure_configured(cache_dir)
    bundle = bundle or open_bundle(checkpoint)
    key = aot_key(checkpoint_hash(bundle.path), dev, aot_dtype(bundle, dev))
    shared = session.shared
    local = local_package_path(key, session.cache_dir)
    shared_pkg = os.path.join(shared.path(key), PACKAGE)
    if not force:
        if shared.state(key) == "valid":
            return shared_pkg
        if os.path.isfile(local):
            status = shared.publish(key, os.path.dirname(local), files=[PACKAGE])
            return shared_pkg if status in ("published", "replaced", "exists") else local
    t0 = time.perf_counter()
    model = model if model is not None else load_model(bundle)
    ep = export_model(model, bundle, dev)
    t1 = time.perf_counter()
    os.makedirs(os.path.dirname(local), exist_ok=True)
    tmp = "%s.%d.tmp.pt2" % (local, os.getpid())
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=tmp, inductor_configs=dict(INDUCTOR_CONFIG))
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("AOTI package for %s on %s: export %.1fs, compile %.1fs -> %s", bundle.path, dev, t1 - t0,
             time.perf_counter() - t1, local)
    status = shared.publish(key, os.path.dirname(local), files=[PACKAGE])
    return shared_pkg if status in ("published", "replaced", "exists") else local


def _promote_libstdcxx() -> str | None:
    """Make this process's libstdc++ part of the global symbol scope (dlopen RTLD_GLOBAL); returns its path.

    An AOTI package's wrapper .so built by a toolchain that links libstdc++ statically (inductor's g++ on the H200
    host: /opt/gcc) exports its own copy of libstdc++'s symbols. Python loads torch, and with it the process's
    libstdc++, with RTLD_LOCAL, so when the package is dlopen'ed its locale/facet code binds partly to its own
    copy and partly to the process's: the first std::regex it builds (parsing the device string "cuda:0")
    calls through a null facet and the process dies with SIGSEGV (bench/aot_probe.py --native-trace). With the
    process's libstdc++ global, every such symbol binds to the one copy (the same as LD_PRELOAD, which fixed it
    on the H200: bench/results/aot_probe_h200_preload.json)."""
    import ctypes

    path = None
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            for line in fh:
                name = line.split()[-1] if line.strip() else ""
                if os.path.basename(name).startswith("libstdc++.so"):
                    path = name
                    break
    except OSError:
        return None
    if path is None:
        import ctypes.util

        path = ctypes.util.find_library("stdc++")
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
    except OSError as e:
        log.warning("could not make %s global before loading an AOTI package: %s", path, e)
        return None
    return path


def load_aoti_package(package: str, device_index: int = -1) -> Any:
    """`torch._inductor.aoti_load_package` with this process's libstdc++ made global first (see
    `_promote_libstdcxx`) and, for a CUDA package, without inductor's CPU ISA probe: torch compares the package's
    CPU ISA with this machine's for a warning only, and finding this machine's compiles test programs and dlopens
    each in a fresh Python (about 35 of a 42 s load on the H200 host, cProfile)."""
    import torch._inductor.codecache as codecache

    _promote_libstdcxx()
    if device_index < 0:  # a CPU package: keep torch's ISA comparison
        return torch._inductor.aoti_load_package(package)

    def without_cpu_isa(device_type: str) -> dict:
        """torch's get_device_information less the CPU ISA (missing keys are not compared)."""
        import platform
        import sys

        from torch._dynamo.device_interface import get_interface_for_device

        return {"AOTI_PLATFORM": sys.platform, "AOTI_MACHINE": platform.machine(),
                "AOTI_COMPUTE_CAPABILITY": str(get_interface_for_device(device_type).get_compute_capability())}

    import torch.export.pt2_archive._package as pkg_mod

    holders = [m for m in (codecache, pkg_mod) if hasattr(m, "get_device_information")]
    with _LOAD_LOCK:
        saved = [(m, m.get_device_information) for m in holders]
        for m in holders:
            m.get_device_information = without_cpu_isa
        try:
            return torch._inductor.aoti_load_package(package, device_index=device_index)
        finally:
            for m, f in saved:
                m.get_device_information = f


_LOAD_LOCK = threading.Lock()


class AotBackend(_Padded):
    """A loaded AOTInductor package; no compilation happens in this process."""

    name = "aot"

    def __init__(self, package: str, bundle: Any, device: torch.device, also: Sequence[str] = ()):
        super().__init__(bundle, device)
        t = time.perf_counter()
        index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else -1
        self.package = package
        self.load_check = check_package_loads(package, index, also=also)
        self.runner = load_aoti_package(package, index)
        self.load_s = time.perf_counter() - t

    def _run(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.runner(b["input_ids"], b["attention_mask"], b["marker_pos"], b["marker_mask"], b["qtype"])
        return out[0], out[1]


LOAD_CHECK_ENV = "LAYA_FLEET_AOT_LOAD_CHECK"


def check_package_loads(package: str, device_index: int = -1, timeout_s: float = 600.0,
                        also: Sequence[str] = ()) -> str:
    """Load `package` once in a child process before this process does; returns "ok", "known" or "skipped".

    torch's AOTI runtime loads a package in native code, and a runtime that cannot load it here may crash the
    process instead of raising (torch 2.11 on the H200 host: SIGSEGV for any package, even two Linear layers,
    until `load_aoti_package` made libstdc++ global; bench/aot_probe.py). A serving replica must not die that
    way, so the first load of
    a package on a node happens in a child: a crash or an error there raises BackendUnavailable naming the
    package and the signal, and a success is remembered next to the package (`<package>.loadable`, keyed by
    torch version and device) so later starts skip the child; `also` names other copies of the same package
    (the shared cache's) whose stamp counts and gets written too (best effort: a read-only mount is fine), so a
    package another node has loaded is trusted. `LAYA_FLEET_AOT_LOAD_CHECK=0` skips the check.
    """
    import json
    import signal
    import subprocess
    import sys

    if os.environ.get(LOAD_CHECK_ENV, "1") == "0":
        return "skipped"
    device = torch.cuda.get_device_name(device_index) if device_index >= 0 else "cpu"
    stamp = {"torch": torch.__version__, "device": device, "size": os.path.getsize(package)}
    markers = [p + ".loadable" for p in (package, *also)]
    for marker in markers:
        try:
            with open(marker, encoding="utf-8") as fh:
                if json.load(fh) == stamp:
                    return "known"
        except (OSError, ValueError):
            pass
    code = ("import sys\n"
            "from model.backends.compiled import load_aoti_package\n"
            "load_aoti_package(sys.argv[1], int(sys.argv[2]))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        r = subprocess.run([sys.executable, "-c", code, package, str(device_index)], capture_output=True, text=True,
                           timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise BackendUnavailable("loading the AOTInductor package %s took over %.0fs in a test process; not loading "
                                 "it here" % (package, timeout_s)) from None
    if r.returncode < 0:
        try:
            sig = signal.Signals(-r.returncode).name
        except ValueError:
            sig = "signal %d" % -r.returncode
        raise BackendUnavailable(
            "loading the AOTInductor package %s crashed a test process (%s) on %s with torch %s: this torch build's "
            "AOTI runtime cannot load packages here (use backend='fast' or 'compile')" % (package, sig, device,
                                                                                        torch.__version__))
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise BackendUnavailable("the AOTInductor package %s does not load (exit %d): %s" % (package, r.returncode,
                                                                                            tail))
    for marker in markers:
        tmp = "%s.%d.tmp" % (marker, os.getpid())
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(stamp, fh)
            os.replace(tmp, marker)
        except OSError as e:  # a read-only package dir: check again next time
            log.info("could not record that %s loads: %s", marker[:-len(".loadable")], e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return "ok"


def make_aot_backend(model: torch.nn.Module | None, bundle: Any, device: torch.device, **options: Any) -> AotBackend:
    """The `aot` backend: load this checkpoint's package (node-local, else seeded from the shared cache). The
    package carries its weights, so `model` is unused (`model.load` passes None and builds no model).

    Options: `package` (an explicit .pt2 path), `build` (build on a miss; default $LAYA_FLEET_AOT_BUILD,
    else False: raises BackendUnavailable naming the `laya-fleet aot` command to run).
    """
    from ..bundle import checkpoint_hash

    device = torch.device(device)
    if options.get("package"):
        return AotBackend(options["package"], bundle, device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailable("aot backend on CUDA needs a GPU")
    session = _ensure_configured(None)
    key = aot_key(checkpoint_hash(bundle.path), device, aot_dtype(bundle, device))
    local = local_package_path(key, session.cache_dir)
    if not os.path.isfile(local):
        res = session.shared.seed(key, os.path.dirname(local))
        session.seeded["aoti"] = res
        log.info("AOTI package %s: seed %s (%.1f MB, %.2fs)", key.name, res.state, res.bytes / 1e6, res.seconds)
    if not os.path.isfile(local):
        build = options.get("build")
        if build is None:
            build = os.environ.get(AOT_BUILD_ENV, "").lower() in ("1", "true", "yes")
        if not build:
            raise BackendUnavailable(
                "no AOTInductor package %s for %s in %s; build it with `laya-fleet aot --checkpoint %s "
                "--cache-dir %s --device %s` (or pass build=True)" % (key.name, bundle.path, session.cache_dir,
                                                                     bundle.path, session.cache_dir, device.type))
        build_in_subprocess(bundle.path, session.cache_dir, device)
        if not os.path.isfile(local):  # published to the shared cache by the builder: take this node's copy
            session.shared.seed(key, os.path.dirname(local))
        session.published["aoti"] = "built"
    return AotBackend(local, bundle, device, also=[os.path.join(session.shared.path(key), PACKAGE)])


def build_in_subprocess(checkpoint: str, cache_dir: str | None, device: torch.device) -> None:
    """`laya-fleet aot` in a child process: the package is compiled there and only loaded here.

    The compiler's memory, worker pool and threads stay out of the serving process. (It was first done because
    loading on CUDA crashed in the compiling process too: the libstdc++ binding `load_aoti_package` now fixes.)
    """
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "model.cli", "aot", "--checkpoint", checkpoint, "--device", torch.device(device).type]
    if cache_dir:
        cmd += ["--cache-dir", cache_dir]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError("building the AOTI package failed (exit %s): %s" % (r.returncode, r.stderr[-2000:]))
    log.info("AOTI package built in a child process in %.1fs: %s", time.perf_counter() - t, r.stdout.strip())


__all__ = ["CompileBackend", "AotBackend", "make_compile_backend", "make_aot_backend", "build_aot_package",
           "build_in_subprocess", "check_package_loads", "load_aoti_package",
           "export_model", "padded_batch", "aot_key", "aot_dtype", "bf16_copy", "half_copy", "local_package_path"]
