"""Cross-request batching for the scorer replica: an asyncio queue cut by a token budget.

Requests (each a list of rows) wait in one FIFO queue. A batch is closed when the next request would
push it over the token budget (or the row cap), or when its oldest request has waited
`max_wait_s`; the first request of a batch is always taken, so a request larger than the budget
alone still runs (the Scorer splits it into micro-batches). One batch is in flight at a time because
the replica has one forward thread: while it runs, the next batch accumulates, so under load batches
fill without any added wait.

Not `@serve.batch(batch_size_fn=...)`: that fails a request larger than the budget, sends a request
that does not fit to the back of the queue, restarts its wait timer for every batch, and cannot retry a
failed batch's requests one by one. The budget is read live from the Scorer, so an out-of-memory
halving also shrinks the batches collected next.

If a batch raises, each of its requests is retried alone: a poison request fails by itself and the
rest of its batch is answered.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from model.sequence import Row

log = logging.getLogger(__name__)

Result = tuple[np.ndarray, np.ndarray]


@dataclass
class BatchRecord:
    """What one cross-request batch was: request count, rows, tokens, queue waits, forward time."""

    requests: int
    rows: int
    tokens: int
    waits_s: list[float]
    forward_s: float
    fallback: bool = False


@dataclass
class _Pending:
    rows: list[Row]
    tokens: int
    enqueued: float
    future: asyncio.Future = field(repr=False)


class TokenBatcher:
    """Collects concurrent requests' rows into batches under a token budget and scores them."""

    def __init__(self, run: Callable[[list[Row]], Awaitable[Result]], budget: Callable[[], int],
                 max_wait_s: float = 0.0, max_rows: int | None = None,
                 on_batch: Callable[[BatchRecord], None] | None = None):
        self._run = run
        self._budget = budget
        self.max_wait_s = float(max_wait_s)
        self.max_rows = max_rows
        self._on_batch = on_batch
        self._queue: deque[_Pending] = deque()
        self._arrived: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.in_flight = 0
        self.in_flight_since: float | None = None  # time.monotonic() when the running forward started
        self.in_flight_tokens = 0                   # and the tokens it scores

    # -- public -------------------------------------------------------------------------------
    def configure(self, max_wait_s: float | None = None, max_rows: int | None = None) -> None:
        """Change the wait window and row cap; the next batch uses them."""
        if max_wait_s is not None:
            self.max_wait_s = float(max_wait_s)
        self.max_rows = max_rows

    @property
    def queued(self) -> int:
        """Requests waiting for a batch (not counting the one in flight)."""
        return len(self._queue)

    async def submit(self, rows: Sequence[Row]) -> Result:
        """Queue one request's rows; returns its (logits, P(action 0)) once its batch has run."""
        rows = list(rows)
        if not rows:
            return np.zeros((0, 1), np.float32), np.zeros(0, np.float32)
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._arrived = asyncio.Event()
            self._task = loop.create_task(self._loop(), name="laya-batcher")
        item = _Pending(rows, sum(len(r) for r in rows), time.monotonic(), loop.create_future())
        self._queue.append(item)
        self._arrived.set()
        return await item.future

    async def close(self) -> None:
        """Stop the batching task and fail whatever is still queued."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(RuntimeError("scorer is shutting down"))

    # -- batching -----------------------------------------------------------------------------
    def _take(self) -> tuple[list[_Pending], bool]:
        """Pop the batch that fits now, FIFO; True when it is full (the next one would not fit)."""
        budget = max(1, int(self._budget()))
        batch: list[_Pending] = []
        tokens = rows = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # caller gave up (cancelled): drop it before any work
                self._queue.popleft()
                continue
            over = tokens + head.tokens > budget or (self.max_rows and rows + len(head.rows) > self.max_rows)
            if batch and over:
                return batch, True
            batch.append(self._queue.popleft())
            tokens += head.tokens
            rows += len(head.rows)
        return batch, tokens >= budget or bool(self.max_rows and rows >= self.max_rows)

    async def _loop(self) -> None:
        assert self._arrived is not None
        while True:
            while not self._queue:
                self._arrived.clear()
                await self._arrived.wait()
            # the wait window counts from the oldest request's arrival, so requests that already
            # waited through a forward are not held back again
            deadline = self._queue[0].enqueued + self.max_wait_s
            while True:
                budget = max(1, int(self._budget()))
                queued_tokens = sum(p.tokens for p in self._queue)
                left = deadline - time.monotonic()
                if left <= 0 or queued_tokens >= budget or (
                        self.max_rows and sum(len(p.rows) for p in self._queue) >= self.max_rows):
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    break
            batch, _ = self._take()
            if batch:
                try:
                    await self._dispatch(batch)
                finally:  # also when cancelled: nothing is in flight any more
                    self.in_flight, self.in_flight_since = 0, None

    async def _dispatch(self, batch: list[_Pending]) -> None:
        now = time.monotonic()
        waits = [now - p.enqueued for p in batch]
        rows = [r for p in batch for r in p.rows]
        self.in_flight = len(batch)
        self.in_flight_since, self.in_flight_tokens = time.monotonic(), sum(p.tokens for p in batch)
        t = time.perf_counter()
        try:
            logits, act = await self._run(rows)
        except Exception as e:  # noqa: BLE001 - each request gets its own outcome below
            if len(batch) == 1:
                _set_exception(batch[0].future, e)
                self._record(batch, rows, waits, t, fallback=False)
            else:
                log.warning("a batch of %d requests failed (%s); retrying them one by one",
                            len(batch), type(e).__name__)
                for p in batch:
                    self.in_flight_since, self.in_flight_tokens = time.monotonic(), p.tokens
                    try:
                        _set_result(p.future, await self._run(p.rows))
                    except Exception as e1:  # noqa: BLE001
                        _set_exception(p.future, e1)
                self._record(batch, rows, waits, t, fallback=True)
            return
        self.in_flight, self.in_flight_since = 0, None
        pos = 0
        for p in batch:
            n = len(p.rows)
            _set_result(p.future, (logits[pos:pos + n].copy(), act[pos:pos + n].copy()))
            pos += n
        self._record(batch, rows, waits, t, fallback=False)

    def _record(self, batch: list[_Pending], rows: list[Row], waits: list[float], t: float,
                fallback: bool) -> None:
        if self._on_batch is None:
            return
        try:
            self._on_batch(BatchRecord(len(batch), len(rows), sum(p.tokens for p in batch), waits,
                                       time.perf_counter() - t, fallback))
        except Exception:  # noqa: BLE001 - metrics must never fail a request
            log.exception("batch metrics callback failed")


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
