"""The backend contract: rows in, raw option logits and P(action 0) out, and what callers may rely on."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from ..sequence import Row


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no CUDA, no tilelang, unsupported encoder...)."""


DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp32": torch.float32, "float32": torch.float32}
HALF = (torch.bfloat16, torch.float16)


def dtype_named(value: Any, what: str, allowed: tuple = HALF + (torch.float32,)) -> torch.dtype:
    """A torch dtype given as one or as a name (bf16 / bfloat16 / fp16 / float16 / fp32 / float32); ValueError
    naming `what` (the option or variable) for anything else or a dtype outside `allowed`."""
    dt = DTYPE_NAMES.get(value.strip().lower()) if isinstance(value, str) else value
    if dt not in allowed:
        names = sorted(k for k, v in DTYPE_NAMES.items() if v in allowed)
        raise ValueError("%s=%r: use one of %s" % (what, value, names))
    return dt


def cuda_precision(cfg: dict, device: torch.device | None = None) -> str:
    """The precision a CUDA forward computes in, "fp16", "bf16" or "fp8", by upstream Laya's policy plus this
    project's opt-in "fp8": $LAYA_FLEET_CUDA_AMP (or upstream's $LAYA_CUDA_AMP) when set; fp16 on GPUs before
    compute capability 8 (no bf16 tensor cores); else the checkpoint's `amp_dtype`: "bf16" / "bfloat16" is bf16,
    "fp8" is fp8 (the fast backend's encoder GEMMs in e4m3, activations bf16), anything else or no field fp16."""
    from .. import settings

    amp = settings.get("LAYA_FLEET_CUDA_AMP")
    if amp:
        return "fp8" if amp == "fp8" else "bf16" if dtype_named(amp, "LAYA_FLEET_CUDA_AMP", HALF) == torch.bfloat16 \
            else "fp16"
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.get_device_capability(idx)[0] < 8:
            return "fp16"
    name = str(cfg.get("amp_dtype", "fp16")).lower()
    return "bf16" if name in ("bf16", "bfloat16") else "fp8" if name == "fp8" else "fp16"


def cuda_amp_dtype(cfg: dict, device: torch.device | None = None) -> torch.dtype:
    """The half-precision dtype a CUDA forward of the eager, compile or aot backend computes in (`cuda_precision`);
    ValueError where that is fp8, which only the fast backend runs."""
    from .. import settings

    prec = cuda_precision(cfg, device)
    if prec == "fp8":
        where = "LAYA_FLEET_CUDA_AMP" if settings.get("LAYA_FLEET_CUDA_AMP") else "the checkpoint's amp_dtype"
        raise ValueError("precision fp8 (from %s) runs on the fast backend only; use backend 'fast' or 'auto' on a "
                         "GPU with TileLang, or set LAYA_FLEET_CUDA_AMP=bf16" % where)
    return torch.bfloat16 if prec == "bf16" else torch.float16


class Backend(Protocol):
    """What every forward implementation provides, and all a caller may rely on.

    `packed`: the backend computes each row's own tokens (cost = the sum of row lengths); otherwise a batch is
    padded to its longest row (cost = rows x longest). `chunk_tokens`: a backend that cuts a
    forward's rows into chunks itself (and pipelines them) gives the most tokens one chunk holds, so a caller
    may hand it many micro-batches in one call with `forward(rows, max_tokens)`; None: one forward is one batch,
    `max_tokens` is not consulted and the caller cuts micro-batches."""

    name: str
    device: torch.device
    max_tokens_per_row: int
    packed: bool
    chunk_tokens: int | None

    def forward(self, rows: Sequence[Row], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows: (logits [N, kmax] float32 with -1e4 past each row's k, P(action 0) [N] float32); a chunking
        backend cuts chunks of at most min(chunk_tokens, max_tokens) tokens."""

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Build every graph / compiled shape this backend will use; returns seconds spent."""


def collate(rows: Sequence[Row], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors for a list of rows, in order (no sorting)."""
    n = len(rows)
    L = max(len(r.ids) for r in rows)
    K = max(len(r.markers) for r in rows)
    ids = np.full((n, L), pad_id, dtype=np.int64)
    att = np.zeros((n, L), dtype=np.int64)
    mpos = np.zeros((n, K), dtype=np.int64)
    mmask = np.zeros((n, K), dtype=bool)
    for i, r in enumerate(rows):
        ids[i, :len(r.ids)] = r.ids
        att[i, :len(r.ids)] = 1
        mpos[i, :len(r.markers)] = r.markers
        mmask[i, :len(r.markers)] = True
    qtype = np.array([r.qtype for r in rows], dtype=np.int64)
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(att),
            "marker_pos": torch.from_numpy(mpos), "marker_mask": torch.from_numpy(mmask),
            "qtype": torch.from_numpy(qtype)}


def outputs(logits: torch.Tensor, act_logits: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Host arrays from model outputs: fp32 logits and softmax(action)[:, 0]."""
    return (logits.float().cpu().numpy(),
            torch.softmax(act_logits.float(), -1)[:, 0].cpu().numpy())
