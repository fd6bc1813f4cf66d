"""Token-budget planning and the scorer's micro-batching, order restoration and OOM halving."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from serve_app.planning import batch_cost, pick_budget, plan
from serve_app.scorer import Scorer

from .cases import cases


@pytest.mark.parametrize("packed", [False, True])
def test_plan_covers_every_row_once_under_budget(packed):
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 600) for _ in range(rng.randint(0, 80))]
        budget = rng.choice([64, 512, 2048, 8192])
        batches = plan(lengths, budget, packed=packed, max_rows=rng.choice([None, 7]))
        flat = sorted(i for b in batches for i in b)
        assert flat == list(range(len(lengths)))
        for b in batches:
            ls = [lengths[i] for i in b]
            assert len(b) == 1 or batch_cost(ls, packed) <= budget


def test_plan_rejects_a_nonpositive_budget():
    with pytest.raises(ValueError, match="max_batch_tokens"):
        plan([3, 4], 0)


class _OOMAbove:
    """Wraps a real backend; raises torch.cuda.OutOfMemoryError for padded batches above a size."""

    def __init__(self, backend, limit):
        self.inner, self.limit, self.calls = backend, limit, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows):
        cost = len(rows) * max(len(r.ids) for r in rows)
        self.calls.append(cost)
        if cost > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner.forward(rows)


def test_scorer_matches_engine_and_survives_oom(tiny_checkpoint, engine):
    scorer = Scorer(tiny_checkpoint, backend="eager", device="cpu", max_batch_tokens=100_000)
    states, qs = cases(40, seed=5)[10]
    states = states * 7
    p = engine.prepare(qs)
    encs = engine.encode_many(states, p)
    rows = [r for e in encs for r in e.rows]
    want = [engine.decode(p, e, *engine.score(e.rows)) for e in encs]

    scorer.engine.backend = _OOMAbove(scorer.engine.backend, limit=2000)
    logits, act = scorer.score_rows(rows)
    assert scorer.budget <= 2000 and scorer.stats.oom_retries >= 1
    assert max(c for c in scorer.engine.backend.calls[-3:]) <= 2000
    pos, got = 0, []
    for e in encs:
        n = len(e.rows)
        got.append(engine.decode(p, e, logits[pos:pos + n], act[pos:pos + n]))
        pos += n
    # micro-batches pad differently than one big batch: equal up to float noise, same answers
    for g, w in zip(got, want):
        for qid in w["answers"]:
            ga, wa = g["answers"][qid], w["answers"][qid]
            assert ga.keys() == wa.keys(), qid
            if "probabilities" in wa:
                assert ga["probabilities"].keys() == wa["probabilities"].keys()
                assert np.allclose(list(ga["probabilities"].values()), list(wa["probabilities"].values()), atol=2e-4)
            if "noul" in wa:
                assert abs(ga["noul"] - wa["noul"]) <= 2e-4
    assert scorer.stats.rows == len(rows)
    scorer.close()


def test_scorer_gives_a_chunking_backend_every_micro_batch_in_one_call(tiny_checkpoint, engine):
    """The fast backend (its torch ops here) cuts its own chunks and pipelines them: the scorer hands it all of a
    call's micro-batches at once (one forward, several chunks), with the answers of scoring each row alone."""
    scorer = Scorer(tiny_checkpoint, backend="fast", device="cpu", max_batch_tokens=2048,
                    backend_options={"ops": "torch", "max_batch_tokens": 2048})
    be = scorer.engine.backend
    assert be.chunk_tokens == scorer.budget
    states, qs = cases(40, seed=5)[10]
    p = scorer.engine.prepare(qs)
    rows = [r for e in scorer.engine.encode_many(states * 7, p) for r in e.rows]
    assert sum(len(r) for r in rows) > 3 * scorer.budget
    f0, c0 = be.stats.forwards, be.stats.chunks
    logits, act = scorer.score_rows(rows)
    assert be.stats.forwards - f0 == 1 and be.stats.chunks - c0 >= 3
    assert scorer.stats.batches >= 3 and scorer.stats.rows == len(rows)
    for i in range(0, len(rows), 7):
        lg, a = engine.score([rows[i]])   # eager fp32, one row
        np.testing.assert_allclose(logits[i, :lg.shape[1]], lg[0], atol=2e-4, rtol=1e-4)
        assert (logits[i, lg.shape[1]:] == -1e4).all() and abs(act[i] - a[0]) < 1e-4
    scorer.set_budget(1024)   # below the backend's largest bucket: still one call, every chunk within the budget
    f0, c0, p0 = be.stats.forwards, be.stats.chunks, be.stats.padded_tokens
    logits2, act2 = scorer.score_rows(rows)
    assert be.stats.forwards - f0 == 1 and be.stats.chunks - c0 >= 6
    assert be.stats.padded_tokens - p0 <= 1024 * (be.stats.chunks - c0)
    np.testing.assert_allclose(logits2, logits, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(act2, act, atol=1e-4)
    scorer.max_batch_rows = 5   # a row cap: one call a micro-batch, each within it
    f0 = be.stats.forwards
    logits3, _ = scorer.score_rows(rows)
    assert be.stats.forwards - f0 >= len(rows) // 5
    np.testing.assert_allclose(logits3, logits, atol=2e-4, rtol=1e-4)
    scorer.close()


def test_single_row_that_never_fits_raises_instead_of_looping(tiny_checkpoint, engine):
    scorer = Scorer(tiny_checkpoint, backend="eager", device="cpu", max_batch_tokens=4096)
    scorer.engine.backend = _OOMAbove(scorer.engine.backend, limit=1)
    p = engine.prepare({"q": {"type": "noul", "instructions": "x?"}})
    with pytest.raises(torch.cuda.OutOfMemoryError):
        scorer.score_rows(engine.encode("a state", p).rows)
    scorer.close()


def test_budget_choice_compares_against_the_best_of_all_measured_budgets():
    # a noisy step (8192 barely above 4096) must not stop the search: 65536 is best, 32768 within 5% of it
    measured = [(4096, 300e3), (8192, 305e3), (16384, 400e3), (32768, 470e3), (65536, 487e3), (131072, 480e3)]
    assert pick_budget(measured, 512) == 32768
    assert pick_budget(measured, 512, within=0.0) == 65536
    assert pick_budget([(4096, 1.0), (8192, 0.5)], 512) == 4096  # bigger is slower: keep the small one
    assert pick_budget([], 512) == 512  # the first candidate did not fit


def test_a_one_micro_batch_call_is_launched_from_the_loop_and_polled(tiny_checkpoint):
    """`score_rows_async` launches rows that make one micro-batch from the event loop and polls for them (the
    fast backend, its torch ops here, where a launch has finished when queued): the answers of the forward
    thread's path, the forward's lock free after, the counters counted. More than one micro-batch, a forward
    already holding the lock, or a wrapped backend (as fault injection installs) take the forward thread."""
    import asyncio

    scorer = Scorer(tiny_checkpoint, backend="fast", device="cpu", max_batch_tokens=2048,
                    backend_options={"ops": "torch", "max_batch_tokens": 2048})
    scorer.poll_on_cpu = True
    states, qs = cases(40, seed=3)[12]
    p = scorer.engine.prepare(qs)
    rows = [r for e in scorer.engine.encode_many(states * 16, p) for r in e.rows]
    few = rows[:9]
    ff = scorer.engine.backend.engine
    ref_few, ref_all = scorer.score_rows(few), scorer.score_rows(rows)
    assert sum(len(r) for r in rows) > scorer.budget
    polled, threaded = [], []
    real = scorer._score_rows
    scorer._score_rows = lambda rs: threaded.append(len(rs)) or real(rs)
    real_polled = scorer._score_polled

    async def spy(rs):
        out = await real_polled(rs)
        polled.append(out is not None)
        return out
    scorer._score_polled = spy

    async def go():
        return [await scorer.score_rows_async(few), await scorer.score_rows_async(rows)]

    b0 = scorer.stats.batches
    (lg, act), (lg_all, act_all) = asyncio.run(go())
    assert polled == [True, False] and threaded == [len(rows)]
    np.testing.assert_array_equal(lg, ref_few[0])
    np.testing.assert_array_equal(act, ref_few[1])
    np.testing.assert_array_equal(lg_all, ref_all[0])
    assert scorer.stats.batches - b0 >= 2
    assert ff._lock.acquire(blocking=False)   # collected: the lock is free (re-entrant: this thread may hold it)
    ff._lock.release()
    held = __import__("threading").Event()
    release = __import__("threading").Event()

    def hold():
        with ff._lock:
            held.set()
            release.wait(10)
    t = __import__("threading").Thread(target=hold)
    t.start()
    held.wait(10)
    assert scorer.engine.launch(few) is None   # another thread's forward holds the lock: nothing queued
    release.set()
    t.join()

    class Wrapper:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)
    scorer.engine.backend = Wrapper(scorer.engine.backend)
    assert scorer.engine.launch(few) is None
    scorer.close()


def test_the_polled_forward_is_switched_by_its_variable(tiny_checkpoint, monkeypatch):
    from serve_app.scorer import POLL_ENV

    for value, on in (("0", False), ("off", False), ("1", True), ("", True)):
        monkeypatch.setenv(POLL_ENV, value)
        s = Scorer(tiny_checkpoint, backend="eager", device="cpu", warmup=False)
        assert s.poll_forward is on
        s.close()
    monkeypatch.setenv(POLL_ENV, "sometimes")
    with pytest.raises(ValueError, match=POLL_ENV):
        Scorer(tiny_checkpoint, backend="eager", device="cpu", warmup=False)
