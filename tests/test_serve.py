"""Online serving on a real local Ray cluster over real HTTP: parity, batching, bad input, overload, faults.

One application (configs/local.yaml pointed at the session's tiny checkpoint, with a bearer key and the
FaultInjector backend wrapper) serves every test in this module; tests that change its config restore it.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
import time

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from .cases import WORDS, cases  # noqa: E402
from .serve_helpers import (  # noqa: E402
    AUTH,
    OOM_LIMIT,
    OOM_TRIGGER,
    POISON,
    SECRET_PATH,
    TEST_KEY,
    TEST_KEY_ENV,
    LoadGen,
    app_config,
    assert_same_result,
    deploy,
    deployment,
    no_leak,
    on_the_wire,
    scorer_handle,
    wait_for,
)

pytest_plugins = ["tests.serve_helpers"]

QUESTIONS = json.load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "example_questions.json")))
DEFAULT_POLICY = {"max_batch_tokens": 8192, "max_batch_rows": None, "batch_wait_timeout_s": 0.0}


def _state(rng: random.Random, prefix: str = "") -> str:
    return (prefix + " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))).strip()


@pytest.fixture(scope="module")
def app(serve_cluster, tiny_checkpoint):
    """The deployed app: its base URL, config (to derive changes from) and a redeploy helper."""
    cfg = app_config(tiny_checkpoint, serve_cluster["ports"]["http"], api_key_env=TEST_KEY_ENV,
                     backend_wrapper="tests.serve_helpers:FaultInjector")
    a = cfg["applications"][0]
    a["args"]["scorer"]["gil_switch_interval_s"] = 0.001
    deployment(a, "Scorer").update(health_check_period_s=1, health_check_timeout_s=10,
                                   graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.5)
    base = serve_cluster["base"]
    deploy(cfg, base, timeout=180)

    class App:
        url = base
        config = cfg
        metrics = serve_cluster["metrics"]

        @staticmethod
        def redeploy(change) -> dict:
            new = copy.deepcopy(cfg)
            change(new["applications"][0])
            deploy(new)
            return new

    return App


def _post(url: str, body, headers=AUTH, **kw) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=60, **kw)


def _stats() -> dict:
    return scorer_handle().stats.remote().result(timeout_s=30)


def _info() -> dict:
    return scorer_handle().info.remote().result(timeout_s=30)


SLOW_POLICY = {"max_batch_tokens": 4096, "max_batch_rows": None, "batch_wait_timeout_s": 0.3}


def _ensure_policy(app, policy: dict) -> dict:
    """Make the Scorer's user_config `policy` (redeploying only if needed); returns the replica's info."""
    if _info()["policy"] != policy:
        app.redeploy(lambda a: deployment(a, "Scorer").update(user_config=policy))
    return wait_for(lambda: (i := _info())["policy"] == policy and i, 60, what="user_config %s" % policy)


def _new_batch_sizes(s0: dict, s1: dict) -> dict[int, int]:
    """Batches recorded between two stats snapshots: {requests per batch: count}."""
    out = {}
    for k, v in s1["batch_sizes"].items():
        d = v - s0["batch_sizes"].get(k, 0)
        if d:
            out[int(k)] = d
    return out


def _try_info() -> dict | None:
    try:
        return scorer_handle().info.remote().result(timeout_s=5)
    except Exception:  # noqa: BLE001 - replica gone or not yet replaced
        return None


async def _many(url: str, bodies: list, headers=AUTH) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        return await asyncio.gather(*(c.post(url, json=b, headers=headers) for b in bodies))


# -- answers ------------------------------------------------------------------------------------

def test_answers_equal_engine_predict(app, engine):
    """Every state/question shape in tests/cases.py, single and batch endpoints, against the Engine."""
    for states, qs in cases(20, seed=11):
        r = _post(app.url + "/v1/systemone", {"state": states[0], "questions": qs})
        assert r.status_code == 200, r.text
        assert_same_result(r.json(), engine.predict(states[0], qs))
        r = _post(app.url + "/v1/systemone/batch", {"states": states, "questions": qs, "model": "laya"})
        assert r.status_code == 200, r.text
        body = r.json()
        want = engine.predict_batch(states, qs)
        assert set(body) == {"results", "total_usage"} and len(body["results"]) == len(states)
        for g, w in zip(body["results"], want):
            assert_same_result(g, w)
        assert body["total_usage"]["input_tokens"] == sum(w["usage"]["input_tokens"] for w in want)


def test_first_answer_is_byte_identical_to_engine(app, engine):
    state = "Hi, my order #1234 arrived broken and I want my money back today."
    r = _post(app.url + "/v1/systemone", {"state": state, "questions": QUESTIONS})
    assert r.status_code == 200 and float(r.headers["X-Inference-Time-Ms"]) > 0
    assert r.headers["Server-Timing"] == "inference;dur=%s" % r.headers["X-Inference-Time-Ms"]
    assert r.json()["routing"]["model"] == "english"
    assert r.json() == on_the_wire(engine.predict(state, QUESTIONS), r.json()["routing"])


def test_empty_questions_answer_without_scoring(app):
    r = _post(app.url + "/v1/systemone", {"state": "anything", "questions": {}})
    assert r.status_code == 200 and "Server-Timing" in r.headers
    body = r.json()
    assert body.pop("routing")["model"] == "english"
    assert body == {"model": "laya-rl-agent", "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}


def test_64_concurrent_requests_are_answered_correctly_in_shared_batches(app, engine):
    rng = random.Random(3)
    states = [_state(rng) for _ in range(64)]
    before = _stats()
    rs = asyncio.run(_many(app.url + "/v1/systemone", [{"state": s, "questions": QUESTIONS} for s in states]))
    assert [r.status_code for r in rs] == [200] * 64, [r.text for r in rs if r.status_code != 200][:3]
    for r, s in zip(rs, states):
        assert_same_result(r.json(), engine.predict(s, QUESTIONS))
    after = _stats()
    sizes = _new_batch_sizes(before, after)
    assert after["requests"] - before["requests"] == 64 == sum(k * v for k, v in sizes.items())
    assert max(sizes) > 1 and sum(sizes.values()) < 64, sizes


# -- bad input ----------------------------------------------------------------------------------

def _choice(n: int) -> dict:
    return {"type": "choice", "instructions": "pick one", "criteria": ["opt%d" % i for i in range(n)]}


BAD = [
    # (name, path, body (dict = JSON, bytes = raw), status, substring of detail)
    ("malformed json", "", b'{"state": "x", "questions": ', 400, "valid JSON"),
    ("not utf-8", "", b'{"state": "\xff\xfe", "questions": {}}', 400, "valid JSON"),
    ("not an object", "", b"[1, 2, 3]", 400, "'questions'"),
    ("missing questions", "", {"state": "x"}, 400, "'questions'"),
    ("missing state", "", {"questions": QUESTIONS}, 400, "'state' is required"),
    ("null state", "", {"state": None, "questions": QUESTIONS}, 400, "'state' is required"),
    ("questions not an object", "", {"state": "x", "questions": ["q"]}, 400, "'questions' must be an object"),
    ("model a path", "", {"state": "x", "questions": QUESTIONS, "model": "./checkpoints/tiny"}, 422, "unknown model"),
    ("lone surrogate", "", b'{"state": "a \\ud800 b", "questions": {}}', 400, "surrogate"),
    ("unknown question type", "", {"state": "x", "questions": {"bad_q": {"type": "essay", "instructions": "?"}}},
     422, "question 'bad_q'"),
    ("choice without criteria", "", {"state": "x", "questions": {"q1": QUESTIONS["angry"],
                                                                  "pick": {"type": "choice", "instructions": "?"}}},
     422, "question 'pick'"),
    ("options do not fit", "", {"state": "x", "max_len": 24, "questions": {"wide": _choice(40)}}, 422, "'wide'"),
    ("max_len not an int", "", {"state": "x", "max_len": True, "questions": QUESTIONS}, 422, "max_len"),
    ("max_len too long", "", {"state": "x", "max_len": 100000, "questions": QUESTIONS}, 422, "max_len"),
    ("65 questions", "", {"state": "x", "questions": {"q%d" % i: QUESTIONS["angry"] for i in range(65)}},
     413, "too many questions"),
    ("state over 50k chars", "", {"state": "a" * 50_001, "questions": QUESTIONS}, 413, "state too large"),
    ("dict state over 50k as JSON", "", {"state": {"k": '"' * 26_000}, "questions": QUESTIONS}, 413, "state too large"),
    ("101 options", "", {"state": "x", "questions": {"c": _choice(101)}}, 413, "too many choice options"),
    ("33 levels", "", {"state": "x", "questions": {"s": {"type": "score", "instructions": "?",
                                                         "criteria": ["l%d" % i for i in range(33)]}}},
     413, "too many score levels"),
    ("513 options in total", "", {"state": "x", "questions": {"c%d" % i: _choice(90) for i in range(6)}},
     413, "across questions"),
    ("batch without states", "/batch", {"questions": QUESTIONS}, 400, "'states'"),
    ("batch states not a list", "/batch", {"states": "x", "questions": QUESTIONS}, 400, "non-empty list"),
    ("batch with a null state", "/batch", {"states": ["a", None], "questions": QUESTIONS}, 400, "'state'"),
    ("batch of 65 states", "/batch", {"states": ["s"] * 65, "questions": QUESTIONS}, 413, "too many states"),
    ("batch invalid question", "/batch", {"states": ["s"], "questions": {"z": {"type": "noul"}}}, 422,
     "question 'z'"),
]


@pytest.mark.parametrize("name,path,body,status,detail", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_a_clear_status(app, name, path, body, status, detail):
    url = app.url + "/v1/systemone" + path
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers=dict(AUTH, **{"Content-Type": "application/json"}), timeout=30)
    else:
        r = _post(url, body)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert detail in r.json()["detail"], r.text[:300]
    no_leak(r.text)


def test_body_over_2_mib_is_413_with_and_without_content_length(app):
    big = json.dumps({"state": "a" * (2 * 1024 * 1024 + 10), "questions": QUESTIONS}).encode()
    r = httpx.post(app.url + "/v1/systemone", content=big, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "too large" in r.json()["detail"]

    def chunks():  # Transfer-Encoding: chunked, no Content-Length at all
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]

    r = httpx.post(app.url + "/v1/systemone", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and "too large" in r.json()["detail"]
    no_leak(r.text)
    r = httpx.post(app.url + "/v1/systemone/batch", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413


def test_understated_content_length_cannot_smuggle_a_body(app):
    """A Content-Length smaller than the body: only that many bytes are read, so the JSON is cut (400)."""
    import socket

    body = json.dumps({"state": "a" * 1000, "questions": QUESTIONS}).encode()
    host, port = app.url.split("//")[1].split(":")
    head = ("POST /v1/systemone HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\nConnection: close\r\n\r\n" % (host, TEST_KEY)).encode("utf-8")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 400"), data[:200]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TEST_KEY.encode()},
                                     {"Authorization": ("Bearer " + TEST_KEY + "x").encode()},
                                     {"Authorization": b"Bearer caf\xe9 \xff\xfe"}],
                         ids=["missing", "wrong", "no scheme", "longer", "raw bytes"])
def test_wrong_or_missing_bearer_is_401(app, headers):
    for path in ("/v1/systemone", "/v1/systemone/batch"):
        r = httpx.post(app.url + path, json={"state": "x", "states": ["x"], "questions": QUESTIONS},
                       headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json() == {"detail": "invalid or missing bearer token"}
    # the check runs before the body is read: an oversized body without the key is still 401
    r = httpx.post(app.url + "/v1/systemone", content=b"x" * (3 << 20), headers=headers, timeout=30)
    assert r.status_code == 401


def test_a_non_ascii_key_is_accepted_as_utf_8_and_as_upstreams_clients_send_it(app):
    """upstream's clients (urllib) write the header as latin-1, and upstream accepts that; laya-fleet's own
    clients send UTF-8 bytes"""
    for raw in (("Bearer " + TEST_KEY).encode("utf-8"), ("Bearer " + TEST_KEY).encode("latin-1")):
        r = httpx.post(app.url + "/v1/systemone", json={"state": "x", "questions": {}},
                       headers={"Authorization": raw}, timeout=30)
        assert r.status_code == 200, r.text


def test_health_ready_and_openapi(app):
    assert _info()["gil_switch_interval_s"] == 0.001  # the app arg reached the replica
    assert httpx.get(app.url + "/health").json() == {"status": "ok"}
    r = httpx.get(app.url + "/ready")
    assert r.status_code == 200 and r.json()["ready"] is True
    for path in ("/openapi.json", "/docs", "/redoc"):  # as upstream: no docs behind a key
        assert httpx.get(app.url + path).status_code == 404
    r = httpx.get(app.url + "/v1/systemone")
    assert r.status_code == 405
    no_leak(r.text)


def test_stats_needs_the_bearer_and_counts_requests_and_scorer_calls(app):
    assert httpx.get(app.url + "/stats").status_code == 401
    before = httpx.get(app.url + "/stats", headers=AUTH).json()
    rng = random.Random(21)
    rs = asyncio.run(_many(app.url + "/v1/systemone", [{"state": _state(rng), "questions": QUESTIONS}
                                                       for _ in range(12)]))
    assert [r.status_code for r in rs] == [200] * 12
    after = httpx.get(app.url + "/stats", headers=AUTH).json()
    assert after["requests"] - before["requests"] == 12 and after["forward_s"] > before["forward_s"]
    # the model calls on the forward thread fit inside the batches' wall time the loop waited for
    assert 0 < after["engine_s"] - before["engine_s"] <= after["forward_s"] - before["forward_s"]
    ing = after["ingress"]  # one ingress replica in this app: it carried all 12, in at most 12 calls
    assert ing["requests"] - before["ingress"]["requests"] == 12
    assert 1 <= ing["scorer_calls"] - before["ingress"]["scorer_calls"] <= 12
    assert ing["waiting"] == 0 and ing["inflight"] == 0
    # both replicas' start-up objects frozen (Ray Serve does it after a replica's start-up) and their
    # collections counted since (gc_pauses.py)
    for g in (after["gc"], ing["gc"]):
        assert g["frozen"] > 10000 and len(g["collections"]) == len(g["seconds"]) == len(g["max_ms"]) == 3
    assert after["gc"]["pid"] != ing["gc"]["pid"]  # split topology: the scorer and the ingress are two processes
    # the Serve request path configs/local.yaml's runtime_env asks for reached the replica (as in prod.yaml)
    assert ing["ray_serve"] == {"grpc_between_deployments": True, "user_code_on_replica_loop": True,
                                "router_on_replica_loop": True, "direct_ingress": False}


# -- live reconfiguration, faults ----------------------------------------------------------------

def test_reconfigure_takes_effect_live(app):
    """A new user_config reaches the running replica (same actor, same pid): budget and wait window change."""
    before = _ensure_policy(app, DEFAULT_POLICY)
    assert before["budget"] == 8192
    info = _ensure_policy(app, SLOW_POLICY)
    assert info["actor_name"] == before["actor_name"] and info["pid"] == before["pid"]
    assert info["budget"] == 4096
    # a lone request now waits out the 300 ms window in the scorer's queue (with no window it waits ~0)
    s0 = _stats()
    assert _post(app.url + "/v1/systemone", {"state": "alone", "questions": QUESTIONS}).status_code == 200
    s1 = _stats()
    assert s1["requests"] - s0["requests"] == 1
    waited_ms = s1["mean_queue_wait_ms"] * s1["requests"] - s0["mean_queue_wait_ms"] * s0["requests"]
    assert waited_ms >= 290, waited_ms
    # and gathers 8 requests sent at once into at most two batches; how they arrive depends on a loaded
    # machine's scheduling (the first may be taken alone), so the round is repeated up to 3 times
    rng = random.Random(8)
    tries = []
    for _ in range(3):
        s0 = _stats()
        rs = asyncio.run(_many(app.url + "/v1/systemone", [{"state": _state(rng), "questions": QUESTIONS}
                                                           for _ in range(8)]))
        assert all(r.status_code == 200 for r in rs)
        tries.append(sizes := _new_batch_sizes(s0, _stats()))
        if sum(sizes.values()) <= 2 and max(sizes) >= 4:
            break
    else:
        raise AssertionError("8 requests at once never shared at most two batches: %s" % tries)


def test_poison_request_fails_alone_and_its_batch_is_answered(app, engine):
    """Under a 300 ms window a poison request shares a batch with others; only it fails (500, no leak).

    Which requests share a batch depends on arrival (the ingress coalesces, the scorer batches), so the round
    is repeated (up to 3 times) until the poison shared one; every round must answer everything correctly.
    """
    _ensure_policy(app, SLOW_POLICY)
    rng = random.Random(9)
    shared = False
    for _ in range(3):
        states = [_state(rng) for _ in range(12)]
        states.insert(5, POISON)
        s0 = _stats()
        rs = asyncio.run(_many(app.url + "/v1/systemone", [{"state": s, "questions": QUESTIONS} for s in states]))
        for r, s in zip(rs, states):
            if s == POISON:
                assert r.status_code == 500 and r.json() == {"detail": "inference failed"}
                assert SECRET_PATH not in r.text
                no_leak(r.text)
            else:
                assert r.status_code == 200, r.text
                assert_same_result(r.json(), engine.predict(s, QUESTIONS))
        s1 = _stats()
        assert s1["errors"] == s0["errors"] + 1, s1
        if s1["fallback_batches"] > s0["fallback_batches"]:
            shared = True
            break
    assert shared, "the poison request never shared a batch in 3 rounds"
    # and the replica keeps serving
    assert _post(app.url + "/v1/systemone", {"state": "fine", "questions": QUESTIONS}).status_code == 200


def test_cuda_oom_halves_the_budget_and_loses_no_request(app, engine):
    """An injected torch.cuda.OutOfMemoryError above 2000 padded tokens: budget halves, every request answered.

    Each request alone (6 rows of ~450 tokens) is over the limit, so whichever batch the concurrent requests
    end up in (the ingress coalesces them, the scorer batches them), its first micro-batch runs out of memory.
    """
    info = _ensure_policy(app, SLOW_POLICY)
    assert info["budget"] > OOM_LIMIT
    rng = random.Random(10)
    questions = dict(QUESTIONS, **{"%s_again" % k: v for k, v in QUESTIONS.items()})
    states = [OOM_TRIGGER + " " + " ".join(rng.choice(WORDS) for _ in range(400)) for _ in range(8)]
    rows = engine.encode(states[0], engine.prepare(questions)).rows
    assert len(rows) * max(len(r) for r in rows) > OOM_LIMIT
    rs = asyncio.run(_many(app.url + "/v1/systemone", [{"state": s, "questions": questions} for s in states]))
    assert [r.status_code for r in rs] == [200] * 8, [r.text for r in rs if r.status_code != 200][:2]
    for r, s in zip(rs, states):
        assert_same_result(r.json(), engine.predict(s, questions))
    after = _info()
    assert after["stats"]["oom_retries"] > info["stats"]["oom_retries"]
    assert after["budget"] <= OOM_LIMIT and after["batching"]["errors"] == info["batching"]["errors"]


def test_queue_full_is_503_with_retry_after(app):
    """Scorer admission (1 ongoing + 1 queued) and then ingress admission at the proxy both answer 503."""
    def tight_scorer(a):
        deployment(a, "Scorer").update(max_ongoing_requests=1, max_queued_requests=1,
                                       user_config=dict(DEFAULT_POLICY, batch_wait_timeout_s=0.5))

    def tight_ingress(a):
        deployment(a, "Ingress").update(max_ongoing_requests=1, max_queued_requests=1)
        deployment(a, "Scorer").update(user_config=dict(DEFAULT_POLICY, batch_wait_timeout_s=0.5))

    body = {"state": "busy busy", "questions": QUESTIONS}
    for change in (tight_scorer, tight_ingress):
        app.redeploy(change)
        wait_for(lambda: _info()["policy"]["batch_wait_timeout_s"] == 0.5, 60, what="the tight config")
        # the routers and the proxy learn the new limits through the controller: bursts until one is refused
        deadline = time.monotonic() + 30
        while True:
            rs = asyncio.run(_many(app.url + "/v1/systemone", [body] * 16))
            codes = [r.status_code for r in rs]
            assert set(codes) <= {200, 503} and 200 in codes, codes
            for r in rs:
                if r.status_code == 503:
                    assert int(r.headers["Retry-After"]) >= 1
                    no_leak(r.text)
            if 503 in codes:
                break
            assert time.monotonic() < deadline, "16 requests at once never got a 503 in 30 s: %s" % codes
    app.redeploy(lambda a: None)
    wait_for(lambda: _info()["policy"] == DEFAULT_POLICY, 60, what="the original config")


def test_metrics_are_exported(app):
    """Our Serve metrics reach the Prometheus endpoint, with requests counted by route and status."""
    def answered(text: str) -> dict[str, float]:  # 200s on the route, per label set (checkpoint, replica, ...)
        return {x.rsplit(" ", 1)[0]: float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                if x.startswith("ray_laya_fleet_requests_total{") and 'route="/v1/systemone"' in x
                and 'status="200"' in x}

    before = answered(httpx.get(app.metrics, timeout=10).text)
    for _ in range(3):
        assert _post(app.url + "/v1/systemone", {"state": "metrics", "questions": QUESTIONS}).status_code == 200
    assert _post(app.url + "/v1/systemone", {"state": "x" * 50_001, "questions": QUESTIONS}).status_code == 413
    assert _post(app.url + "/v1/systemone", {"state": "x", "questions": QUESTIONS}, headers={}).status_code == 401
    stats = _stats()
    want = ['ray_laya_fleet_requests_total{', 'status="200"', 'status="413"', 'status="401"',
            "ray_laya_fleet_request_duration_seconds_bucket", "ray_laya_fleet_queue_wait_seconds_bucket",
            "ray_laya_fleet_batch_requests_bucket", "ray_laya_fleet_batch_rows_bucket",
            "ray_laya_fleet_batch_tokens_bucket", "ray_laya_fleet_forward_seconds_bucket", "ray_laya_fleet_queue_depth",
            "ray_laya_fleet_warmup_seconds", "ray_laya_fleet_ingress_warmup_seconds", "ray_laya_fleet_token_budget"]
    if stats["oom_retries"]:
        want.append("ray_laya_fleet_oom_retries_total")
    if stats["fallback_batches"]:
        want.append("ray_laya_fleet_batch_fallbacks_total")

    missing = list(want)

    def scrape():
        text = httpx.get(app.metrics, timeout=10).text
        missing[:] = [w for w in want if w not in text]
        # Ray exports on an interval, so the new counts come a little later; a series of a replica that has
        # gone may drop out, so what counts is each series' increase
        now = answered(text)
        if sum(max(0.0, v - before.get(k, 0.0)) for k, v in now.items()) < 3:
            missing.append("3 more 200s than before: %s then %s" % (before, now))
        return None if missing else text

    try:
        wait_for(scrape, 60, interval=2, what="metrics export")
    except AssertionError:
        raise AssertionError("not exported: %s" % missing) from None


def test_killed_scorer_replica_is_replaced_and_service_answers_again(app):
    import ray

    old = _info()
    rng = random.Random(12)
    load = LoadGen(app.url + "/v1/systemone", lambda: {"state": _state(rng), "questions": QUESTIONS}, clients=8,
                   headers=AUTH).start()
    wait_for(lambda: len(load.results) >= 5, 60, what="answers before the kill")
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(old["actor_name"], namespace="serve"), no_restart=True)
    new = wait_for(lambda: (i := _try_info()) and i["actor_name"] != old["actor_name"] and i, 90,
                   what="a new replica")
    t_new = time.monotonic()
    wait_for(lambda: sum(t > t_new + 0.5 for t, _, _ in load.results) > 10, 60, what="answers after the replacement")
    results = load.stop()
    assert new["pid"] != old["pid"]
    before = [s for t, s, _ in results if t < t_kill]
    after = [s for t, s, _ in results if t > t_new + 0.5]
    during = [s for t, s, _ in results if t_kill <= t <= t_new + 0.5]
    assert before and set(before) == {200}
    assert len(after) > 10 and set(after) == {200}, after
    # while no replica existed requests were retried or queued, or refused with 503, never a 500
    assert set(during) <= {200, 503}, during
    print("replica replaced in %.1fs; during: %d ok, %d refused (503)" % (t_new - t_kill, during.count(200),
                                                                          during.count(503)))
