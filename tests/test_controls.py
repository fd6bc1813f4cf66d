"""Body controls and the answer JSON (serve_app/online/controls.py) against upstream laya-serve 0.4.15's own
validators and answers: every control good and bad, every refused key, and finish_answer on real answers."""

from __future__ import annotations

import copy
import math
import warnings

import pytest

from serve_app.online import controls as C
from serve_app.online.request_checks import HTTPError
from tests.test_abstention import assert_same

serve = pytest.importorskip("laya.serve")
from fastapi import HTTPException  # noqa: E402

QUESTIONS = {"intent": {"type": "choice", "instructions": "What does the customer want?",
                        "criteria": {"refund": "money back", "replacement": "a new item", "help": "advice"}},
             "two": {"type": "choice", "instructions": "Which side?", "criteria": ["left", "right"]},
             "angry": {"type": "noul", "instructions": "Is the customer angry?"},
             "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "mid", "high", "now"]}}
STATES = ["my order arrived broken, I want my money back today", {"subject": "invoice", "body": "where is it?"},
          [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi, how can I help?"}],
          "привет, мне нужна помощь с заказом"]


def _upstream(fn, *args):
    """(status, detail) of upstream's validator, or ("ok", its value)."""
    try:
        return "ok", fn(*args)
    except HTTPException as e:
        return e.status_code, e.detail


def _ours(body, batch, **kw):
    try:
        return "ok", C.parse_controls(body, batch=batch, **kw)
    except HTTPError as e:
        return e.status, e.detail


def test_the_key_lists_are_upstreams():
    assert C.BODY_CONTROLS == serve.BODY_CONTROLS
    assert C.BODY_REFUSALS == serve.BODY_REFUSALS
    assert C.BATCH_CALL_CONTROLS == serve.BATCH_BODY_CALL_CONTROLS
    assert C.BATCH_OUT_PARAMETERS == serve.BATCH_BODY_OUT_PARAMETERS
    assert C.SERVER_TOKEN_BUDGET == serve.DEFAULT_MAX_TOKEN_BUDGET
    assert set(C.ROUTING_KEYS) | {"max_len", "head_max_len", "min_confidence"} == set(serve.BODY_CONTROLS)
    assert set(C.Controls.__dataclass_fields__) == set(serve.BODY_CONTROLS) | {"batch_size", "sort_by_length"}


BUDGETS = [None, 1, 24, 512, 513, 4096, 8192, 8193, 10 ** 9, 0, -1, True, False, 1.0, 512.5, "512", [512], {}]


@pytest.mark.parametrize("key", ["max_len", "head_max_len"])
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("cap", [C.SERVER_TOKEN_BUDGET, 600])
def test_budgets_as_upstream(key, batch, cap):
    """Every value of max_len / head_max_len: upstream's 422 text, or the same value (also under a lower cap,
    as LAYA_MAX_TOKEN_BUDGET sets upstream's)."""
    for value in BUDGETS:
        body = {key: value}
        theirs = _upstream(serve._validate_budget_param, body, key, cap)
        ours = _ours(body, batch, max_token_budget=cap)
        if theirs[0] == "ok":
            assert ours[0] == "ok" and getattr(ours[1], key) == theirs[1], value
            assert ours[1].budget() == ({} if value is None else {key: value})
        else:
            assert ours == theirs, value


THRESHOLDS = [None, 0, 0.0, 0.5, 1, 1.0, -0.1, 1.5, True, False, "0.5", [0.5], {}, {"default": 0.4},
              {"choice:2": 0.9, "noul:2": 0.1}, {"choice:4": 0.5}, {"default": 2}, {"noul:2": None},
              {"score:11+": "x"}, 1e308, math.nan, math.inf]


@pytest.mark.parametrize("batch", [False, True])
def test_min_confidence_as_upstream(batch):
    for value in THRESHOLDS:
        body = {"min_confidence": value}
        theirs, ours = _upstream(serve._validate_min_confidence, body), _ours(body, batch)
        if theirs[0] == "ok":
            assert ours[0] == "ok" and ours[1].min_confidence == theirs[1], value
            assert type(ours[1].min_confidence) is type(theirs[1])
        else:
            assert ours == theirs, value


BATCH_SIZES = [None, 1, 2, 64, 10 ** 18, 0, -3, True, 2.0, "4", [4]]
SORTS = [None, True, False, 0, 1, "true", [True]]


def test_batch_call_controls_as_upstream():
    for value in BATCH_SIZES:
        body = {"batch_size": value}
        theirs, ours = _upstream(serve._validate_batch_size_param, body), _ours(body, True)
        assert (ours[0], ours[1].batch_size) == theirs if theirs[0] == "ok" else ours == theirs, value
    for value in SORTS:
        body = {"sort_by_length": value}
        theirs, ours = _upstream(serve._validate_sort_by_length_param, body), _ours(body, True)
        assert (ours[0], ours[1].sort_by_length) == theirs if theirs[0] == "ok" else ours == theirs, value


def test_single_route_ignores_batch_only_keys():
    """Upstream's /v1/systemone reads neither batch_size, sort_by_length nor diagnostics."""
    c = C.parse_controls({"batch_size": "x", "sort_by_length": 3, "diagnostics": {}}, batch=False)
    assert c.batch_size is None and c.sort_by_length is None
    with pytest.raises(HTTPError):
        C.parse_controls({"batch_size": "x"}, batch=True)


REFUSED = [{k: v} for k in C.BODY_REFUSALS for v in (None, [], "x", 0, False, {"a": 1})]
REFUSED += [{"hooks": [1], "hooks_timeout": 3, "on_predict_end": None}, {"hooks_raise": True, "on_predict_start": "f"},
            {"diagnostics": {}}, {"diagnostics": None}, {"diagnostics": 0, "hooks": None},
            {"diagnostics": {}, "hooks": "h"}]


@pytest.mark.parametrize("batch", [False, True])
def test_refused_keys_as_upstream(batch):
    """Every hook key (with null meaning absent), and diagnostics on the batch route, in upstream's order."""
    refused = 0
    for body in REFUSED:
        theirs = _upstream(serve._refuse_body_refusals, body)
        if theirs[0] == "ok" and batch:
            theirs = _upstream(serve._refuse_out_parameters, body)
        ours = _ours(body, batch)
        if theirs[0] == "ok":
            assert ours[0] == "ok", body
        else:
            refused += 1
            assert ours == theirs, body
    assert refused >= 25


def test_routing_controls_pass_through_untouched():
    odd = {"model": {"a": 1}, "task": 3, "lang": True, "lang_guess": ["de"]}
    c = C.parse_controls(odd, batch=False)
    assert c.route_args() == odd and all(c.route_args()[k] is odd[k] for k in odd)
    assert C.parse_controls({}, batch=True) == C.Controls()
    assert C.Controls().route_args() == dict.fromkeys(C.ROUTING_KEYS)


def _upstream_order(body, batch, cap=C.SERVER_TOKEN_BUDGET):
    """Upstream's handlers' validation sequence, without the routing controls (routing.py's)."""
    def run():
        serve._refuse_body_refusals(body)
        if batch:
            serve._refuse_out_parameters(body)
        serve._validate_budget_param(body, "max_len", cap)
        serve._validate_budget_param(body, "head_max_len", cap)
        serve._validate_min_confidence(body)
        if batch:
            serve._validate_batch_size_param(body)
            serve._validate_sort_by_length_param(body)
    return _upstream(run)


@pytest.mark.parametrize("batch", [False, True])
def test_several_bad_controls_report_upstreams_first(batch):
    import itertools

    bad = {"hooks": "h", "diagnostics": {}, "max_len": 0, "head_max_len": 9000, "min_confidence": 2,
           "batch_size": 0, "sort_by_length": "y"}
    for n in (2, 3):
        for keys in itertools.combinations(bad, n):
            body = {k: bad[k] for k in keys}
            theirs, ours = _upstream_order(body, batch), _ours(body, batch)
            assert ours == theirs if theirs[0] != "ok" else ours[0] == "ok", body


# -- answers ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(tiny_checkpoint):
    """Upstream's Router serving the tiny checkpoint under its three names: what laya-serve answers with."""
    from laya import Router

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Router(models=dict.fromkeys(("english", "multilingual", "typed-decisions"), tiny_checkpoint),
                      device="cpu")


def _thresholds(engine):
    confs = sorted(a["answer_confidence"] for s in STATES for a in engine.predict(s, QUESTIONS)["answers"].values())
    mid = confs[len(confs) // 2]
    return [None, 0, mid, 1, {"choice:3-5": mid, "default": confs[1]}, {"noul:2": 1.0}], mid


@pytest.mark.parametrize("strict", [False, True])
def test_finish_answer_is_upstreams_answer(engine, router, strict):
    """finish_answer of our decoded answer equals laya-serve's JSON (Router.predict, then _add_jev_confidence or
    _project_jev_strict) for every state and threshold: values within 1e-4, the same keys in the same order."""
    thresholds, mid = _thresholds(engine)
    seen = set()
    for state in STATES:
        ours_plain = engine.predict(state, QUESTIONS)
        for thr in thresholds:
            body = {"state": state, "questions": QUESTIONS, "model": "english", "min_confidence": thr}
            raw = router.predict(state, QUESTIONS, model="english", min_confidence=thr)
            theirs = serve._project_jev_strict(raw) if strict else serve._add_jev_confidence(raw)
            before = copy.deepcopy(ours_plain)
            ours = C.finish_answer(ours_plain, C.parse_controls(body, batch=False), raw["routing"], strict=strict)
            assert ours_plain == before  # the decoded answer is not modified
            assert_same(ours, theirs)
            seen |= {a.get("abstention") for a in ours["answers"].values()}
            assert strict or {"x_jev_confidence" in a for a in ours["answers"].values()} == {True, False}
    assert seen == ({None} if strict else {None, "passed", "abstained"})


def test_finish_answer_on_a_batch_is_upstreams(engine, router):
    """Each result of the batch route: Router.predict_batch with one control set, then _add_jev_confidence."""
    _, mid = _thresholds(engine)
    body = {"states": STATES, "questions": QUESTIONS, "min_confidence": mid, "batch_size": 2, "sort_by_length": True}
    c = C.parse_controls(body, batch=True)
    raw = router.predict_batch([dict(state=s, questions=QUESTIONS) for s in STATES], min_confidence=mid,
                               batch_size=2, sort_by_length=True)
    ours = [C.finish_answer(a, c, r["routing"]) for a, r in zip(engine.predict_batch(STATES, QUESTIONS), raw)]
    assert_same(ours, [serve._add_jev_confidence(r) for r in raw])
    assert ours[0]["routing"] is not raw[0]["routing"]


def test_finish_answer_leaves_error_entries_and_empty_answers():
    err = {"model": "laya-rl-agent", "error": "inference failed"}
    assert C.finish_answer(err, C.Controls(min_confidence=0.5), {"model": "english"}) is err
    empty = {"model": "laya-rl-agent", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}
    routing = {"model": "english", "repo": None, "reason": "default"}
    assert C.finish_answer(empty, C.Controls(min_confidence=0.5), routing) == serve._add_jev_confidence(
        dict(empty, routing=routing))


ODD_PROBS = [{"a": 0.5, "b": 0.5}, {"a": 1.0}, {"a": 0.0, "b": 0.0}, {"a": -0.2, "b": 1.2}, {"a": -1.0, "b": -3.0},
             {"a": True, "b": 0.1}, {"a": "0.3", "b": "0.7"}, {"a": "x", "b": 0.2}, {"a": math.nan, "b": 0.5},
             {"a": math.inf, "b": 0.1}, {"a": None, "b": 0.9}, {}, "not a dict", {"a": 0.2, "b": 0.3, "c": 0.5}]
ODD_SCORES = [{"2": 0.1, "0": 0.6, "1": 0.3}, {"0": 1.0}, {"0": 0.25, "1": 0.25, "2": 0.25, "3": 0.25},
              {"0": 0.0, "1": 0.0, "2": 1.0}, {"x": 0.5, "0": 0.5}, {"0": 0.5, "1": False}]


def test_jev_confidence_is_upstreams():
    from laya.confidence import jev_confidence

    answers = [{"type": "choice", "probabilities": p} for p in ODD_PROBS]
    answers += [{"type": "score", "probabilities": p} for p in ODD_SCORES]
    answers += [{"type": "noul", "noul": 0.3, "probabilities": {"a": 1.0}}, {"type": "other"}, {}]
    numbers = 0
    for a in answers:
        ours, theirs = C.jev_confidence(a), jev_confidence(a)
        assert (ours is None) == (theirs is None), a
        if ours is not None:
            numbers += 1
            assert ours == pytest.approx(theirs, abs=1e-12), a
    assert numbers >= 8


LONG = "word " * 1000


@pytest.mark.parametrize("budget", [{"max_len": 600}, {"max_len": 8192, "head_max_len": 8192},
                                    {"head_max_len": 4000}])
def test_a_max_len_above_the_checkpoints_reads_more_as_upstream(engine, oracle, budget):
    """A body budget above the checkpoint's own (512) but within the server's is honoured as upstream's eager path
    honours it: longer rows, so more of a long state is read (`model.engine.row_token_limit`)."""
    from model.engine import row_token_limit

    assert row_token_limit(engine.bundle, engine.backend) == 8192 > engine.bundle.max_len
    assert row_token_limit(engine.bundle, "fast") == row_token_limit(engine.bundle, "auto") == 8192
    assert row_token_limit(engine.bundle, "compile") == row_token_limit(engine.bundle, "aot") == engine.bundle.max_len
    c = C.parse_controls(dict(budget), batch=False)
    for state in (LONG, [{"role": "user", "content": LONG}, {"role": "user", "content": "the newest turn"}]):
        ours, theirs = engine.predict(state, QUESTIONS, **c.budget()), oracle.predict(state, QUESTIONS, **budget)
        assert_same(ours, theirs)
        if "max_len" in budget:
            assert ours["usage"]["state_tokens_dropped"] < engine.predict(state, QUESTIONS)["usage"][
                "state_tokens_dropped"]


@pytest.fixture(scope="module")
def fast_engine(tiny_checkpoint):
    """The fast backend's packing, buffers and RoPE tables on its torch ops (the kernels' references), on CPU."""
    import model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return model.load(tiny_checkpoint, device="cpu", backend="fast", ops="torch")


@pytest.mark.parametrize("budget", [{"max_len": 600}, {"max_len": 8192, "head_max_len": 8192}])
def test_the_fast_backend_takes_a_max_len_above_the_checkpoints_as_upstream(fast_engine, oracle, budget):
    """Rows past the checkpoint's max_len, up to the encoder's positions, on the fast backend: the same answers as
    upstream's eager path (the RoPE tables cover every position the row reaches)."""
    from model.engine import row_token_limit

    assert row_token_limit(fast_engine.bundle, fast_engine.backend) == 8192 == fast_engine.backend.max_tokens_per_row
    c = C.parse_controls(dict(budget), batch=False)
    ours, theirs = fast_engine.predict(LONG, QUESTIONS, **c.budget()), oracle.predict(LONG, QUESTIONS, **budget)
    assert_same(ours, theirs)
    assert ours["usage"]["state_tokens_dropped"] < fast_engine.predict(LONG, QUESTIONS)["usage"]["state_tokens_dropped"]
    with pytest.raises(ValueError, match="longer than this backend supports|at most 8192"):
        fast_engine.predict(LONG * 9, QUESTIONS, max_len=8193)


# -- request checks (request_checks.py) against upstream's own ---------------------------------------------------
def _choice(n):
    return {"type": "choice", "instructions": "pick", "criteria": ["o%d" % i for i in range(n)]}


NOUL = {"type": "noul", "instructions": "ok?"}
BIG = "b" * 50010
REQUESTS = [  # (state, questions): each kind of upstream 400 / 413 / 422 before tokenizing, and good ones
    ("x", {"q": NOUL}), (None, {"q": NOUL}), (None, "not an object"), ("x", ["q"]), ("x", {}),
    ("x", {"q%d" % i: NOUL for i in range(65)}), (BIG, {"q%d" % i: NOUL for i in range(65)}),
    ("x", {"q": _choice(101)}), ("x", {"q": _choice(100)}), ("x", {"a": _choice(100), **{"b%d" % i: _choice(100)
                                                                                       for i in range(5)}}),
    ("x", {"s": {"type": "score", "instructions": "?", "criteria": ["c%d" % i for i in range(33)]}}),
    ("x", {"s": {"type": "score", "instructions": "?", "criteria": ["low", None, None]}}),
    (BIG, {"s": {"type": "score", "instructions": "?", "criteria": [None]}}),
    (BIG, {"q": NOUL}), ("é" * 50000, {"q": NOUL}), ({"t": BIG}, {"q": NOUL}), ({"t": "b" * 49990}, {"q": NOUL}),
    ({"a": "x" * 30000, "b": ["y" * 30000]}, {"q": NOUL}), ({"n": 1, "t": BIG}, {"q": NOUL}),
    ({"t": BIG, "n": None}, {"q": NOUL}),
    ({"t": '"' * 25001}, {"q": NOUL}), ([{"role": "user", "content": BIG}], {"q": NOUL}),
    ({"k%d" % i: "v" * 800 for i in range(70)}, {"q": NOUL}), ("x", {"q": "not a dict", "r": NOUL}),
]


def _ours_checks(fn, *args):
    try:
        fn(*args)
        return "ok"
    except HTTPError as e:
        return e.status, e.detail


def _theirs_checks(fn, *args):
    try:
        fn(*args)
        return "ok"
    except HTTPException as e:
        return e.status_code, e.detail


def test_request_checks_are_upstreams():
    """check_request / check_batch: upstream's statuses, texts (the state size it reports included) and order."""
    from serve_app.online.request_checks import check_batch, check_request
    from serve_app.online.schemas import Limits

    lim = Limits()
    outcomes = set()
    for state, qs in REQUESTS:
        theirs = _theirs_checks(serve._check_request_limits, state, qs)
        assert _ours_checks(check_request, state, qs, lim) == theirs, (str(state)[:40], str(qs)[:60])
        outcomes.add(theirs if theirs == "ok" else theirs[0])
        for states in ([state, "fine"], ["fine", state], [state] * 65, [], "x"):
            assert (_ours_checks(check_batch, states, qs, lim)
                    == _theirs_checks(serve._check_batch_limits, states, qs)), (str(states)[:40], str(qs)[:60])
    assert outcomes == {"ok", 400, 413, 422}


def test_lone_surrogates_and_large_bodies_answer_upstreams_texts():
    import asyncio

    from starlette.requests import Request

    from serve_app.online.request_checks import LONE_SURROGATE_DETAIL, object_body, read_json
    from serve_app.online.schemas import Limits

    assert LONE_SURROGATE_DETAIL == serve._LONE_SURROGATE_DETAIL
    with pytest.raises(HTTPError) as e:
        object_body({"questions": {}, "state": "\ud800"}, ("questions",))
    assert (e.value.status, e.value.detail) == (400, serve._LONE_SURROGATE_DETAIL)
    assert object_body({"questions": {}, "model": 5}, ("questions",))["model"] == 5  # routing reads any model

    def request(body: bytes, declared: bool) -> Request:
        chunks = [body[i:i + 65536] for i in range(0, len(body), 65536)] or [b""]
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                    for i, c in enumerate(chunks)]

        async def receive():
            return messages.pop(0)

        headers = [(b"content-type", b"application/json")]
        if declared:
            headers.append((b"content-length", str(len(body)).encode()))
        return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)

    async def cpu(fn, *args):
        return fn(*args)

    big = b'{"state": "' + b"x" * (2 * 1024 * 1024) + b'", "questions": {}}'
    for declared in (True, False):  # refused from the header, and while streaming a body that declares nothing
        with pytest.raises(HTTPError) as e:
            asyncio.run(read_json(request(big, declared), Limits(), cpu))
        assert (e.value.status, e.value.detail) == (413, "request body too large")
    assert asyncio.run(read_json(request(b'{"questions": {}}', False), Limits(), cpu)) == ({"questions": {}}, 17)
