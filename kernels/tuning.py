"""The committed tile table and the pure `pick_*` functions that read it.

`TABLE` is tuning.json beside this file: per-shape tile configs measured faster than each op's default
(`gemm.default_config`, `geglu.default_config`, `layernorm.default_config`, gemm_manual's GEMM / GEGLU).
bench/fast_path.py sweeps the candidates and prints (and writes, `--tuning-out`) a proposed table in this
format; copying it over tuning.json is how a measured winner becomes what the forward runs. Nothing mutates
a table at run time: a caller that wants another one passes it (`Tuning.from_json`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from . import attention as _attn
from . import geglu as _geglu
from . import gemm as _gemm
from . import gemm_manual as _gm
from . import layernorm as _ln

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuning.json")
_SCALARS = ("small_m", "attn_hp", "attn_hp_m", "ln_fold_m")
_CLASSES = {"gemm": _gemm.GemmConfig, "geglu": _geglu.GegluConfig, "add_ln": _ln.LNConfig,
            "gemm_ws": _gm.GemmWSConfig, "gemm_small": _gemm.GemmConfig, "geglu_small": _geglu.GegluConfig}


@dataclass(frozen=True)
class Tuning:
    """Measured winners. small_m: token buckets up to this many rows run the small tiles (gemm.SMALL, geglu.SMALL),
    larger ones the large-M kernels; gemm / geglu: "NxK" (or "FxK") -> config for more than small_m rows; add_ln:
    "D" -> config; gemm_ws: "gemm" / "geglu" (every product of that form) or "gemm:NxK" / "geglu:FxK" (one
    product), "gemm8..." / "geglu8..." the same for e4m3 operands (the FP8 precision); gemm_small / geglu_small:
    "NxK" / "FxK" -> config for up to small_m rows (else gemm.SMALL / geglu.SMALL); attn_hp / attn_hp_m: token
    buckets of at least attn_hp_m tokens (more than small_m) run the overlapped attention with attn_hp heads a block
    (1: one head a block everywhere); ln_fold_m: token buckets of at least this many tokens (more than small_m; 0:
    none) fold the encoder's add+LayerNorm into its GEMMs (kernels/ln_fold.py)."""

    gemm: Mapping[str, Any] = field(default_factory=dict)
    geglu: Mapping[str, Any] = field(default_factory=dict)
    add_ln: Mapping[str, Any] = field(default_factory=dict)
    gemm_ws: Mapping[str, Any] = field(default_factory=dict)
    gemm_small: Mapping[str, Any] = field(default_factory=dict)
    geglu_small: Mapping[str, Any] = field(default_factory=dict)
    small_m: int = _gemm.SMALL_M
    attn_hp: int = 1
    attn_hp_m: int = 0
    ln_fold_m: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tuning:
        """A table from its JSON form ({op: {key: config fields}}, "small_m": rows, "attn_hp": heads a block,
        "attn_hp_m", "ln_fold_m": rows); ValueError for an unknown op, a small_m that is not a positive multiple of 64
        (the token buckets' step), an attn_hp below 1 or, above 1, or an ln_fold_m above 0, starting at a bucket the
        small tiles run."""
        unknown = set(data) - set(_CLASSES) - set(_SCALARS)
        if unknown:
            raise ValueError("unknown ops in a tuning table: %s (use %s, %s)"
                             % (sorted(unknown), sorted(_CLASSES), ", ".join(_SCALARS)))
        small_m = data.get("small_m", _gemm.SMALL_M)
        if isinstance(small_m, bool) or not isinstance(small_m, int) or small_m < 64 or small_m % 64:
            raise ValueError("small_m in a tuning table must be a positive multiple of 64, got %r" % (small_m,))
        hp, hp_m = data.get("attn_hp", 1), data.get("attn_hp_m", 0)
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (hp, hp_m)) or hp < 1 or \
                (hp > 1 and hp_m <= small_m):
            raise ValueError("attn_hp in a tuning table is a count of heads (>= 1) and attn_hp_m, where it starts, "
                             "a bucket of more than small_m tokens; got %r and %r" % (hp, hp_m))
        fold_m = data.get("ln_fold_m", 0)
        if isinstance(fold_m, bool) or not isinstance(fold_m, int) or (fold_m and fold_m <= small_m) or fold_m < 0:
            raise ValueError("ln_fold_m in a tuning table is 0 (no fold) or a bucket of more than small_m tokens, "
                             "got %r" % (fold_m,))
        return cls(small_m=small_m, attn_hp=hp, attn_hp_m=hp_m, ln_fold_m=fold_m,
                   **{op: {k: _CLASSES[op](**v) for k, v in data.get(op, {}).items()} for op in _CLASSES})

    @classmethod
    def from_json(cls, path: str = PATH) -> Tuning:
        """The table in the JSON file `path`; an empty table when the file does not exist."""
        if not os.path.isfile(path):
            return cls()
        with open(path, encoding="utf-8") as fh:
            return cls.from_dict(json.load(fh))

    def as_dict(self) -> dict[str, Any]:
        """The JSON form `from_dict` reads."""
        return {**{k: getattr(self, k) for k in _SCALARS},
                **{op: {k: asdict(v) for k, v in sorted(getattr(self, op).items())} for op in _CLASSES}}

    def with_entry(self, op: str, key: str, cfg: Any) -> Tuning:
        """A copy with one more (or a replaced) entry."""
        return replace(self, **{op: {**getattr(self, op), key: cfg}})


TABLE = Tuning.from_json()


def pick_gemm(M: int, N: int, K: int | None = None, table: Tuning = TABLE) -> _gemm.GemmConfig:
    """The tile config of an M x N (x K) GEMM: NARROW for N <= 64; up to the table's small_m rows its small-tile
    winner for this product or SMALL; else its winner for this product or LARGE (`gemm.default_config` with
    small_m moved)."""
    if N <= 64:
        return _gemm.NARROW
    if M <= table.small_m:
        return table.gemm_small.get("%dx%s" % (N, K)) or _gemm.SMALL
    return table.gemm.get("%dx%s" % (N, K)) or _gemm.LARGE


def pick_geglu(M: int, Fd: int, K: int, table: Tuning = TABLE) -> _geglu.GegluConfig:
    """The tile config of an M-row GeGLU of width Fd over K: up to the table's small_m rows its small-tile winner
    or SMALL, else its winner for this product or LARGE."""
    if M <= table.small_m:
        return table.geglu_small.get("%dx%d" % (Fd, K)) or _geglu.SMALL
    return table.geglu.get("%dx%d" % (Fd, K)) or _geglu.LARGE


def pick_attention(M: int, cfg: _attn.AttnConfig, table: Tuning = TABLE) -> _attn.AttnConfig:
    """The attention config a bucket of M tokens runs: `cfg`, or where `cfg` is the overlapped kernel with one head
    a block and M >= the table's attn_hp_m, the same walking attn_hp heads a block (fewer, longer blocks pay only
    where many are left to fill the GPU)."""
    if cfg.overlap and cfg.hp == 1 and table.attn_hp > 1 and M >= table.attn_hp_m:
        return replace(cfg, hp=table.attn_hp)
    return cfg


def pick_add_ln(D: int, table: Tuning = TABLE) -> _ln.LNConfig:
    """The add+LayerNorm config for width D: the table's, else `layernorm.default_config(D)`."""
    return table.add_ln.get(str(D)) or _ln.default_config(D)


def pick_gemm_ws(M: int, N: int, in_dtype: torch.dtype, out_dtype: torch.dtype, geglu: bool = False,
                 K: int | None = None, *, arch: str, sms: int, table: Tuning = TABLE) -> _gm.GemmWSConfig | None:
    """The hand-warp-specialised config an M-row product of N columns (K deep) runs with on `arch` with `sms`
    multiprocessors, or None for the other kernels (few rows, an fp32 output or N < 64, not Hopper)."""
    if M <= table.small_m or N < 64 or in_dtype != out_dtype or not arch.startswith("sm_90"):
        return None
    form = "geglu" if geglu else "gemm"
    base = table.gemm_ws.get("%s:%dx%s" % (form, N, K)) or table.gemm_ws.get(form)
    if base is None:
        base = _gm.GEGLU if geglu else _gm.GEMM if N >= _gm.CLUSTER_MIN_N else replace(_gm.GEMM, cluster=1)
    if base.cluster > 1 and sms % base.cluster:   # every block of a persistent cluster launch has its pair
        base = replace(base, cluster=1)
    return base if base.persistent == sms else replace(base, persistent=sms)


def pick_gemm_ws8(M: int, N: int, geglu: bool = False, K: int | None = None, *, arch: str, sms: int,
                  table: Tuning = TABLE) -> _gm.GemmWSConfig | None:
    """The hand-warp-specialised config of an M-row product with e4m3 operands (the FP8 precision), K deep, or
    None for cuBLAS's (`torch._scaled_mm`): few rows, N < 64 or not Hopper. The table's gemm_ws entry
    "gemm8:NxK" / "geglu8:FxK" or "gemm8" / "geglu8", else gemm_manual's GEMM8 / GEGLU8 with clusters where the
    bf16 kernels use them."""
    if M <= table.small_m or N < 64 or not arch.startswith("sm_90"):
        return None
    form = "geglu8" if geglu else "gemm8"
    base = table.gemm_ws.get("%s:%dx%s" % (form, N, K)) or table.gemm_ws.get(form)
    if base is None:
        base = _gm.GEGLU8 if geglu else _gm.GEMM8 if N >= _gm.CLUSTER_MIN_N else replace(_gm.GEMM8, cluster=1)
    if base.cluster > 1 and sms % base.cluster:
        base = replace(base, cluster=1)
    return base if base.persistent == sms else replace(base, persistent=sms)


__all__ = ["Tuning", "TABLE", "PATH", "pick_gemm", "pick_geglu", "pick_attention", "pick_add_ln", "pick_gemm_ws",
           "pick_gemm_ws8"]
