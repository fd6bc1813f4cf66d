"""Backend registry: `eager` always; GPU backends (`fast`, `compile`, `aot`) register themselves.

`auto` picks `fast` on CUDA when tilelang imports and the encoder is ModernBERT-family, otherwise
`eager` (with one warning when a GPU is present and the fast path could not be used).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .base import Backend, BackendUnavailable, collate, cuda_amp_dtype, outputs
from .eager import EagerBackend

log = logging.getLogger(__name__)

# name -> "module:factory"; a factory is (model, bundle, device, **options) -> Backend
_REGISTRY: dict[str, str] = {
    "fast": "model.backends.fast:make_backend",
    "compile": "model.backends.compile:make_compile_backend",
    "aot": "model.backends.aot:make_aot_backend",
}
# the compiler caches each backend seeds before it compiles and publishes after warm-up
CACHE_KINDS = {"fast": ("tilelang", "inductor", "triton"), "compile": ("inductor", "triton"), "aot": (), "eager": ()}
ALIASES = {"tilelang": "fast", "torch": "eager", "inductor": "compile", "torch.compile": "compile"}
NAMES = ("auto", "eager", *(_REGISTRY))


def _factory(name: str) -> Callable[..., Backend]:
    mod, fn = _REGISTRY[name].split(":")
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise BackendUnavailable("backend %r needs %s: %s" % (name, mod, e)) from e
    return getattr(module, fn)


def _eager_dtype(dtype: torch.dtype | None, bundle: Any, device: torch.device) -> torch.dtype | None:
    """An explicit dtype wins; on CUDA the checkpoint's autocast dtype (`cuda_amp_dtype`); on CPU fp32 (None)."""
    if dtype is not None or device.type != "cuda":
        return dtype
    return cuda_amp_dtype(bundle.cfg, device)


def cache_code(name: str, device: torch.device) -> dict[str, str | None]:
    """{cache kind: source fingerprint} of the compiler caches backend `name` uses on `device`, for
    `model.cache.configure` (None: the cache's own fingerprint of the model code; CPU runs inductor only)."""
    kinds = [k for k in CACHE_KINDS.get(ALIASES.get(name, name), ()) if device.type == "cuda" or k == "inductor"]
    code: dict[str, str | None] = dict.fromkeys(kinds)
    if "tilelang" in code:
        from kernels._tl import source_fingerprint

        code["tilelang"] = source_fingerprint()
    return code


def make_backend(name: str, model: torch.nn.Module, bundle: Any, device: torch.device, **options) -> Backend:
    """Build the named backend (resolving `auto`), falling back from `auto` to eager when needed."""
    name = ALIASES.get(name, name)
    if name not in NAMES:
        raise ValueError("unknown backend %r; use one of %s" % (name, list(NAMES) + sorted(ALIASES)))
    pad_id = bundle.tokenizer.pad_token_id
    if name == "auto":
        if device.type == "cuda":
            try:
                return _factory("fast")(model, bundle, device, **options)
            except BackendUnavailable as e:
                warnings.warn("laya-fleet: fast backend unavailable (%s); using eager" % e, RuntimeWarning,
                              stacklevel=3)
        return EagerBackend(model, pad_id, device, bundle.max_len, dtype=_eager_dtype(None, bundle, device))
    if name == "eager":
        return EagerBackend(model, pad_id, device, bundle.max_len,
                            dtype=_eager_dtype(options.get("dtype"), bundle, device))
    return _factory(name)(model, bundle, device, **options)


__all__ = ["Backend", "BackendUnavailable", "EagerBackend", "NAMES", "ALIASES", "CACHE_KINDS", "cache_code",
           "make_backend", "collate", "cuda_amp_dtype", "outputs"]
