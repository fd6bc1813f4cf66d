"""Ingress-side coalescing: concurrent requests of one ingress replica share scorer calls.

Every DeploymentHandle call costs a fixed amount of CPU in the router, in Ray's actor transport and in
the scorer replica's event loop, whatever it carries; under load that fixed cost, not the GPU, caps the
requests per second. So each ingress replica keeps at most `max_inflight` scorer calls outstanding: a
request that finds a free slot is sent at once (alone: no added latency when the service is idle), and
requests that arrive while every slot is busy wait here and leave together, as one call, when a slot
frees. The scorer still batches per request (each request is its own item in its token batcher), so a
poison request fails alone and per-request metrics keep counting requests.

`send(groups)` does the call: it gets a list of row lists (one per request) and returns one result per
request, in order. An exception from `send` (overload, timeout, a dead replica after retries) goes to
every request of that call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Waiting:
    rows: Sequence[Any]
    tokens: int
    future: asyncio.Future = field(repr=False)


class CallCoalescer:
    """At most `max_inflight` outstanding calls; waiting requests leave together, up to `max_call_tokens`."""

    def __init__(self, send: Callable[[list[Sequence[Any]]], Awaitable[list[Any]]], max_inflight: int = 4,
                 max_call_tokens: int = 65536, max_call_requests: int = 512):
        if max_inflight < 1 or max_call_tokens < 1 or max_call_requests < 1:
            raise ValueError("max_inflight, max_call_tokens and max_call_requests must be >= 1")
        self._send = send
        self.max_inflight = int(max_inflight)
        self.max_call_tokens = int(max_call_tokens)
        self.max_call_requests = int(max_call_requests)
        self._waiting: deque[_Waiting] = deque()
        self._tasks: set[asyncio.Task] = set()
        self.inflight = 0
        self.calls = 0
        self.requests = 0

    @property
    def waiting(self) -> int:
        """Requests waiting for a free call slot."""
        return len(self._waiting)

    async def submit(self, rows: Sequence[Any]) -> Any:
        """This request's result from the call it rides in."""
        loop = asyncio.get_running_loop()
        item = _Waiting(rows, sum(len(r) for r in rows), loop.create_future())
        self._waiting.append(item)
        self._pump()
        return await item.future

    def _pump(self) -> None:
        while self._waiting and self.inflight < self.max_inflight:
            group = self._take()
            if not group:
                return
            self.inflight += 1
            task = asyncio.get_running_loop().create_task(self._call(group), name="laya-scorer-call")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Waiting]:
        group: list[_Waiting] = []
        tokens = 0
        while self._waiting:
            head = self._waiting[0]
            if head.future.done():  # its caller went away (client disconnected, cancelled)
                self._waiting.popleft()
                continue
            if group and (tokens + head.tokens > self.max_call_tokens or len(group) >= self.max_call_requests):
                break
            group.append(self._waiting.popleft())
            tokens += head.tokens
        return group

    async def _call(self, group: list[_Waiting]) -> None:
        self.calls += 1
        self.requests += len(group)
        try:
            outs = await self._send([w.rows for w in group])
            if len(outs) != len(group):
                raise RuntimeError("scorer returned %d results for %d requests" % (len(outs), len(group)))
            for w, out in zip(group, outs):
                if not w.future.done():
                    w.future.set_result(out)
        except asyncio.CancelledError:  # this replica is shutting down: its waiters are cancelled too
            for w in group:
                w.future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - every request of the call gets the outcome
            for w in group:
                if not w.future.done():
                    w.future.set_exception(e)
        finally:
            self.inflight -= 1
            self._pump()
