"""The `min_confidence` gate (model/abstention.py, Engine.predict[_batch]) against upstream `laya` 0.4.15 itself."""

from __future__ import annotations

import copy
import math
import statistics

import pytest

from model import abstention

from .cases import cases

CASES = cases(8, seed=11)
GATE_KEYS = ("low_confidence", "abstention", "abstention_threshold")


def _answers(results):
    return [a for r in results for a in r["answers"].values()]


def _leaves(value, where):
    """(path, value) of every leaf of a JSON value, in key order; containers appear as (path, their type)."""
    if isinstance(value, (dict, list)):
        yield where, type(value)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            yield from _leaves(v, "%s.%s" % (where, k))
    else:
        yield where, value


def assert_same(ours, theirs, where="result", tol=1e-4):
    """Same structure, key order and types, equal non-floats, floats within `tol`."""
    a, b = list(_leaves(ours, where)), list(_leaves(theirs, where))
    assert [p for p, _ in a] == [p for p, _ in b], where
    for (path, x), (_, y) in zip(a, b):
        assert type(x) is type(y), path
        assert abs(x - y) <= tol if isinstance(x, float) else x == y, "%s: %r vs %r" % (path, x, y)


@pytest.fixture(scope="module")
def observed(engine):
    """The ungated answers of every case, and their confidences, sorted."""
    plain = [engine.predict_batch(states, qs) for states, qs in CASES]
    confs = sorted({a["answer_confidence"] for res in plain for a in _answers(res)})
    assert len(confs) > 20
    return plain, confs


def _thresholds(confs, buckets):
    median = statistics.median(confs)
    numbers = [0, 0.0, 1, 1.0, median, confs[0], confs[-1], confs[len(confs) // 3], confs[2 * len(confs) // 3],
               math.nextafter(median, 0.0), math.nextafter(median, 1.0)]
    per_bucket = {b: confs[(i * 7) % len(confs)] for i, b in enumerate(sorted(buckets))}
    maps = [per_bucket, dict(per_bucket, default=median), {"default": median}, {"default": 1},
            {sorted(buckets)[0]: 1.0}, {"noul:11+": 0.99, "default": 0.0}]
    return numbers + maps


def test_gated_answers_match_upstream(engine, oracle, observed):
    """For numbers and per-bucket maps (0, 1, exactly at an observed confidence, just either side of it, per
    bucket, with and without a default): the same answers, flags, states, thresholds and key order."""
    plain, confs = observed
    buckets = {abstention.bucket(a) for res in plain for a in _answers(res)}
    assert {"choice:2", "choice:3-5", "noul:2"} <= buckets
    states_seen = {}
    for thr in _thresholds(confs, buckets):
        for (states, qs), base in zip(CASES, plain):
            ours = engine.predict_batch(states, qs, min_confidence=thr)
            theirs = oracle.predict_batch(states, qs, min_confidence=thr)
            assert_same(ours, theirs, "min_confidence=%r" % (thr,))
            for a, b in zip(_answers(ours), _answers(base)):  # the gate only adds its keys, at the end
                assert {k: v for k, v in a.items() if k not in GATE_KEYS} == b
                assert list(a)[len(b):] == [k for k in GATE_KEYS if k in a]
                states_seen.setdefault(repr(thr), set()).add(a["abstention"])
    median = repr(statistics.median(confs))
    assert states_seen[median] == {"passed", "abstained"}  # both sides of the gate were exercised
    assert states_seen["0"] == {"passed"} and states_seen[repr(confs[0])] == {"passed"}
    assert "abstained" in states_seen["1"]


def test_exactly_at_a_confidence_passes(engine, observed):
    """`conf < threshold` abstains: an answer at exactly its own confidence passes, one ulp above abstains."""
    plain, _confs = observed
    states, qs = CASES[0]
    qid, conf = next((q, a["answer_confidence"]) for q, a in plain[0][0]["answers"].items()
                     if a["answer_confidence"] < 0.99)
    at = engine.predict_batch(states[:1], qs, min_confidence=conf)[0]["answers"][qid]
    above = engine.predict_batch(states[:1], qs, min_confidence=math.nextafter(conf, 1.0))[0]["answers"][qid]
    assert at["abstention"] == "passed" and "low_confidence" not in at and at["abstention_threshold"] == conf
    assert above["abstention"] == "abstained" and above["low_confidence"] is True


def test_predict_gates_like_predict_batch_and_upstream(engine, oracle, observed):
    _plain, confs = observed
    states, qs = CASES[2]
    thr = statistics.median(confs)
    assert_same(engine.predict(states[0], qs, min_confidence=thr), oracle.predict(states[0], qs, min_confidence=thr))
    assert engine.predict(states[0], qs) == engine.predict(states[0], qs, min_confidence=None)
    assert not any(k in a for a in engine.predict(states[0], qs)["answers"].values() for k in GATE_KEYS)


BAD = [-0.01, 1.0001, math.nan, math.inf, -math.inf, True, False, "0.5", [0.5], {},
       {"choice:4": 0.5}, {"Choice:2": 0.5}, {"default": 2}, {"default": True}, {1: 0.5}, {"noul:2": "high"},
       {"score:3-5": math.nan}, {"choice:2": 0.5, "bogus": 0.1}]


@pytest.mark.parametrize("bad", BAD, ids=[repr(b) for b in BAD])
def test_bad_thresholds_raise_upstreams_error(engine, oracle, bad):
    from laya.confidence import check_min_confidence

    with pytest.raises(ValueError) as theirs:
        check_min_confidence(bad)
    with pytest.raises(ValueError) as ours:
        abstention.check(bad)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError) as engine_error:  # validated before anything runs, as upstream's predict does
        engine.predict_batch("not a list", {}, min_confidence=bad)
    assert str(engine_error.value) == str(theirs.value)
    with pytest.raises(ValueError) as oracle_error:
        oracle.predict("x", {"q": {"type": "noul", "instructions": "?"}}, min_confidence=bad)
    assert str(oracle_error.value) == str(theirs.value)


def test_check_returns_upstreams_normal_form():
    from laya.confidence import check_min_confidence

    for good in (0, 1, 0.25, {"default": 0}, {"choice:11+": 1, "noul:2": 0.5}):
        ours, theirs = abstention.check(good), check_min_confidence(good)
        assert ours == theirs and type(ours) is type(theirs)
        if isinstance(ours, dict):
            assert all(type(v) is float for v in ours.values())
    assert abstention.BUCKETS | {"default"} == __import__("laya.confidence").confidence.bucket_keys() | {"default"}


ODD = [{"type": "choice", "choice": "a", "probabilities": {"a": 0.6, "b": 0.4}},  # no confidence at all
       {"type": "choice", "confidence": 0.2, "probabilities": {"a": 0.6, "b": 0.4}},  # the older field only
       {"type": "noul", "noul": 0.5, "answer_confidence": math.nan, "confidence": 0.7},
       {"type": "noul", "noul": 0.5, "answer_confidence": True},
       {"type": "score", "answer_confidence": 0.3, "probabilities": {str(i): 0.1 for i in range(12)}},
       {"type": "unknown", "answer_confidence": 0.1},
       {"type": "choice", "answer_confidence": 0.9, "low_confidence": True},  # a stale flag is cleared
       {"type": "noul", "answer_confidence": 0.1, "abstention": "passed"}]


@pytest.mark.parametrize("thr", [0.0, 0.5, {"default": 0.5}, {"score:11+": 0.9}, {"choice:2": 0.8}])
def test_odd_answers_gate_as_upstream(thr):
    """Answers without a usable confidence (unevaluated), the fallback field, an unknown type, a reused payload."""
    from laya.confidence import apply_confidence_gate

    results = [{"answers": {str(i): dict(a) for i, a in enumerate(ODD)}}, {"model": "m", "error": "failed"}]
    theirs = copy.deepcopy(results)
    abstention.apply(results, abstention.check(thr))
    apply_confidence_gate(theirs, thr)
    assert repr(results) == repr(theirs)  # NaN-safe, order-sensitive
    assert {a["abstention"] for a in results[0]["answers"].values()} >= {"unevaluated", "passed"}


def test_no_threshold_writes_nothing():
    results = [{"answers": {"q": dict(ODD[1])}}]
    abstention.apply(results, None)
    assert results == [{"answers": {"q": ODD[1]}}]
