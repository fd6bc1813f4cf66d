"""Lazy TileLang access shared by every kernel file: cache location, target, compile and a kernel memo.

Nothing here imports tilelang at module import time, so the CPU test suite runs without it. The first
call to `tl()` points TileLang's kernel cache at `model.cache.local_dir("tilelang")` and then imports it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

BF16 = "bfloat16"
F32 = "float32"
I32 = "int32"

_lock = threading.RLock()
_kernels: dict[tuple, Any] = {}
_building: dict[tuple, threading.Lock] = {}
_mod: tuple[Any, Any] | None = None


def available() -> tuple[bool, str]:
    """(True, "") when tilelang can be imported here, else (False, the reason)."""
    try:
        tl()
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return False, "%s: %s" % (type(e).__name__, e)
    return True, ""


def tl() -> tuple[Any, Any]:
    """The (tilelang, tilelang.language) modules, importing them on first use with our cache dir."""
    global _mod
    with _lock:
        if _mod is None:
            from model.cache import local_dir

            # tilelang 0.1.15 reads this variable on every cache access, so setting it works even
            # when someone imported tilelang before us
            os.environ["TILELANG_CACHE_DIR"] = local_dir("tilelang")
            os.environ.setdefault("TILELANG_PRINT_ON_COMPILATION", "0")
            if "CUDA_HOME" not in os.environ and os.path.isdir("/usr/local/cuda"):
                # the nvcc on PATH can be a shell shim that makes tilelang guess a wrong CUDA_HOME
                os.environ["CUDA_HOME"] = os.path.realpath("/usr/local/cuda")
            import tilelang
            import tilelang.language as T

            _mod = (tilelang, T)
        return _mod


def target() -> dict:
    """The compile target: the current CUDA device's arch (sm_90a on Hopper), else $LAYA_FLEET_TL_ARCH or sm_90a."""
    arch = os.environ.get("LAYA_FLEET_TL_ARCH")
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


def compile_func(func: Any, name: str, fast_math: bool = False) -> Any:
    """Compile a PrimFunc under a unique, deterministic symbol `name`; returns the JITKernel."""
    tilelang, _ = tl()
    func = func.with_attr("global_symbol", name)
    cfg = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True} if fast_math else None
    return tilelang.compile(func, target=target(), execution_backend="tvm_ffi", pass_configs=cfg)


def memo(key: tuple, build: Callable[[], Any]) -> Any:
    """The compiled kernel for `key`, built once per process; different keys may build in parallel threads."""
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
    """A deterministic C symbol for a kernel specialisation, e.g. gemm_n3072_k1024_bm128."""
    parts = [prefix] + ["%s%s" % (k, str(v).replace(".", "p").replace("-", "m")) for k, v in params.items()]
    return "_".join(parts)
