"""The padded-batch glue the `compile` and `aot` backends share: shapes that keep one compiled graph, a lock.

Every batch is right-padded so that tokens are a multiple of 16 (at least 32) and markers at least 2, and both are
declared dynamic; rows are marked dynamic softly (inductor on CUDA may bound them for a grid limit, which a
declared range would turn into a compile error). Padding tokens/16, markers and (for `compile`) rows away from 1
avoids torch's 0/1 specialisation on those axes: a one-row batch is padded with a copy of its row and runs in the
batch graph. Padding never changes an answer: padded tokens and markers are masked, padded rows dropped.
"""

from __future__ import annotations

import abc
import copy
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..sequence import Row
from .base import collate, outputs

ALIGN = 16
MIN_TOKENS = 2 * ALIGN  # tokens/16 >= 2: a size-1 axis would be specialised
MIN_MARKERS = 2
MAX_ROWS = 1 << 20
# (rows, tokens, markers): one batch graph and one single-row graph, pairwise-different sizes
WARMUP_SHAPES = ((3, 80, 4), (1, 48, 5))
WARMUP_MANY_ROWS = (512, 32, 2)
# inductor's pad_mm pass guards on the symbolic rows x tokens size and splits a dynamic graph by row count; the
# GEMM shapes here are multiples of 16 already, so padding buys nothing
INDUCTOR_CONFIG = {"shape_padding": False}


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def padded_batch(rows: Sequence[Row], pad_id: int, min_rows: int = 1) -> tuple[dict[str, torch.Tensor], int]:
    """Collated tensors with tokens padded to a multiple of 16 (>= 32), markers to >= 2, rows to >= `min_rows`.

    Returns (tensors, the rows' real maximum marker count). Padding tokens are masked out and padding
    markers are masked (their logits are -1e4); padding rows repeat the last row and are dropped from the
    outputs, so answers do not change.
    """
    rows = list(rows)
    if len(rows) < min_rows:
        rows += [rows[-1]] * (min_rows - len(rows))
    b = collate(rows, pad_id)
    L = b["input_ids"].shape[1]
    Lp = max(MIN_TOKENS, ceil_to(L, ALIGN))
    if Lp != L:
        b["input_ids"] = F.pad(b["input_ids"], (0, Lp - L), value=pad_id)
        b["attention_mask"] = F.pad(b["attention_mask"], (0, Lp - L), value=0)
    K = b["marker_pos"].shape[1]
    if K < MIN_MARKERS:
        b["marker_pos"] = F.pad(b["marker_pos"], (0, MIN_MARKERS - K), value=0)
        b["marker_mask"] = F.pad(b["marker_mask"], (0, MIN_MARKERS - K), value=False)
    return b, K


def synthetic_rows(n: int, tokens: int, markers: int, fill_id: int) -> list[Row]:
    return [Row([fill_id] * tokens, list(range(1, markers + 1)), i % 3) for i in range(n)]


def half_copy(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A copy whose floating-point parameters are `dtype`; buffers (RoPE frequencies) stay as they are."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)
    return m


def bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`half_copy` in bf16."""
    return half_copy(model, torch.bfloat16)


class PaddedBackend(abc.ABC):
    """Shared glue: pad, run under a lock, slice markers back, convert outputs."""

    name = "padded"
    packed = False
    chunk_tokens = None

    def __init__(self, bundle: Any, device: torch.device):
        self.device = device
        self.pad_id = bundle.tokenizer.pad_token_id
        self.fill_id = bundle.tokenizer.cls_token_id
        self.max_tokens_per_row = bundle.max_len
        self.t_max = max(2, ceil_to(bundle.max_len, ALIGN) // ALIGN)
        self.k_max = max(MIN_MARKERS, bundle.max_len)
        self._lock = threading.Lock()
        self.warmup_s = 0.0
        self.min_rows = 1

    @abc.abstractmethod
    def _run(self, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled forward on a padded batch: (logits, act_logits) on the device."""

    @torch.no_grad()
    def forward(self, rows: Sequence[Row], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows as one padded batch (see `Backend.forward`)."""
        n = len(rows)
        b, k = padded_batch(rows, self.pad_id, self.min_rows)
        b = {name: t.to(self.device, non_blocking=True) for name, t in b.items()}
        with self._lock:
            logits, act = self._run(b)
            return outputs(logits[:n, :k], act[:n])

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Run the warm-up shapes (batch and single row); returns seconds spent."""
        t = time.perf_counter()
        for n, tokens, markers in WARMUP_SHAPES:
            self.forward(synthetic_rows(n, min(tokens, self.max_tokens_per_row), markers, self.fill_id))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t
        return self.warmup_s


__all__ = ["ALIGN", "MIN_TOKENS", "MIN_MARKERS", "MAX_ROWS", "WARMUP_SHAPES", "WARMUP_MANY_ROWS", "INDUCTOR_CONFIG",
           "PaddedBackend", "padded_batch", "synthetic_rows", "half_copy", "bf16_copy", "ceil_to"]
