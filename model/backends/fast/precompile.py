"""Build the fast backend's TileLang kernels ahead of time into the kernel cache (no GPU needed; sm_90a by default).

    laya-fleet precompile --shapes tiny modernbert-large [--fp16] [--fp8] [--ln-fold-m M] [--pack FILE.tar.xz]
    python -m model.backends.fast.precompile ...          (the same command)

The cache (TileLang's, under `model.cache.local_dir("tilelang")`) is keyed by the kernel source, target and
tilelang version, not by the machine's Python or paths, so a cache filled here serves the GPU box. `--tests`
and `--sweep` also build the kernels of tests/test_kernels.py and bench/fast_path.py's sweep (from a checkout).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from dataclasses import replace

import torch

from kernels import _tl
from kernels.tuning import TABLE

from . import fp8
from .backend import configure_tilelang
from .specs import compile_specs, kernel_specs, sm_count, with_pdl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def shape_dims(shape: str) -> dict:
    """Model dimensions of a make-checkpoint shape: d, heads, inter, ffn, windows."""
    from model.make_checkpoint import SHAPES

    s = SHAPES[shape]
    return dict(d=s["hidden"], heads=s["heads"], inter=s["ff"], ffn=4 * s["hidden"], windows={0, 64})


def model_specs(shape: str, dtype: torch.dtype = torch.bfloat16, pdl: str = "off",
                fold_m: int | None = None) -> list[tuple[str, tuple]]:
    """The kernels a make-checkpoint shape's fast forward uses (bf16, or fp16 with act_dtype=torch.float16) in PDL
    mode `pdl` (its norms are bias-free: the folded add+LayerNorm forms where the tuning table switches them on, or,
    with `fold_m`, a table whose ln_fold_m is that)."""
    table = TABLE if fold_m is None else replace(TABLE, ln_fold_m=fold_m)
    return kernel_specs(**shape_dims(shape), dtype=dtype, pdl=pdl, ln_fold=True, table=table)


def _checkout_specs(module: str, fn: str) -> list[tuple[str, tuple]]:
    """Kernel lists that live in the checkout's tests/ or bench/ (developer flags only)."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return getattr(importlib.import_module(module), fn)()


def pack_cache(path: str) -> int:
    """Write the node-local TileLang kernel cache (`tilelang/` under the local cache root) to `path` as tar.xz;
    returns its size in bytes."""
    import tarfile

    from model.cache import local_dir

    src = local_dir("tilelang")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with tarfile.open(path, "w:xz") as tar:
        tar.add(src, arcname="tilelang")
    return os.path.getsize(path)


def run(a: argparse.Namespace) -> int:
    """Compile what the parsed flags ask for; returns the exit status."""
    mode = configure_tilelang(a.arch)   # $LAYA_FLEET_PDL: which builds the forward runs
    mode = mode if _tl.pdl_arch() else "off"
    specs = []
    dtypes = [torch.bfloat16] + ([torch.float16] if a.fp16 else [])
    for s in a.shapes:
        for dt in dtypes:   # a folding table's list holds the plain one (small buckets run the unfused ops)
            specs += model_specs(s, dt, mode, a.ln_fold_m or None)
        if a.fp8:
            dims = shape_dims(s)
            specs += with_pdl(fp8.kernel_specs(dims["d"], dims["inter"], arch=_tl.target()["arch"], sms=sm_count()),
                              mode)
    # the tests and sweeps call the builders directly, which build with PDL wherever the target has it
    direct = "all" if _tl.pdl_arch() else "off"
    if a.tests:
        specs += with_pdl(_checkout_specs("tests.kernel_specs", "test_specs"), direct)
    if a.sweep:
        specs += with_pdl(_checkout_specs("bench.fastpath_sweep", "sweep_specs"), direct)
    specs = list(dict.fromkeys(specs))
    t = time.perf_counter()
    compile_specs(specs, a.workers)
    print("%d kernels ready in %.1fs" % (len(specs), time.perf_counter() - t))
    if a.pack:
        print("packed %s (%.1f MB)" % (a.pack, pack_cache(a.pack) / 1e6))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m model.backends.fast.precompile`: `laya-fleet precompile` (whose flags it takes);
    returns the exit status."""
    from model.cli import main as cli_main

    return cli_main(["precompile", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
