"""Token-budget batching, shared by the online scorer and the offline actors.

Rows are sorted by length, cut into micro-batches whose cost stays under a token budget, scored, and
put back in their original order. Cost is what the backend actually computes: the sum of row lengths
for a packed backend, rows x longest row for a padded one.
"""

from __future__ import annotations

from collections.abc import Sequence


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
        cost = new_sum if packed else (len(cur) + 1) * new_max
        if cur and (cost > max_batch_tokens or (max_rows and len(cur) >= max_rows)):
            batches.append(cur)
            cur, new_sum, new_max = [], n, n
        cur.append(i)
        cur_sum, cur_max = new_sum, new_max
    if cur:
        batches.append(cur)
    return batches
