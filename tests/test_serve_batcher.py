"""The scorer replica's cross-request batcher on a real Scorer (no Ray): budget, FIFO, window, poison, cancel."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from serve_app.online.batch_queue import TokenBatcher
from serve_app.scorer import Scorer

from .serve_helpers import POISON, FaultInjector


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint, engine):
    s = Scorer(tiny_checkpoint, backend="eager", device="cpu", max_batch_tokens=600)
    s.engine.backend = FaultInjector(s.engine.backend, s.engine)
    yield s
    s.close()


def _rows(engine, text: str, n_questions: int = 3):
    qs = {"q%d" % i: {"type": "choice", "instructions": "which one?", "criteria": ["a", "b", "c"]}
          for i in range(n_questions)}
    return engine.encode(text, engine.prepare(qs)).rows


def _run(coro):
    return asyncio.run(coro)


def test_requests_are_batched_fifo_under_the_budget_and_a_big_one_runs_alone(scorer, engine):
    reqs = [_rows(engine, "short state number %d" % i) for i in range(6)]
    reqs.insert(3, _rows(engine, "a long state " * 60, n_questions=8))  # alone over the 600-token budget
    records = []

    async def go():
        b = TokenBatcher(scorer.score_rows_async, lambda: scorer.budget, max_wait_s=0.05, on_batch=records.append)
        outs = await asyncio.gather(*(b.submit(r) for r in reqs))
        await b.close()
        return outs

    outs = _run(go())
    assert sum(r.requests for r in records) == len(reqs)
    sizes = [r.requests for r in records]
    tokens = [r.tokens for r in records]
    big = sum(len(r) for r in reqs[3])
    assert big > 600 and big in tokens and sizes[tokens.index(big)] == 1  # ran, by itself
    assert all(t <= 600 for t in tokens if t != big) and max(sizes) > 1
    # FIFO: the batches are the greedy in-order partition of the queue under the budget
    expected, cur = [], []
    for n in (sum(len(r) for r in rows) for rows in reqs):
        if cur and sum(cur) + n > 600:
            expected.append((len(cur), sum(cur)))
            cur = []
        cur.append(n)
    expected.append((len(cur), sum(cur)))
    assert [(r.requests, r.tokens) for r in records] == expected
    for rows, (logits, act) in zip(reqs, outs):
        want_l, want_a = engine.score(rows)
        assert logits.shape[0] == len(rows) and np.allclose(logits[:, :want_l.shape[1]], want_l, atol=1e-4)
        assert np.allclose(act, want_a, atol=1e-5)


def test_window_holds_the_first_request_until_others_can_join(scorer, engine):
    records = []

    async def go():
        # a 1 s window against a 0.1 s gap: a stall of a loaded machine cannot make the late ones miss it
        b = TokenBatcher(scorer.score_rows_async, lambda: 10 ** 6, max_wait_s=1.0, on_batch=records.append)
        t = time.monotonic()
        first = asyncio.ensure_future(b.submit(_rows(engine, "first")))
        await asyncio.sleep(0.1)
        await asyncio.gather(first, *(b.submit(_rows(engine, "late %d" % i)) for i in range(3)))
        waited = time.monotonic() - t
        await b.close()
        return waited

    waited = _run(go())
    assert waited >= 1.0 and [r.requests for r in records] == [4]
    assert max(records[0].waits_s) >= 1.0 and min(records[0].waits_s) < max(records[0].waits_s) - 0.05


def test_a_failing_batch_is_retried_per_request_so_only_the_poison_fails(scorer, engine):
    records = []

    async def go():
        b = TokenBatcher(scorer.score_rows_async, lambda: 10 ** 6, max_wait_s=0.1, on_batch=records.append)
        reqs = [_rows(engine, "good %d" % i) for i in range(4)]
        reqs.insert(2, engine.encode(POISON, engine.prepare({"q": {"type": "noul", "instructions": "?"}})).rows)
        outs = await asyncio.gather(*(b.submit(r) for r in reqs), return_exceptions=True)
        await b.close()
        return outs

    outs = _run(go())
    assert isinstance(outs[2], ValueError) and "poisoned" in str(outs[2])
    assert all(isinstance(o, tuple) for i, o in enumerate(outs) if i != 2)
    assert len(records) == 1 and records[0].fallback and records[0].requests == 5


def test_a_cancelled_request_is_dropped_before_it_is_scored(scorer, engine):
    records = []

    async def go():
        b = TokenBatcher(scorer.score_rows_async, lambda: 10 ** 6, max_wait_s=0.2, on_batch=records.append)
        gone = asyncio.ensure_future(b.submit(_rows(engine, "client went away")))
        kept = asyncio.ensure_future(b.submit(_rows(engine, "still here")))
        await asyncio.sleep(0.05)
        gone.cancel()
        await kept
        await b.close()

    _run(go())
    assert [r.requests for r in records] == [1] and records[0].rows == 3


def test_a_forward_past_its_stall_limit_fails_the_health_check(scorer, engine, tmp_path):
    """The batcher marks the running forward (start, tokens); `ScorerDeployment.check_health` fails once it has
    run `forward_stall_s` per token budget it scores, and not before; with a GPU lock, counted from when this
    process took it (a forward waiting for another process's is not stuck)."""
    from types import SimpleNamespace

    from model.backends.gpu_lock import GpuLock
    from serve_app.online.scorer_deployment import ScorerDeployment

    from .serve_helpers import HANG, HANG_S

    check = ScorerDeployment.func_or_class.check_health
    rows = _rows(engine, "a state %s here" % HANG, 1)
    tokens = sum(len(r) for r in rows)
    lock = GpuLock(str(tmp_path / "gpu.lock"))

    def replica(budget: int, stall_s: float, gpu_lock=None):
        return SimpleNamespace(batcher=b, scorer=SimpleNamespace(budget=budget, gpu_lock=gpu_lock),
                               forward_stall_s=stall_s, _broken=None)

    async def run():
        task = asyncio.ensure_future(b.submit(rows))
        await asyncio.sleep(0.6)
        assert b.in_flight_since is not None and b.in_flight_tokens == tokens
        check(replica(scorer.budget, 0.3, lock))   # 0.6 s in flight, but the GPU lock not taken yet: waiting
        with lock:
            check(replica(scorer.budget, 0.3, lock))   # taken just now: 0.6 s in flight, none of it on the GPU
            await asyncio.sleep(0.4)
            with pytest.raises(RuntimeError, match="device is stuck"):
                check(replica(scorer.budget, 0.3, lock))   # 0.4 s on the GPU past the 0.3 s limit
        stuck = replica(scorer.budget, 0.3)  # one budget's worth (tokens <= 600): the limit is 0.3 s
        with pytest.raises(RuntimeError, match="device is stuck"):
            check(stuck)
        with pytest.raises(RuntimeError, match="device is stuck"):  # and it stays unhealthy
            check(stuck)
        check(replica(max(1, tokens // 5), 0.3))  # five or more budgets' worth: >= 1.5 s allowed, 1.0 s run
        await task
        assert b.in_flight_since is None
        check(replica(scorer.budget, 0.3))

    scorer.engine.backend.hang_s = 1.5
    b = TokenBatcher(scorer.score_rows_async, lambda: scorer.budget)
    try:
        asyncio.run(run())
    finally:
        scorer.engine.backend.hang_s = HANG_S
