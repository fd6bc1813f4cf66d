"""Upstream's own clients, unchanged, against laya-fleet's app, and the same tests against upstream's laya-serve.

`laya.mcp.remote.RemoteRouter` (health, loaded, loaded_revisions, predict with and without min_confidence,
predict_batch, and every HTTP failure mapped to its `RemoteError` code), the MCP tools `laya_status` /
`laya_predict` over a RemoteRouter, and the `base_url` paths of `laya.integrations.{langchain, llamaindex,
crewai, agno, tools}`. Those paths need none of the frameworks: each module ships stand-ins for the framework's
types and posts with urllib, so they run here as a user's code would. Every test runs on both servers (the
`server` parameter), so a test that fails on laya-fleet alone points at laya-fleet, not at the test; the
integrations' decisions must also agree between the two.
"""

from __future__ import annotations

import pytest

pytest.register_assert_rewrite("tests.upstream_server")

from .upstream_corpus import EN, QS, STATES  # noqa: E402
from .upstream_server import API_KEY, NAMES, free_port  # noqa: E402

pytest_plugins = ["tests.upstream_server"]

RU = STATES["ru"]
SERVERS = ("upstream", "ours")


@pytest.fixture(params=SERVERS)
def server(request):
    """One of the two running servers (the session's `upstream` or `ours`)."""
    return request.getfixturevalue(request.param)


def remote(server, api_key: str | None = API_KEY, **kwargs):
    """Upstream's RemoteRouter pointed at `server`."""
    from laya.mcp.remote import RemoteRouter

    return RemoteRouter(server.base, api_key=api_key, **kwargs)


def remote_error(fn) -> str:
    """The `RemoteError` code `fn()` raises (AssertionError when it raises none)."""
    from laya.mcp.remote import RemoteError

    with pytest.raises(RemoteError) as info:
        fn()
    return info.value.code


# -- RemoteRouter ---------------------------------------------------------------------------------------------

def test_remote_router_health_loaded_and_revisions(server):
    r = remote(server)
    for state in (EN, RU):  # both checkpoints answered just now, so both are resident
        r.predict(state, QS)
    health = r.health()
    assert health["status"] == "ok"
    for key in ("loaded", "revisions", "device", "device_is_preference", "checkpoint_devices", "cpu_fallbacks"):
        assert key in health, key
    assert sorted(r.loaded) == sorted(NAMES)
    assert r.loaded_revisions == {name: None for name in NAMES}  # local directories carry no Hub revision
    assert health["device"] == "cpu" and health["device_is_preference"] is False
    assert health["checkpoint_devices"] == {name: "cpu" for name in NAMES}

    stranger = remote(server, api_key="not-the-key")
    assert stranger.health() == {"status": "ok"}  # liveness only
    assert stranger.loaded == [] and stranger.loaded_revisions == {}
    assert remote(server, api_key=None).health() == {"status": "ok"}


def test_remote_router_predict_routes_and_answers_every_question(server):
    r = remote(server)
    en, ru = r.predict(EN, QS), r.predict(RU, QS)
    for result in (en, ru):
        assert list(result["answers"]) == list(QS)
        assert {a["type"] for a in result["answers"].values()} == {"choice", "score", "noul"}
        assert "abstention" not in result["answers"]["intent"]  # no gate asked for, none reported
    assert en["routing"]["model"] == "english" and ru["routing"]["model"] == "multilingual"
    assert r.predict(EN, QS, model="multilingual")["routing"]["model"] == "multilingual"
    assert r.predict(RU, QS, task="english")["routing"]["model"] == "english"
    assert r.predict(EN, QS, lang="de")["routing"]["model"] == "multilingual"
    assert r.predict(RU, QS, lang_guess="en")["routing"]["model"] == "english"
    assert r.predict(EN, QS, model="auto")["routing"]["model"] == "english"
    short = r.predict(EN, QS, max_len=48, head_max_len=32)
    assert short["usage"]["truncated"] is True


def test_remote_router_predict_with_min_confidence_gates_every_answer(server):
    r = remote(server)
    strict = r.predict(EN, QS, min_confidence=1.0)
    for qid, answer in strict["answers"].items():
        assert answer["abstention"] == "abstained" and answer["abstention_threshold"] == 1.0, qid
        assert answer["low_confidence"] is True, qid
    lax = r.predict(EN, QS, min_confidence=0.0)
    assert {a["abstention"] for a in lax["answers"].values()} == {"passed"}
    assert not any(a.get("low_confidence") for a in lax["answers"].values())
    per_bucket = r.predict(EN, QS, min_confidence={"noul:2": 1.0})
    assert per_bucket["answers"]["angry"]["abstention"] == "abstained"
    assert per_bucket["answers"]["intent"]["abstention"] == "passed"  # a bucket the map leaves out is not gated


def test_remote_router_predict_batch_answers_in_order(server):
    r = remote(server)
    requests = [{"state": EN, "questions": QS}, {"state": RU, "questions": {"angry": QS["angry"]}},
                {"state": RU, "questions": QS, "model": "english"}]
    results = r.predict_batch(requests, min_confidence=0.5)
    assert [res["routing"]["model"] for res in results] == ["english", "multilingual", "english"]
    assert [list(res["answers"]) for res in results] == [list(QS), ["angry"], list(QS)]
    assert all("abstention" in a for res in results for a in res["answers"].values())
    assert results[0]["answers"] == r.predict(EN, QS, min_confidence=0.5)["answers"]


def test_remote_router_maps_each_http_failure_to_its_remote_error_code(server):
    r = remote(server)
    assert remote_error(lambda: remote(server, api_key="not-the-key").predict(EN, QS)) == "unauthorized"
    assert remote_error(lambda: remote(server, api_key=None).predict(EN, QS)) == "unauthorized"
    assert remote_error(lambda: r.predict(None, QS)) == "invalid_request"  # 400
    assert remote_error(lambda: r.predict(EN, {"q%d" % i: QS["angry"] for i in range(65)})) == "invalid_request"
    assert remote_error(lambda: r.predict(EN, QS, min_confidence=2.0)) == "invalid_request"  # 422
    assert remote_error(lambda: r.predict(EN, QS, model="./my-checkpoint")) == "invalid_request"
    assert remote_error(lambda: r.predict(EN, QS, task="summarise")) == "invalid_request"
    assert remote_error(lambda: r.predict(EN, QS, lang_guess=lambda s: "de")) == "unsupported_remote"
    assert remote_error(lambda: r.predict_batch([{"state": EN, "questions": QS}], min_confidence=-1)) == \
        "invalid_request"
    from laya.mcp.remote import RemoteRouter

    elsewhere = RemoteRouter(server.base + "/no/such/prefix", api_key=API_KEY)
    assert remote_error(lambda: elsewhere.predict(EN, QS)) == "upstream_error"  # 404
    closed = RemoteRouter("http://127.0.0.1:%d" % free_port(), api_key=API_KEY)
    assert remote_error(lambda: closed.predict(EN, QS)) == "unreachable"
    assert closed.loaded == []
    hurried = remote(server, timeout=0.001)
    assert remote_error(lambda: hurried.predict(EN * 40, QS)) == "timeout"


# -- the MCP tools over a RemoteRouter ------------------------------------------------------------------------

def test_mcp_laya_status_reports_the_server(server):
    from laya.mcp.tools import laya_status

    r = remote(server)
    r.predict(EN, QS), r.predict(RU, QS)
    status = laya_status(router=r)
    assert status["mode"] == "remote" and status["base_url"] == server.base
    assert sorted(status["loaded"]) == sorted(NAMES)
    assert status["server"]["status"] == "ok" and status["device"] == "cpu"
    assert status["checkpoint_devices"] == {name: "cpu" for name in NAMES}
    locked_out = laya_status(router=remote(server, api_key="not-the-key"))
    assert locked_out["server"] == {"status": "ok"} and locked_out["loaded"] == []


def test_mcp_laya_predict_over_a_remote_router(server):
    from laya.mcp.tools import ToolError, laya_predict

    r = remote(server)
    state = {"ticket": RU, "channel": "email"}
    auto = laya_predict(state, QS, router=r)
    assert list(auto["answers"]) == list(QS) and auto["routing"]["model"] == "multilingual"
    pinned = laya_predict(state, QS, model="english", router=r)
    assert pinned["routing"]["model"] == "english"
    assert laya_predict(state, QS, lang="en", router=r)["routing"]["model"] == "english"
    gated = laya_predict({"ticket": EN}, QS, min_confidence=1.0, router=r)
    assert all(a["low_confidence"] is True for a in gated["answers"].values())
    with pytest.raises(ToolError) as info:
        laya_predict(state, QS, router=remote(server, api_key="not-the-key"))
    assert info.value.code == "unauthorized"
    with pytest.raises(ToolError) as info:
        laya_predict(state, QS, max_len=9000, router=r)
    assert info.value.code == "invalid_request"


# -- the integrations' remote paths ---------------------------------------------------------------------------

def _tool_search(query: str) -> str:
    """Search the product catalogue for items matching the query."""
    return query


def _tool_refund(order_id: str) -> str:
    """Issue a refund for an order that never arrived or arrived broken."""
    return order_id


def langchain_router(base: str, key: str | None):
    from laya.integrations.langchain import LayaRouter

    router = LayaRouter(criteria={"billing": "payments and refunds", "shipping": "deliveries and tracking",
                                  "other": "anything else"}, base_url=base, api_key=key)
    return router.invoke(EN), router.last_decision["answers"]["route"]["probabilities"]


def langchain_guardrail(base: str, key: str | None):
    from laya.integrations.langchain import LayaGuardrail

    out = LayaGuardrail(action="annotate", threshold=0.99, base_url=base, api_key=key).invoke(EN)
    answers = out["guardrails"]["answers"]
    return out["guardrails"]["passed"], {q: a["noul"] if a["type"] == "noul" else a["confidence"]
                                         for q, a in answers.items()}


def llamaindex_selector(base: str, key: str | None):
    from laya.integrations.llamaindex import LayaSingleSelector, ToolMetadata

    choices = [ToolMetadata(description="answers questions about orders and refunds", name="orders"),
               ToolMetadata(description="answers questions about the weather", name="weather")]
    selector = LayaSingleSelector(base_url=base, api_key=key)
    result = selector.select(choices, RU)
    return result.selections[0].index, selector.last_decision["routing"]["model"]


def crewai_router(base: str, key: str | None):
    from laya.integrations.crewai import LayaCrewRouter

    agents = [{"role": "Refund specialist", "goal": "resolve refunds"},
              {"role": "Travel planner", "goal": "book trips"}]
    decision = LayaCrewRouter(base_url=base, api_key=key, lang="en").route(EN, agents)
    return decision.agent_index, round(decision.confidence, 4)


def agno_router(base: str, key: str | None):
    from laya.integrations.agno import LayaAgnoRouter

    agents = [{"name": "support", "role": "customer support"}, {"name": "sales", "role": "new purchases"}]
    decision = LayaAgnoRouter(base_url=base, api_key=key, model="multilingual").route(EN, agents)
    return decision.agent_index, decision.raw_decision["routing"]["model"]


def tool_selector(base: str, key: str | None):
    from laya.integrations.tools import LayaToolSelector

    decision = LayaToolSelector(tools=[_tool_search, _tool_refund], base_url=base, api_key=key,
                                min_confidence=0.2).select(EN)
    return decision.tool_name, decision.probabilities


# each integration's call, and the decisions it can come back with
INTEGRATIONS = {"langchain.LayaRouter": (langchain_router, {"billing", "shipping", "other"}),
                "langchain.LayaGuardrail": (langchain_guardrail, {True, False}),
                "llamaindex.LayaSingleSelector": (llamaindex_selector, {0, 1}),
                "crewai.LayaCrewRouter": (crewai_router, {0, 1}),
                "agno.LayaAgnoRouter": (agno_router, {0, 1}),
                "tools.LayaToolSelector": (tool_selector, {"_tool_search", "_tool_refund"})}


@pytest.mark.parametrize("name", list(INTEGRATIONS))
def test_integration_remote_path_answers_and_refuses_a_wrong_key(server, name):
    call, decisions = INTEGRATIONS[name]
    decision, detail = call(server.base, API_KEY)
    assert decision in decisions and detail, (decision, detail)
    with pytest.raises(RuntimeError, match="Laya server error 401"):
        call(server.base, "not-the-key")


@pytest.mark.parametrize("name", list(INTEGRATIONS))
def test_integration_decides_as_it_does_against_upstream(upstream, ours, name):
    call = INTEGRATIONS[name][0]
    want, got = call(upstream.base, API_KEY), call(ours.base, API_KEY)
    assert got[0] == want[0]
    if isinstance(want[1], dict):
        assert want[1].keys() == got[1].keys()
        assert all(abs(want[1][k] - got[1][k]) <= 1e-4 + 1e-9 for k in want[1]), (want, got)
    else:
        assert got[1] == want[1]
