"""Eager PyTorch forward: fp32 on CPU (the reference), bf16 autocast on CUDA."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..sequence import Row
from .base import collate, outputs


class EagerBackend:
    """The DecisionModel as written, on one device; thread-safe (one forward at a time)."""

    name = "eager"
    packed = False
    chunk_tokens = None

    def __init__(self, model: torch.nn.Module, pad_id: int, device: torch.device, max_len: int,
                 dtype: torch.dtype | None = None):
        self.device = device
        self.pad_id = pad_id
        self.max_tokens_per_row = max_len
        # CPU runs fp32; CUDA keeps fp32 weights under autocast (make_backend passes the checkpoint's dtype,
        # cuda_amp_dtype), as upstream's eager path does
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.model = model.to(device)
        self._lock = threading.Lock()

    @torch.no_grad()
    def forward(self, rows: Sequence[Row], max_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Score rows as one padded batch (see `Backend.forward`)."""
        b = {k: v.to(self.device, non_blocking=True) for k, v in collate(rows, self.pad_id).items()}
        with self._lock:
            if self.dtype != torch.float32:
                with torch.autocast(self.device.type, dtype=self.dtype):
                    logits, act = self.model(**b)
            else:
                logits, act = self.model(**b)
            return outputs(logits, act)

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """One small forward so lazy initialisation is paid before traffic; returns seconds."""
        t = time.perf_counter()
        self.forward([Row([self.pad_id] * 8, [1, 2], 0)])
        return time.perf_counter() - t
