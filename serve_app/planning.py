"""Micro-batch planning: what a batch costs a backend, how rows are cut under a token budget, and which budget
a warm-up measurement picks. Pure functions; the scorer (serve_app/scorer.py) applies them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from model.sequence import Row


def batch_cost(lengths: Sequence[int], packed: bool) -> int:
    """Tokens a backend computes for rows of these lengths (padding included unless packed)."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def plan(lengths: Sequence[int], max_batch_tokens: int, packed: bool = False,
         max_rows: int | None = None) -> list[list[int]]:
    """Indices of rows grouped into micro-batches, longest rows first, each under the budget.

    A row longer than the budget on its own still gets a micro-batch (of one): nothing is dropped.
    Every index appears exactly once.
    """
    if max_batch_tokens < 1:
        raise ValueError("max_batch_tokens must be positive, got %r" % max_batch_tokens)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_sum = cur_max = 0
    for i in order:
        n = lengths[i]
        new_sum, new_max = cur_sum + n, max(cur_max, n)
        cost = new_sum if packed else (len(cur) + 1) * new_max   # batch_cost of cur + [i], kept running
        if cur and (cost > max_batch_tokens or (max_rows and len(cur) >= max_rows)):
            batches.append(cur)
            cur, new_sum, new_max = [], n, n
        cur.append(i)
        cur_sum, cur_max = new_sum, new_max
    if cur:
        batches.append(cur)
    return batches


def pick_budget(measured: list[tuple[int, float]], fallback: int, within: float = 0.05) -> int:
    """The smallest budget whose tokens/s is within `within` of the best of `measured` [(budget, tokens/s)]."""
    if not measured:
        return fallback
    best = max(t for _, t in measured)
    return min(b for b, t in measured if t >= (1.0 - within) * best)


def probe_rows(lengths: Sequence[int], tokens: int, pad_id: int, arrays: bool = False) -> list[Row]:
    """Rows with `lengths` (cycled until they hold at least `tokens` tokens), longest first as `plan` orders a
    call; `arrays` gives each row its int32 ids, as the codec builds rows for a packed backend."""
    lengths = [int(n) for n in lengths if int(n) >= 4]
    if not lengths:
        raise ValueError("probe rows need at least one length of 4 tokens or more")
    out, total, i = [], 0, 0
    while total < tokens:
        n = lengths[i % len(lengths)]
        ids = [pad_id] * n
        out.append(Row(ids, [1, 2, 3], 0, np.full(n, pad_id, dtype=np.int32) if arrays else None))
        total += n
        i += 1
    out.sort(key=len, reverse=True)
    return out
