"""The `aot` backend: a checkpoint's AOTInductor package, built once per (checkpoint, arch, torch, CUDA, dtype).

`build_aot_package` (the `laya-fleet aot` command) exports the padded DecisionModel with `torch.export.Dim`
dynamic rows, tokens (16 * t) and markers, and packages it; on CUDA the package holds a copy of the parameters in
the checkpoint's half dtype with no autocast (the dtype-explicit action head is what makes that export work; RoPE
buffers stay fp32). Packages are published to and seeded from the shared cache (`model.cache`); `AotBackend`
loads one with aot_package.py's loader and compiles nothing. A miss is an error naming the command to run,
unless `build=True` / $LAYA_FLEET_AOT_BUILD builds it in a child process.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from .. import cache as _cache
from .. import settings
from .aot_package import check_package_loads, load_aoti_package
from .base import BackendUnavailable, cuda_amp_dtype
from .padded import (
    ALIGN,
    INDUCTOR_CONFIG,
    MAX_ROWS,
    MIN_MARKERS,
    WARMUP_SHAPES,
    PaddedBackend,
    ceil_to,
    half_copy,
    padded_batch,
    synthetic_rows,
)

log = logging.getLogger(__name__)

PACKAGE = "model.pt2"


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
    t_max = max(2, ceil_to(bundle.max_len, ALIGN) // ALIGN)
    rows = Dim("rows", min=1, max=MAX_ROWS)
    t = Dim("t", min=2, max=t_max)
    k = Dim("k", min=MIN_MARKERS, max=max(MIN_MARKERS, bundle.max_len))
    tokens = ALIGN * t
    ds = {"input_ids": {0: rows, 1: tokens}, "attention_mask": {0: rows, 1: tokens},
          "marker_pos": {0: rows, 1: k}, "marker_mask": {0: rows, 1: k}, "qtype": {0: rows}}
    n, L, K = WARMUP_SHAPES[0]
    b, _ = padded_batch(synthetic_rows(n, min(L, bundle.max_len), K, bundle.tokenizer.cls_token_id),
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


class AotBackend(PaddedBackend):
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
            build = settings.get("LAYA_FLEET_AOT_BUILD")
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

    The compiler's memory, worker pool and threads stay out of the serving process.
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




__all__ = ["AotBackend", "make_aot_backend", "build_aot_package", "build_in_subprocess", "export_model", "aot_key",
           "aot_dtype", "aot_variant", "local_package_path", "PACKAGE"]
