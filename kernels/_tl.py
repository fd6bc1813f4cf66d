"""Lazy TileLang access shared by every kernel file: cache location, target, compile and a kernel memo.

Nothing here imports tilelang at module import time, so the CPU test suite runs without it. The caller
(the fast backend, the precompile command) says where the kernel cache lives and which GPU architecture to
build for with `configure(cache_dir=..., arch=...)`; kernels read no environment variable of this project.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

BF16 = "bfloat16"
F16 = "float16"
F32 = "float32"
I32 = "int32"


def dt(dtype: Any) -> str:
    """TileLang's name for a torch dtype (bf16, fp16, fp32 or e4m3)."""
    import torch

    return {torch.bfloat16: BF16, torch.float16: F16, torch.float32: F32,
            torch.float8_e4m3fn: "float8_e4m3fn"}[dtype]

log = logging.getLogger(__name__)
_lock = threading.RLock()
_kernels: dict[tuple, Any] = {}
_building: dict[tuple, threading.Lock] = {}
_mod: tuple[Any, Any] | None = None
_config: dict[str, Any] = {"cache_dir": None, "arch": None, "pdl": True}


def configure(cache_dir: str | None = None, arch: str | None = None, pdl: bool = True) -> dict[str, Any]:
    """Set TileLang's kernel cache directory, the target arch (`sm_90a`; None: the visible GPU's, else sm_90a) and
    whether kernels built from now on use programmatic dependent launch (`pdl`, see `pdl()`); returns the previous
    settings. A cache dir set after tilelang's import still applies: tilelang reads its variable on every cache
    access."""
    with _lock:
        old = dict(_config)
        _config.update(cache_dir=cache_dir, arch=arch, pdl=bool(pdl))
        if cache_dir:
            os.environ["TILELANG_CACHE_DIR"] = cache_dir
        return old


def settings() -> dict[str, Any]:
    """The current `configure` values (cache_dir, arch, pdl)."""
    return dict(_config)


_scope = threading.local()
_target_pdl: dict[str | None, bool] = {}   # the target's pdl_arch() by configured arch: read at every kernel lookup


def pdl_arch(arch: str | None = None) -> bool:
    """Whether kernels for `arch` (default: the target's) may use programmatic dependent launch: configured on
    (`configure(pdl=...)`) and Hopper or later."""
    if not _config["pdl"]:
        return False
    if arch is None:
        hit = _target_pdl.get(_config["arch"])
        if hit is None:   # target() may ask the CUDA device: once, not per kernel lookup of a forward without graphs
            hit = _target_pdl[_config["arch"]] = pdl_arch(target()["arch"])
        return hit
    return has_griddepcontrol(arch)


def has_griddepcontrol(arch: str) -> bool:
    """Whether `arch` (sm_XY[a]) has griddepcontrol, programmatic dependent launch's wait and trigger: Hopper or
    later."""
    digits = "".join(c for c in arch.split("_")[-1] if c.isdigit())
    return bool(digits) and int(digits) >= 90


def pdl() -> bool:
    """Whether kernels built or looked up now (on this thread) use programmatic dependent launch: each kernel waits
    for the previous grid (griddepcontrol.wait) before touching memory and lets the next one launch right after
    that, so a kernel's launch and set-up overlap its predecessor's tail. `pdl_arch()`, unless `pdl_scope(False)`
    holds. A launch of either kind after either kind is correct: the wait comes before every memory access, and
    kernels without it launch only after their predecessor ends (cluster kernels wait in every build:
    `pdl_enter`)."""
    return getattr(_scope, "on", True) and pdl_arch()


@contextlib.contextmanager
def pdl_scope(on: bool) -> Iterator[None]:
    """Kernels built or looked up on this thread inside use programmatic dependent launch only if `on` (and
    `pdl_arch()`): the fast forward's large batches run the plain builds."""
    prev = getattr(_scope, "on", True)
    _scope.on = bool(on)
    try:
        yield
    finally:
        _scope.on = prev


def pdl_enter(wait: bool = False) -> Any:
    """A TileLang macro for the first statement of a kernel body: under `pdl()` (see there) the wait for the
    previous grid, then the signal that lets the next grid launch; otherwise the wait alone when `wait` (and the
    target has it), else nothing. Call it inside `T.Kernel`, before any global memory access.

    `wait` is for kernels that TileLang's runtime launches as programmatic dependents whatever the build: it gives
    every cluster launch that attribute, so a cluster kernel may start once its predecessor's blocks have exited,
    before their writes are flushed, unless it waits."""
    _, T = tl()
    on = pdl()
    wait_only = not on and wait and has_griddepcontrol(target()["arch"])

    @T.macro
    def enter():
        if on:
            T.pdl_sync()
            T.pdl_trigger()
        elif wait_only:
            T.pdl_sync()

    return enter


_HERE = os.path.dirname(os.path.abspath(__file__))
# files that only choose tile configs: kernel names carry every config, so editing them keeps every build valid
NOT_KERNEL_CODE = ("__init__.py", "tuning.py")


def source_files() -> list[str]:
    """The kernels/ sources whose code becomes kernel code (every file but the tuning table)."""
    return sorted(f for f in glob.glob(os.path.join(_HERE, "*.py")) if os.path.basename(f) not in NOT_KERNEL_CODE)


_fingerprint: str | None = None


def source_fingerprint() -> str:
    """12 hex digits of sha256 over `source_files()`: a changed kernel builder never loads an old build."""
    global _fingerprint
    if _fingerprint is None:
        h = hashlib.sha256()
        for f in source_files():
            h.update(os.path.basename(f).encode() + b"\0")
            with open(f, "rb") as fh:
                h.update(fh.read())
        _fingerprint = h.hexdigest()[:12]
    return _fingerprint


def available() -> tuple[bool, str]:
    """(True, "") when tilelang can be imported here, else (False, the reason)."""
    try:
        tl()
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return False, "%s: %s" % (type(e).__name__, e)
    return True, ""


def tl() -> tuple[Any, Any]:
    """The (tilelang, tilelang.language) modules, importing them on first use (after `configure`)."""
    global _mod
    with _lock:
        if _mod is None:
            os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
            if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
                # the nvcc on PATH can be a shell shim that makes tilelang guess a wrong CUDA_HOME
                os.environ["CUDA_HOME"] = os.path.realpath("/usr/local/cuda")
            import tilelang
            import tilelang.language as T

            _mod = (tilelang, T)
        return _mod


def target() -> dict:
    """The compile target: the configured arch, else the current CUDA device's (sm_90a on Hopper), else sm_90a."""
    arch = _config["arch"]
    if not arch:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            arch = "sm_%d%d%s" % (major, minor, "a" if major >= 9 else "")
        else:
            arch = "sm_90a"
    return {"kind": "cuda", "arch": arch}


def is_hopper() -> bool:
    """True when kernels are built for sm_90a (wgmma, TMA, warp specialisation)."""
    return target()["arch"].startswith("sm_90")


def ws_pass_configs(ws: bool, sync: bool = True) -> dict | None:
    """The pass configs of a kernel with (None) or without TileLang's automatic warp specialisation, and (sync=False)
    without its automatic thread-sync insertion (a kernel whose synchronisation is all explicit)."""
    cfg = {} if ws else {"tl.disable_warp_specialized": True}
    if not sync:
        cfg["tl.disable_thread_storage_sync"] = True
    return cfg or None


def compile_func(build: Callable[[], Any] | Any, name: str, fast_math: bool = False,
                 pass_configs: dict | None = None) -> Any:
    """Compile the PrimFunc that `build()` returns under a unique, deterministic symbol `name`; returns the
    JITKernel. A PrimFunc may be passed instead of the builder. `pass_configs` adds TileLang pass configs (the
    name must then differ per config: the index is keyed by name).

    On a repeat (this process or another that shares the cache dir), the kernel loads through our index
    (`index_path`) without running `build()`: TileLang's own cache needs the PrimFunc to compute its key,
    and building it re-runs TileLang's Python frontend (AST rewriting, seconds for a model's kernels on a
    loaded host). The index stores TileLang's key and the PrimFunc serialised; anything unexpected falls
    back to the normal path.
    """
    tilelang, _ = tl()
    tgt = target()
    cfg = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True} if fast_math else {}
    cfg = {**cfg, **(pass_configs or {})} or None
    index = index_path(name, tgt, fast_math)
    kernel = _load_indexed(index, tgt, cfg)
    if kernel is not None:
        return kernel
    func = build if hasattr(build, "with_attr") else build()
    func = func.with_attr("global_symbol", name)
    kernel = tilelang.compile(func, target=tgt, execution_backend="tvm_ffi", pass_configs=cfg)
    _write_index(index, kernel, func)
    return kernel


INDEX_DIR = "laya_index"


def index_path(name: str, tgt: dict, fast_math: bool) -> str:
    """Where the index entry of kernel `name` lives: under TileLang's cache dir, keyed by name, target, fast
    math, tilelang version and the kernel sources, so it travels with the kernels it points at."""
    tilelang, _ = tl()
    key = json.dumps([name, tgt, bool(fast_math), tilelang.__version__, source_fingerprint()], sort_keys=True)
    root = _config["cache_dir"] or os.environ.get("TILELANG_CACHE_DIR") or os.path.expanduser("~/.tilelang/cache")
    return os.path.join(root, INDEX_DIR, hashlib.sha256(key.encode()).hexdigest()[:40] + ".json")


def _load_indexed(index: str, tgt: dict, cfg: dict | None) -> Any:
    if not os.path.isfile(index):
        return None
    try:
        import tvm
        from tilelang.cache import _resolve_cache_dispatch
        from tilelang.transform.pass_config import normalize_pass_configs

        with open(index, encoding="utf-8") as fh:
            entry = json.load(fh)
        func = tvm.ir.load_json(entry["func"])
        cache, ctx, _ = _resolve_cache_dispatch(tgt, None, "tvm_ffi", False)
        kernel = cache._load_kernel_from_disk(entry["key"], ctx, None, normalize_pass_configs(cfg), None, func, False)
        if kernel is None:
            log.info("tilelang index %s: its kernel %s is not in the cache; compiling", index, entry.get("key"))
        return kernel
    except Exception as e:  # noqa: BLE001 - a stale or foreign entry: the normal path rebuilds it
        log.warning("tilelang index %s unusable (%s: %s); compiling", index, type(e).__name__, e)
        return None


def _write_index(index: str, kernel: Any, func: Any) -> None:
    key = getattr(kernel, "_tilelang_cache_key", None)
    attrs = func.attrs
    if not key or (attrs and any(a in attrs for a in ("tilelang_out_idx", "tilelang_pass_configs",
                                                      "tilelang_compile_flags"))):
        return  # cache disabled, or a function whose compile options the index does not record
    try:
        import tvm

        os.makedirs(os.path.dirname(index), exist_ok=True)
        tmp = "%s.%d.%d.tmp" % (index, os.getpid(), threading.get_ident())
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"key": key, "func": tvm.ir.save_json(func)}, fh)
        os.replace(tmp, index)
    except Exception as e:  # noqa: BLE001 - the index is an optimisation only
        log.warning("could not write tilelang index %s: %s", index, e)


def memo(key: tuple, build: Callable[[], Any]) -> Any:
    """The compiled kernel for `key` (and the current `pdl()`), built once per process; different keys may build in
    parallel threads."""
    key = key + (("pdl",) if pdl() else ())
    k = _kernels.get(key)
    if k is not None:
        return k
    with _lock:
        key_lock = _building.setdefault(key, threading.Lock())
    with key_lock:
        k = _kernels.get(key)
        if k is None:
            k = build()
            _kernels[key] = k
    return k


def kernel_name(prefix: str, **params: Any) -> str:
    """A deterministic C symbol for a kernel specialisation, e.g. gemm_n3072_k1024_bm128 (a `_pdl` suffix when
    `pdl()`)."""
    parts = [prefix] + ["%s%s" % (k, str(v).replace(".", "p").replace("-", "m")) for k, v in params.items()]
    return "_".join(parts + (["pdl"] if pdl() else []))
