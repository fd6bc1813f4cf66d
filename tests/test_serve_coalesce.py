"""The ingress's call coalescer (no Ray): idle requests go alone, busy-time arrivals share one call."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.online.coalescer import CallCoalescer


class Scorer:
    """A real async callee standing in for the handle call: records each call's groups, answers per request.

    Calls wait for `release()` (none is held once released), so a test decides when the busy slot frees; a
    timed wait would race the requests arriving meanwhile on a loaded machine."""

    def __init__(self, fail_on: str | None = None):
        self.fail_on = fail_on
        self.calls: list[list[str]] = []
        self._free = asyncio.Event()

    def release(self) -> None:
        self._free.set()

    async def send(self, groups):
        names = [g[0][0] for g in groups]  # each group: one request's rows; a row starts with its name
        self.calls.append(names)
        await self._free.wait()
        if self.fail_on in names:
            raise RuntimeError("call failed")
        return ["answer:" + n for n in names]


async def _busy(c: CallCoalescer, first: str, later: list[tuple[str, int]], release) -> list:
    """Submit `first` (its call takes the one slot), then the `later` requests ((name, tokens) each) while that call
    is out, then `release(their tasks)` to free the slot; returns every outcome (exceptions included), `first`'s
    first."""
    head = asyncio.ensure_future(c.submit([_row(first)]))
    await asyncio.sleep(0)  # `first` is taken into a call
    assert c.inflight == 1 and c.waiting == 0
    rest = [asyncio.ensure_future(c.submit([_row(n, k)])) for n, k in later]
    await asyncio.sleep(0)  # the later ones are waiting for the slot
    assert c.waiting == len(later)
    release(rest)
    return await asyncio.gather(head, *rest, return_exceptions=True)


def _row(name: str, tokens: int = 10) -> list:
    return [name] + ["t"] * (tokens - 1)  # a request of one row of `tokens` tokens, named by its first token


def test_an_idle_request_is_sent_at_once_and_alone():
    s = Scorer()
    s.release()

    async def go():
        c = CallCoalescer(s.send, max_inflight=2)
        loop = asyncio.get_running_loop()
        t = loop.time()
        out = await c.submit([_row("a")])
        return out, loop.time() - t, c

    out, took, c = asyncio.run(go())
    assert out == "answer:a" and s.calls == [["a"]] and took < 0.02
    assert (c.calls, c.requests, c.inflight, c.waiting) == (1, 1, 0, 0)


def test_requests_arriving_while_slots_are_busy_leave_together_in_order():
    s = Scorer()

    async def go():
        c = CallCoalescer(s.send, max_inflight=1)  # r0's call is out; the next five wait for the slot
        return await _busy(c, "r0", [("r%d" % i, 10) for i in range(1, 6)], lambda _: s.release())

    outs = asyncio.run(go())
    assert outs == ["answer:r%d" % i for i in range(6)]
    assert s.calls == [["r0"], ["r1", "r2", "r3", "r4", "r5"]]


def test_a_shared_call_is_cut_at_the_token_cap_but_a_big_request_still_goes():
    s = Scorer()

    async def go():
        c = CallCoalescer(s.send, max_inflight=1, max_call_tokens=25)
        sizes = {"r1": 10, "r2": 10, "r3": 10, "big": 60, "r4": 5}
        return await _busy(c, "r0", list(sizes.items()), lambda _: s.release())

    outs = asyncio.run(go())
    assert outs == ["answer:" + n for n in ("r0", "r1", "r2", "r3", "big", "r4")]
    assert s.calls == [["r0"], ["r1", "r2"], ["r3"], ["big"], ["r4"]]


def test_a_failed_call_fails_only_its_own_requests():
    s = Scorer(fail_on="bad")

    async def go():
        c = CallCoalescer(s.send, max_inflight=1)
        return await _busy(c, "bad", [("x", 10), ("y", 10)], lambda _: s.release())

    first, x, y = asyncio.run(go())
    assert isinstance(first, RuntimeError) and (x, y) == ("answer:x", "answer:y")
    assert s.calls == [["bad"], ["x", "y"]]


def test_a_cancelled_waiter_is_dropped_before_its_call():
    s = Scorer()

    async def go():
        c = CallCoalescer(s.send, max_inflight=1)

        def cancel_gone_then_release(tasks):
            tasks[0].cancel()
            s.release()

        first, gone, kept = await _busy(c, "r0", [("gone", 10), ("kept", 10)], cancel_gone_then_release)
        assert isinstance(gone, asyncio.CancelledError)
        return [first, kept]

    assert asyncio.run(go()) == ["answer:r0", "answer:kept"]
    assert s.calls == [["r0"], ["kept"]]


def test_a_short_result_list_is_an_error_not_a_misattributed_answer():
    s = Scorer()

    async def short(groups):
        await s.send(groups)
        return ["answer"]  # one result whatever the call carried

    async def go():
        c = CallCoalescer(short, max_inflight=1)
        return await _busy(c, "r0", [("a", 10), ("b", 10)], lambda _: s.release())

    first, a, b = asyncio.run(go())
    assert first == "answer"
    assert all(isinstance(x, RuntimeError) and "1 results for 2 requests" in str(x) for x in (a, b))


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        CallCoalescer(Scorer().send, max_inflight=0)


class _Slow:
    """A handle method whose call never finishes (a scorer with no replica yet), cancellable like Serve's."""

    def __init__(self):
        self.cancelled = 0

    def remote(self, groups):
        slow = self

        class Response:
            def __await__(self):
                return asyncio.sleep(3600).__await__()

            def cancel(self):
                slow.cancelled += 1

        return Response()


@pytest.mark.parametrize("warm, status", [(False, 503), (True, 504)])
def test_a_call_past_the_deadline_is_503_while_the_checkpoint_is_cold_else_504(tiny_checkpoint, warm, status):
    from serve_app.online import ray_compat
    from serve_app.online.request_checks import HTTPError
    from serve_app.online.schemas import Limits
    from serve_app.online.served import ServedCheckpoint

    class Handle:
        def __init__(self):
            self.score_many = _Slow()

    async def is_warm():
        return warm

    handle = Handle()

    async def go():
        served = ServedCheckpoint("multilingual", tiny_checkpoint, handle, Limits(scorer_timeout_s=0.2),
                                  ray_compat.errors(), is_warm=is_warm)
        with pytest.raises(HTTPError) as e:
            await served.score([[1, 2, 3]])
        return e.value

    err = asyncio.run(go())
    assert err.status == status and handle.score_many.cancelled == 1
    if warm:
        assert err.detail == "scoring timed out" and not err.headers
    else:
        assert err.detail == "checkpoint 'multilingual' is starting, try again later"
        assert err.headers == {"Retry-After": "5"}
