"""Every validation rule: the error type, and a message that names the question."""

from __future__ import annotations

import pytest

from model.questions import validate_question, validate_questions

OK_INS = "Is this fine?"

BAD = [
    ("type", {"type": "multiple", "instructions": OK_INS}, "unknown type"),
    ("notype", {"instructions": OK_INS}, "unknown type"),
    ("noins", {"type": "noul"}, "no 'instructions'"),
    ("nullins", {"type": "noul", "instructions": None}, "must not be None"),
    ("emptyins", {"type": "noul", "instructions": "   "}, "must not be empty"),
    ("emptylistins", {"type": "noul", "instructions": []}, "must not be empty"),
    ("boolins", {"type": "noul", "instructions": True}, "must be a string"),
    ("setins", {"type": "noul", "instructions": {1, 2}}, "must be a string"),
    ("choice-nocrit", {"type": "choice", "instructions": OK_INS}, "takes 'criteria'"),
    ("choice-strcrit", {"type": "choice", "instructions": OK_INS, "criteria": "a,b"}, "takes 'criteria'"),
    ("choice-empty", {"type": "choice", "instructions": OK_INS, "criteria": {}}, "at least one"),
    ("choice-null-label", {"type": "choice", "instructions": OK_INS, "criteria": ["a", None]}, "null"),
    ("choice-nested-label", {"type": "choice", "instructions": OK_INS, "criteria": ["a", ["b"]]}, "scalar"),
    ("choice-dup", {"type": "choice", "instructions": OK_INS, "criteria": ["a", "a"]}, "repeats"),
    ("choice-dup-num", {"type": "choice", "instructions": OK_INS, "criteria": [1, 1.0]}, "repeats"),
    ("choice-dup-bool", {"type": "choice", "instructions": OK_INS, "criteria": [True, 1]}, "repeats"),
    ("score-dict", {"type": "score", "instructions": OK_INS, "criteria": {"0": "low"}}, "list of level"),
    ("score-empty", {"type": "score", "instructions": OK_INS, "criteria": []}, "at least one level"),
    ("score-null", {"type": "score", "instructions": OK_INS, "criteria": ["low", None]}, "level 1 is null"),
    ("noul-list", {"type": "noul", "instructions": OK_INS, "criteria": ["yes", "no"]}, "takes 'criteria'"),
    ("noul-keys", {"type": "noul", "instructions": OK_INS, "criteria": {"yes": "a"}}, "keyed only"),
    ("labels-choice", {"type": "choice", "instructions": OK_INS, "criteria": ["a"], "labels": {}}, "only supported"),
    ("labels-keys", {"type": "noul", "instructions": OK_INS, "labels": {"no": "N", "yes": "Y"}}, "labels"),
    ("labels-same", {"type": "noul", "instructions": OK_INS, "labels": {"false": "X", "true": " X "}}, "labels"),
    ("labels-empty", {"type": "noul", "instructions": OK_INS, "labels": {"false": "", "true": "Y"}}, "labels"),
    ("labels-type", {"type": "noul", "instructions": OK_INS, "labels": {"false": 0, "true": 1}}, "labels"),
    ("order-short", {"type": "choice", "instructions": OK_INS, "criteria": ["a", "b"], "option_order": [0]},
     "permutation"),
    ("order-dup", {"type": "choice", "instructions": OK_INS, "criteria": ["a", "b"], "option_order": [0, 0]},
     "permutation"),
    ("order-bool", {"type": "noul", "instructions": OK_INS, "option_order": [False, True]}, "permutation"),
    ("notdict", ["choice"], "definition must be a dict"),
]


@pytest.mark.parametrize("qid,qdef,fragment", BAD, ids=[b[0] for b in BAD])
def test_each_rule_raises_value_error_naming_the_question(qid, qdef, fragment):
    with pytest.raises(ValueError) as ei:
        validate_question(qid, qdef)
    msg = str(ei.value)
    assert repr(qid) in msg, msg
    assert fragment in msg, msg


@pytest.mark.parametrize("qid", [None, "", "  ", 1.5, True, ("a",)])
def test_bad_question_ids(qid):
    with pytest.raises(ValueError, match="question id"):
        validate_question(qid, {"type": "noul", "instructions": OK_INS})


def test_questions_must_be_a_mapping():
    with pytest.raises(TypeError, match="dict of question id"):
        validate_questions([{"type": "noul", "instructions": OK_INS}])


def test_engine_reports_the_bad_question_among_good_ones(engine):
    qs = {"good": {"type": "noul", "instructions": OK_INS},
          "broken": {"type": "score", "instructions": OK_INS, "criteria": []}}
    with pytest.raises(ValueError, match="question 'broken'"):
        engine.predict("state", qs)


def test_options_that_do_not_fit_max_len_name_the_question(engine):
    qs = {"huge": {"type": "choice", "instructions": OK_INS,
                   "criteria": {"o%d" % i: "long text " * 20 for i in range(200)}}}
    with pytest.raises(ValueError, match=r"question 'huge': only \d+ of its 200 option markers fit"):
        engine.predict("state", qs)


def test_budget_overrides_are_validated(engine):
    qs = {"q": {"type": "noul", "instructions": OK_INS}}
    for bad in (0, -1, True, "512"):
        with pytest.raises(ValueError, match="max_len"):
            engine.predict_batch(["s"], qs, max_len=bad)


def test_normalisation():
    q = validate_question("c", {"type": "choice", "instructions": {"ask": "which?"},
                                "criteria": {"a": "", "b": None, 3: {"k": [1, 2]}}})
    assert q.instructions == '{"ask": "which?"}'
    assert q.options == ("a", "b", '3: {"k": [1, 2]}')
    assert q.keys == ("a", "b", 3)
    n = validate_question("n", {"type": "noul", "instructions": "x", "criteria": {True: "holds"},
                                "labels": {"false": " N ", "true": "Y"}})
    assert n.options == ("N: no, the statement does not hold", "Y: holds")
    s = validate_question("s", {"type": "score", "instructions": "x", "criteria": ["lo", {"d": 1}]})
    assert s.options == ("level 0: lo", 'level 1: {"d": 1}')
    assert s.legend == ("lo", '{"d": 1}')


def test_prepared_question_sets_are_remembered_only_when_equal_text_means_equal_sets(engine):
    """Engine.prepare keeps the last question sets it prepared (clients repeat theirs), keyed by their JSON
    text: only where that text identifies the set (plain JSON data that round-trips unchanged)."""
    import model.codec as me

    q = {"intent": {"type": "choice", "instructions": "What?", "criteria": {"a": "x", "b": "y"}}}
    p1 = engine.prepare(q)
    assert engine.prepare({"intent": dict(q["intent"])}) is p1  # an equal set, a new dict
    assert engine.prepare(q, max_len=64) is not p1  # budgets are part of the key
    # the caller's dict changed after a call: the next call sees the change
    q["intent"]["criteria"]["c"] = "z"
    assert engine.prepare(q).questions[0].keys == ("a", "b", "c")
    # {1: ...} and {"1": ...} have the same JSON text but answer under different ids: never shared
    one = {"type": "noul", "instructions": "Yes?"}
    s, i = engine.prepare({"1": one}), engine.prepare({1: one})
    assert s.questions[0].qid == "1" and i.questions[0].qid == 1
    assert engine.predict("some state", {1: one})["answers"].keys() == {1}
    # an invalid set raises every time, and bad budgets are still refused
    bad = {"x": {"type": "choice", "instructions": "?", "criteria": ["a", "a"]}}
    for _ in range(2):
        with pytest.raises(ValueError, match="question 'x'"):
            engine.prepare(bad)
    with pytest.raises(ValueError, match="max_len"):
        engine.prepare(q, max_len=True)
    # bounded
    for k in range(me.PREPARED_CACHE_SIZE + 10):
        engine.prepare({"q%d" % k: one})
    assert len(engine.codec._prepared) == me.PREPARED_CACHE_SIZE


def test_batched_state_tokenization_gives_the_ids_of_one_state_at_a_time(engine):
    """encode_many tokenizes states as one batch (encode_batch_fast where tokenizers has it, which skips offsets);
    the rows must be those of encoding each state alone, for awkward text too."""
    from tests.cases import cases

    states = ["", " ", "héllo wörld — ünïcode ✓ 日本語", "tabs\tand\nnewlines\r\n", "a" * 3000,
              {"nested": {"dict": [1, 2.5, None, True]}, "text": "  leading and trailing  "},
              "[MASK] looks like the mask token", "word " * 900]
    states += [s for st, _ in cases(6, seed=11) for s in st]
    _, qs = cases(1, seed=3)[0]
    p = engine.prepare(qs)
    batched = engine.encode_many(states, p)
    alone = [engine.encode(s, p) for s in states]
    assert [[r.ids for r in e.rows] for e in batched] == [[r.ids for r in e.rows] for e in alone]
