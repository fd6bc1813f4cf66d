"""The `compile` backend: torch.compile over the padded DecisionModel, one graph for every batch.

The graph takes tokens as a [rows, tokens/16, 16] view that it flattens back, so inductor knows symbolically that L
is a multiple of 16; that lets it hand ModernBERT's [rows, 1, L, L] attention bias to the SDPA kernel as a
broadcast view instead of materialising rows x heads x L x L. Rows (>= 2: a one-row batch is padded with a copy),
tokens/16 and markers are dynamic (padded.py), so `warmup()` builds a single graph that serves every batch
(`single_row_graph=True` keeps a separate static single-row graph). Duck sizing is off while a compiled call runs,
so equal sizes at trace time never tie axes. `regional` compiles one graph per kind of encoder layer instead of
the whole model; `precompile` saves the traced whole graph with its guards beside inductor's cache, so a warm start
does not re-trace.

Precision: CPU runs fp32; on CUDA fp32 weights run under autocast in the checkpoint's half dtype
(`cuda_amp_dtype`) with an fp32 residual stream, as the eager backend does. `model.load` points inductor and
Triton at node-local dirs seeded from the shared cache before anything compiles (`model.cache`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from .. import cache as _cache
from .. import settings
from .base import cuda_amp_dtype, dtype_named
from .padded import (
    ALIGN,
    INDUCTOR_CONFIG,
    MIN_MARKERS,
    MIN_TOKENS,
    WARMUP_MANY_ROWS,
    WARMUP_SHAPES,
    PaddedBackend,
    half_copy,
    padded_batch,
    synthetic_rows,
)
from .torch_encoder import NativeModernBert

log = logging.getLogger(__name__)


class _AlignedGraph(torch.nn.Module):
    """The compiled graph's module for precompile (module level: torch pickles a reference to it): tokens arrive
    as [rows, tokens/16, 16] views, as in `CompileBackend._graph_aligned`.

    Autocast, where the backend uses it, is entered inside the graph, not around the call: a saved graph's
    guards check each input's dispatch keys, and an autocast context around the call would add AutocastCUDA."""

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


def _aligned_layer_step(h4, cos3, sin3, mask, p, eps: float, heads: int, head_dim: int):
    """`torch_encoder.layer_step` on [rows, tokens/16, 16, ...] views that it flattens back, so inductor knows the
    token count is a multiple of 16 inside the region as it does in the whole graph (see the module doc)."""
    from .torch_encoder import layer_step

    B, t, a, d = h4.shape
    mask = mask.flatten(-2) if mask.dim() == 5 else mask.flatten(-2).flatten(2, 3)
    return layer_step(h4.reshape(B, t * a, d), cos3.flatten(0, 1), sin3.flatten(0, 1), mask, p, eps, heads,
                      head_dim)


class _RegionalStep:
    """The encoder's per-layer function, compiled once per kind of layer (regional compilation).

    `torch.compile` of the whole model traces and lowers every layer (most of a cold warm-up; see BENCHMARKS.md,
    "Warm start"). A layer is a plain function of tensors (`torch_encoder.layer_step`, parameters passed
    in), so all layers of one kind share a graph: three graphs (layer 0, whose norm is the identity; full
    attention; windowed attention) whatever the depth. Embeddings, masks, RoPE tables, the final norm and the
    decision head run eagerly around them. Inputs are passed as multiple-of-16 views with rows and tokens/16 dynamic."""

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


class CompileBackend(PaddedBackend):
    """torch.compile over the whole DecisionModel with dynamic rows, tokens (x16) and markers."""

    name = "compile"

    def __init__(self, model: torch.nn.Module, bundle: Any, device: torch.device, align: bool = True,
                 mode: str | None = None, dtype: torch.dtype | str | None = None, fullgraph: bool = True,
                 single_row_graph: bool = False, precompile: bool = True,
                 regional: bool | str | None = None):
        super().__init__(bundle, device)
        self.precompile = bool(precompile)
        if regional is None:
            regional = {"0": False, "1": True}.get(settings.get("LAYA_FLEET_COMPILE_REGIONAL"), "auto")
        self.regional = regional if regional == "auto" else bool(regional)
        self.regional_choice = "auto" if regional == "auto" else "set"
        self.precompile_state = "off"
        self.precompile_misses = 0  # batches the precompiled graph's guards refused (served by tracing)
        self._pre: Any = None  # the precompiled graph (torch.compile'd _AlignedGraph with a loaded AOT forward)
        # a one-row batch runs in the batch graph padded to two rows (a size-1 axis would get a graph of its
        # own): one graph to compile and re-trace, not two; single_row_graph=True keeps the separate graph
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
        if self.regional is True and not self.align:
            raise ValueError("regional compilation feeds its layers [rows, tokens/16, 16] views: it needs align=True")
        if self.regional == "auto" and not self.align:
            self.regional, self.regional_choice = False, "auto: whole graph (align=False)"
        if self.regional == "auto":
            # the whole graph when its precompiled form was seeded (a warm start without tracing), else one graph
            # per kind of layer (the shorter cold compile)
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
            self.forward(synthetic_rows(n, tokens, markers, self.fill_id))
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
                    b, _ = padded_batch(synthetic_rows(n, min(tokens, self.max_tokens_per_row), markers,
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
    single_row_graph=False, precompile=True (the traced graph saved with its guards), regional=None:
    $LAYA_FLEET_COMPILE_REGIONAL, default "auto": the whole graph when its precompiled form is already in the
    (seeded) cache, else one graph per kind of encoder layer (a cold compile in a fraction of the time); 1 or
    True: always regional; 0 or False: always the whole graph)."""
    known = {"align", "mode", "dtype", "fullgraph", "single_row_graph", "precompile", "regional"}
    return CompileBackend(model, bundle, device, **{k: v for k, v in options.items() if k in known})


__all__ = ["CompileBackend", "make_compile_backend"]
