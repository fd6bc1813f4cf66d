"""Answers equal upstream `laya` 0.4.15 on the same checkpoint (CPU fp32)."""

from __future__ import annotations

import pytest

from .cases import cases

CASES = cases(64)


def _assert_same(ours, theirs, where, tol=1e-6):
    assert type(ours) is type(theirs), where
    if isinstance(ours, dict):
        assert list(ours.keys()) == list(theirs.keys()), where
        for k in ours:
            _assert_same(ours[k], theirs[k], "%s.%s" % (where, k), tol)
    elif isinstance(ours, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, "%s[%d]" % (where, i), tol)
    elif isinstance(ours, float):
        assert abs(ours - theirs) <= tol, "%s: %r vs %r" % (where, ours, theirs)
    else:
        assert ours == theirs, "%s: %r vs %r" % (where, ours, theirs)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_predict_batch_matches_upstream(engine, oracle, i):
    states, qs = CASES[i]
    _assert_same(engine.predict_batch(states, qs), oracle.predict_batch(states, qs), "case%d" % i)


def test_cases_cover_the_hard_shapes(engine):
    """The generated set really contains truncation, 1-option, 20+ options, 32 levels and custom labels."""
    truncated = kinds = 0
    seen = set()
    for states, qs in CASES:
        for q in qs.values():
            crit = q.get("criteria")
            if q["type"] == "choice" and len(crit) == 1:
                seen.add("one")
            if q["type"] == "choice" and len(crit) >= 20:
                seen.add("many")
            if q["type"] == "score" and len(crit) == 32:
                seen.add("32")
            if "labels" in q:
                seen.add("labels")
        kinds |= 1 << len({type(s).__name__ for s in states})
        truncated += any(r["usage"]["truncated"] for r in engine.predict_batch(states, qs))
    assert seen == {"one", "many", "32", "labels"}
    assert truncated >= 5
    assert kinds & 0b1100  # some batches mix state types


def test_single_predict_and_chunked_batches_match_upstream(engine, oracle):
    states, qs = CASES[3]
    _assert_same(engine.predict(states[0], qs), oracle.predict(states[0], qs), "predict")
    many = [s for st, _ in CASES[:12] for s in st]
    qs = CASES[1][1]
    _assert_same(engine.predict_batch(many, qs, batch_size=4, sort_by_length=True),
                 oracle.predict_batch(many, qs, batch_size=4, sort_by_length=True), "sorted")
    _assert_same(engine.predict_batch(many, qs, batch_size=3), oracle.predict_batch(many, qs, batch_size=3), "chunked")


def test_predict_batch_tokenizes_ahead_and_decodes_behind_the_forward(engine, tiny_checkpoint, monkeypatch):
    """More than one window: every window after the first is tokenized on the engine's worker thread (while the
    caller scores the one before), every chunk's states but the last one's are decoded on another (while the caller
    scores the next), and the answers are those of one window. A packed backend (the fast one, on its torch ops)
    keeps windows of batch_size states even when sorting by length, which gains it nothing."""
    import threading

    import model

    many = [s for st, _ in CASES[:12] for s in st]
    qs = CASES[1][1]
    fast = model.load(tiny_checkpoint, device="cpu", backend="fast", ops="torch", max_batch_tokens=4096)
    for eng, batch, windows in ((engine, 4, -(-len(many) // 32)), (fast, 4, -(-len(many) // 4))):
        whole = eng.predict_batch(many, qs)
        names, decoders, encode, decode = [], [], eng.encode_many, eng.decode
        eng.encode_many = lambda states, prep, f=encode, seen=names: (
            seen.append(threading.current_thread().name), f(states, prep))[1]
        eng.decode = lambda *a, f=decode, seen=decoders: (seen.append(threading.current_thread().name), f(*a))[1]
        try:
            got = eng.predict_batch(many, qs, batch_size=batch, sort_by_length=True)
        finally:
            del eng.encode_many, eng.decode
        assert len(names) == windows > 1 and all(n.startswith("laya-encode") for n in names)
        last = len(many) % batch or batch   # the last chunk's states, decoded by the caller: nothing left to overlap
        assert len(decoders) == len(many)
        mine = threading.current_thread().name   # the worker may still decode a chunk while the caller decodes its last
        assert decoders.count(mine) == last and all(n == mine or n.startswith("laya-decode") for n in decoders)
        _assert_same(got, whole, "windows", 2e-4)   # other batches: 4-decimal values may round the other way
    # all states in one forward: the packed backend tokenizes the first fifth, then the rest while the first fifth
    # scores if their rows hold LEAD_MIN_TOKENS tokens (else one forward for all), and the answers are the eager
    # engine's; below LEAD_MIN_STATES states, one window
    from model import engine as E

    for states, min_tokens in ((many, 0), (many, 10 ** 9), (many[:E.LEAD_MIN_STATES], 0),
                               (many[:E.LEAD_MIN_STATES - 1], 0)):
        sizes, forwards, encode, score = [], [], fast.encode_many, fast.score
        fast.encode_many = lambda st, prep, f=encode, seen=sizes: (seen.append(len(st)), f(st, prep))[1]
        fast.score = lambda rows, f=score, seen=forwards: (seen.append(len(rows)), f(rows))[1]
        monkeypatch.setattr(E, "LEAD_MIN_TOKENS", min_tokens)
        try:
            got = fast.predict_batch(states, qs)
        finally:
            del fast.encode_many, fast.score
        lead = -(-len(states) // E.LEAD_PARTS)
        split = len(states) >= E.LEAD_MIN_STATES
        assert sizes == ([lead, len(states) - lead] if split else [len(states)]), sizes
        assert len(forwards) == (2 if split and not min_tokens else 1), forwards
        _assert_same(got, engine.predict_batch(states, qs), "lead window", 2e-4)


def test_empty_inputs_match_upstream(engine, oracle):
    assert engine.predict_batch([], CASES[0][1]) == oracle.predict_batch([], CASES[0][1]) == []
    assert engine.predict("x", {}) == oracle.predict("x", {})


def test_type_errors_match_upstream(engine, oracle):
    for bad in ("a string", {"a": 1}):
        with pytest.raises(TypeError):
            engine.predict_batch(bad, CASES[0][1])
        with pytest.raises(TypeError):
            oracle.predict_batch(bad, CASES[0][1])
    with pytest.raises(TypeError):
        engine.predict_batch(["ok", None], CASES[0][1])
    with pytest.raises(TypeError):
        engine.predict("x", ["not", "a", "dict"])
