"""The ingress side of the engine: validate, tokenize and decode on CPU without loading any weights.

`load_codec` builds a real `model.Engine` over the checkpoint's bundle (tokenizer, `SequenceBuilder`,
`Temperatures`) with a backend that has no weights, so `prepare` / `encode` / `encode_many` / `decode`
are exactly the Engine's own code and the HTTP answers equal `Engine.predict`; only `score` is
refused (the scorer deployment does it).
"""

from __future__ import annotations

import logging
import time

from model.bundle import open_bundle
from model.engine import Engine

log = logging.getLogger(__name__)


class NoWeights:
    """A backend stand-in for the ingress: knows the row limit, cannot run a forward."""

    name = "none"

    def __init__(self, max_tokens_per_row: int):
        import torch

        self.device = torch.device("cpu")
        self.max_tokens_per_row = int(max_tokens_per_row)

    def forward(self, rows):
        """Never called: the ingress sends rows to the scorer deployment."""
        raise RuntimeError("the ingress holds no weights; rows are scored by the scorer deployment")

    def warmup(self, max_batch_tokens: int | None = None) -> float:
        """Nothing to build; returns 0.0."""
        return 0.0


def load_codec(checkpoint: str, max_tokens_per_row: int | None = None) -> Engine:
    """An Engine over `checkpoint`'s tokenizer and config only (no weights); its `score` raises."""
    t = time.perf_counter()
    bundle = open_bundle(checkpoint)
    engine = Engine(bundle, NoWeights(max_tokens_per_row or bundle.max_len))
    # pay the tokenizer's lazy initialisation before traffic
    p = engine.prepare({"warm": {"type": "noul", "instructions": "warm up?"}})
    engine.encode_many(["warm up the tokenizer", {"k": "v"}], p)
    log.info("codec for %s ready in %.2fs (max_len %d)", checkpoint, time.perf_counter() - t, bundle.max_len)
    return engine
