"""The backend contract: rows in, raw option logits and P(action 0) out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from ..sequence import Row


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here (no CUDA, no tilelang, unsupported encoder...)."""


class Backend(Protocol):
    """What every forward implementation provides."""

    name: str
    device: torch.device
    max_tokens_per_row: int

    def forward(self, rows: Sequence[Row]) -> tuple[np.ndarray, np.ndarray]:
        """Score rows: (logits [N, kmax] float32 with -1e4 past each row's k, P(action 0) [N] float32)."""

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
