"""The kernels a fast forward launches: `kernel_specs` lists (op, builder args) per model shape, tile regime and
programmatic-dependent-launch mode, `compile_specs` builds them (warm-up, `laya-fleet precompile`)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kernels import _tl
from kernels import attention as _attn
from kernels import geglu as _geglu
from kernels import gemm as _gemm
from kernels import gemm_manual as _gm
from kernels import layernorm as _ln
from kernels import quant as _quant
from kernels import rope as _rope
from kernels.tuning import TABLE, Tuning, pick_add_ln, pick_attention, pick_geglu, pick_gemm, pick_gemm_ws

from .weights import SCORER_PAD

OPS = ("gemm", "geglu", "add_ln", "rope", "attention")
PDL_MODES = ("small", "all", "off")
PDL = "@pdl"   # a spec kind's suffix: the build with programmatic dependent launch (kernels/_tl.py's pdl)


def with_pdl(specs: list[tuple[str, tuple]], mode: str) -> list[tuple[str, tuple]]:
    """The builds of `specs` (kernels any batch may run) a forward in PDL `mode` needs: "off" the plain ones, "all"
    the PDL ones, "small" both (PDL for the small-tile regime's batches, plain for larger ones). What only large
    batches run (the hand-warp-specialised GEMMs, kind gemm_ws, and attention walking several heads a block) gets
    no PDL build under "small"."""
    if mode == "off":
        return specs
    tagged = [(kind + PDL, args) for kind, args in specs if mode == "all" or not _large_only(kind, args)]
    return tagged if mode == "all" else specs + tagged


def _large_only(kind: str, args: tuple) -> bool:
    return kind == "gemm_ws" or (kind == "attention" and args[2].hp > 1)


def sm_count(device: torch.device | None = None) -> int:
    """Streaming multiprocessors of the CUDA device (132 on the H100 / H200 SXM; that without a GPU)."""
    if torch.cuda.is_available():
        idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        return int(torch.cuda.get_device_properties(idx).multi_processor_count)
    return 132


def kernel_specs(d: int, heads: int, inter: int, ffn: int, windows, eps: float = 1e-5, head_eps=(1e-5,),
                 qkv_bias: bool = False, out_bias: bool = False, norm_bias: bool = False,
                 attn_cfg: _attn.AttnConfig = _attn.DEFAULT,
                 dtype: torch.dtype = torch.bfloat16, *, table: Tuning = TABLE, arch: str | None = None,
                 sms: int | None = None, pdl: str = "off", max_tokens: int | None = None,
                 ln_fold: bool = False) -> list[tuple[str, tuple]]:
    """Every (op, builder args) the forward of a model of this shape launches (both tile regimes); `dtype` is
    the activations' and GEMM weights' (bf16, or fp16: those specs carry it as a last argument). Tiles come from
    `table` for `arch` (default: the TileLang target) with `sms` multiprocessors (default: this GPU's). `pdl` (a
    PDL_MODES mode) adds the programmatic-dependent-launch builds, kinds suffixed PDL (`with_pdl`). `max_tokens`:
    the forward's largest token bucket (None: any), so kernels of larger buckets only are left out. `ln_fold`: the
    model's weights carry its norms' scales (weights.py), so buckets from the table's ln_fold_m up run the folded
    add+LayerNorm forms (kernels/ln_fold.py)."""
    arch = arch or _tl.target()["arch"]
    sms = sms or sm_count()
    pdl = pdl if _tl.pdl_arch(arch) else "off"

    def ws_cfg(M: int, N: int, geglu: bool = False, K: int | None = None) -> _gm.GemmWSConfig | None:
        return pick_gemm_ws(M, N, dtype, dtype, geglu, K, arch=arch, sms=sms, table=table)

    specs: list[tuple[str, tuple]] = []   # what batches past small_m run, and the kernels of every batch
    small: list[tuple[str, tuple]] = []   # what only the small-tile regime runs
    adt = dtype
    half = () if dtype == torch.bfloat16 else (dtype,)  # bf16 specs keep their historical form
    big = table.small_m + 1
    for rows in (64, big):   # the two tile regimes: up to small_m rows, and past it
        def cfg(N: int, K: int, rows=rows) -> _gemm.GemmConfig:
            return pick_gemm(rows, N, K, table)

        gg = pick_geglu(rows, inter, d, table)
        qkv_cfg = cfg(3 * d, d)   # Wqkv rotates Q and K in its epilogue (RoPE fused) when the tile allows
        qkv = (3 * d, d, qkv_bias, "none", qkv_cfg, adt) + ((adt, 2 * d) if qkv_cfg.bn % 64 == 0 else half)
        prods = [(3 * d, d, qkv_bias, "none", 2 * d), (d, d, out_bias, "none", 0), (d, inter, out_bias, "none", 0),
                 (3 * d, d, True, "none", 0), (d, d, True, "none", 0), (ffn, d, True, "relu", 0),
                 (d, ffn, True, "none", 0), (d, d, True, "gelu", 0)]
        ws = ws_cfg(big, 3 * d) if rows == big else None
        if ws is not None:
            # Hopper, many rows: the hand-warp-specialised kernels (kernels/gemm_manual.py); RoPE always fused
            specs += [("gemm_ws", (N, K, ws_cfg(big, N, K=K), b, a, r, False, adt)) for N, K, b, a, r in prods]
            specs.append(("gemm_ws", (inter, d, ws_cfg(big, inter, True, d), False, "none", 0, True, adt)))
            if ln_fold and table.ln_fold_m and (max_tokens is None or max_tokens >= table.ln_fold_m):
                fold = (False, "fold", eps)   # (fp8, ln, eps) as the forward passes them
                specs += [("gemm_ws", (3 * d, d, ws_cfg(big, 3 * d, K=d), qkv_bias, "none", 2 * d, False, adt, *fold)),
                          ("gemm_ws", (inter, d, ws_cfg(big, inter, True, d), False, "none", 0, True, adt, *fold))]
                specs += [("gemm_ws", (d, K, ws_cfg(big, d, K=K), out_bias, "none", 0, False, adt, False, "residual"))
                          for K in (d, inter)]
            continue
        specs_r = small if rows != big else specs
        specs_r += [("gemm", qkv),
                    ("gemm", (d, d, out_bias, "none", cfg(d, d), adt, *half)),
                    ("geglu", (inter, d, gg, *half)),
                    ("gemm", (d, inter, out_bias, "none", cfg(d, inter), adt, *half)),
                    ("gemm", (3 * d, d, True, "none", cfg(3 * d, d), adt, *half)),
                    ("gemm", (d, d, True, "none", cfg(d, d), adt, *half)),
                    ("gemm", (ffn, d, True, "relu", cfg(ffn, d), adt, *half)),
                    ("gemm", (d, ffn, True, "none", cfg(d, ffn), adt, *half)),
                    ("gemm", (d, d, True, "gelu", cfg(d, d), adt, *half))]
    specs.append(("gemm", (SCORER_PAD, d, True, "none", _gemm.NARROW, torch.float32, *half)))
    ln = (pick_add_ln(d, table), dtype)  # add_ln's (cfg, residual dtype)
    specs += [("add_ln", (d, "inplace", norm_bias, eps, adt, *ln)), ("add_ln", (d, "add", norm_bias, eps, adt, *ln)),
              ("add_ln", (d, "add_inplace", norm_bias, eps, adt, *ln))]
    for e in sorted(set(head_eps)):
        specs += [("add_ln", (d, "plain", True, e, adt, *ln)), ("add_ln", (d, "add", True, e, adt, *ln))]
    specs.append(("rope", (heads, _rope.RopeConfig(), dtype) if half else (heads,)))
    # the largest buckets' attention (several heads a block past attn_hp_m), where the forward's buckets reach it
    big_attn = pick_attention(max(big, table.attn_hp_m) if max_tokens is None else max_tokens, attn_cfg, table)
    for cfg in dict.fromkeys((attn_cfg, big_attn)):
        for win in sorted(set(windows) | {0}):
            specs.append(("attention", (heads, win, cfg, *half)))
        specs.append(("attention", (max(1, d // 64), 0, cfg, *half)))
    if pdl == "small":   # small-tile GEMMs run only in small batches (and the head's gathered rows): PDL builds
        return list(dict.fromkeys(with_pdl(specs, pdl) + [(kind + PDL, args) for kind, args in small]))
    return list(dict.fromkeys(with_pdl(small + specs, pdl)))


def spec_op(spec: tuple[str, tuple]) -> str:
    """The forward op (a key of OPS, which `ops` sets to TileLang or torch) a kernel spec serves: a manual GEMM
    spec serves `gemm`, or `geglu` in its GeGLU form; a PDL build the same as its plain one."""
    kind, args = spec
    kind = kind.removesuffix(PDL)
    if kind == "gemm_ws":
        return "geglu" if args[6] else "gemm"
    if kind == "quant":   # the FP8 precision's quantisation of a GEMM input (of the GeGLU: args[1])
        return "geglu" if args[1] else "gemm"
    return kind


BUILDERS = {"gemm": _gemm.gemm_kernel, "gemm_ws": _gm.gemm_manual_kernel, "geglu": _geglu.geglu_kernel,
            "add_ln": _ln.add_ln_kernel, "quant": _quant.quant_kernel,
            "rope": _rope.rope_kernel, "attention": _attn.attention_kernel}


def compile_specs(specs: list[tuple[str, tuple]], workers: int | None = None) -> float:
    """Compile (or load from TileLang's cache) every kernel in specs, in parallel (a kind suffixed PDL: its build
    with programmatic dependent launch); returns seconds."""
    t = time.perf_counter()
    _tl.tl()  # import on this thread first

    def build(spec: tuple[str, tuple]) -> Any:
        kind, args = spec
        with _tl.pdl_scope(kind.endswith(PDL)):
            return BUILDERS[kind.removesuffix(PDL)](*args)

    n = workers or max(1, min(len(specs), os.cpu_count() or 1))
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(build, specs))
    return time.perf_counter() - t
