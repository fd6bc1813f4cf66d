"""Hardened request handling over real HTTP, against the app tests/test_serve.py deploys: strict JSON, question
field types and text limits, JSON-only Content-Type, HEAD on the GET routes, a poison state failing alone in a
batch, and a large request tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from . import test_serve, test_serve_fused  # noqa: E402
from .serve_helpers import AUTH, POISON, assert_same_result, no_leak  # noqa: E402
from .test_serve import QUESTIONS  # noqa: E402

pytest_plugins = ["tests.serve_helpers"]

app = test_serve.app  # the app fixture of tests/test_serve.py: local.yaml, a bearer key, the FaultInjector

JSON = dict(AUTH, **{"Content-Type": "application/json"})
NOUL = {"type": "noul", "instructions": "Is it fine?"}


def _body(**fields) -> bytes:
    """A /v1/systemone body as bytes: `fields` over a valid one, each value raw JSON text (so NaN can be sent)."""
    base = {"state": '"fine"', "questions": json.dumps({"q": NOUL})}
    base.update(fields)
    return ("{%s}" % ", ".join('"%s": %s' % (k, v) for k, v in base.items())).encode()


def _q(**fields) -> dict:
    """A questions object with one question 'q': a choice question with `fields` over it."""
    return {"q": dict({"type": "choice", "instructions": "pick", "criteria": {"a": "x", "b": "y"}}, **fields)}


LONG_INS, LONG_TEXT = "i" * 8193, "t" * 2049
HARD = [
    # (name, path, body (dict = JSON, bytes = raw), headers, status, substring of detail)
    # 1. strict JSON: NaN / Infinity / numbers past a double are not JSON
    ("NaN state", "", _body(state="NaN"), JSON, 400, "NaN is not a JSON value"),
    ("Infinity max_len", "", _body(max_len="Infinity"), JSON, 400, "Infinity is not a JSON value"),
    ("NaN choice label", "", _body(questions='{"c": {"type": "choice", "instructions": "?", "criteria": [NaN, 1]}}'),
     JSON, 400, "NaN"),
    ("-Infinity description", "",
     _body(questions='{"c": {"type": "choice", "instructions": "?", "criteria": {"a": -Infinity}}}'),
     JSON, 400, "-Infinity"),
    ("number past a double", "", _body(state='{"x": 1e999}'), JSON, 400, "out of range"),
    ("NaN in a batch state", "/batch", b'{"states": ["a", {"v": NaN}], "questions": {}}', JSON, 400, "NaN"),
    # 2. question field types (upstream's rules) -> 422 naming the question
    ("instructions a bool", "", {"state": "x", "questions": _q(instructions=True)}, JSON, 422, "question 'q'"),
    ("instructions null", "", {"state": "x", "questions": _q(instructions=None)}, JSON, 422, "question 'q'"),
    ("instructions empty", "", {"state": "x", "questions": _q(instructions=" ")}, JSON, 422, "question 'q'"),
    ("type not a string", "", {"state": "x", "questions": _q(type=3)}, JSON, 422, "question 'q'"),
    ("criteria a string", "", {"state": "x", "questions": _q(criteria="a,b")}, JSON, 422, "question 'q'"),
    ("choice label an object", "", {"state": "x", "questions": _q(criteria=["a", {"b": 1}])}, JSON, 422,
     "question 'q'"),
    ("score level null", "", {"state": "x", "questions": {"s": {"type": "score", "instructions": "?",
                                                                "criteria": ["lo", None]}}}, JSON, 422,
     "question 's'"),
    ("noul labels not strings", "", {"state": "x", "questions": {"n": dict(NOUL, labels={"false": 0, "true": 1})}},
     JSON, 422, "question 'n'"),
    ("option_order of strings", "", {"state": "x", "questions": _q(option_order=["1", "0"])}, JSON, 422,
     "question 'q'"),
    ("head_max_len 1e9", "", {"state": "x", "head_max_len": 10 ** 9, "questions": QUESTIONS}, JSON, 422,
     "head_max_len"),
    ("head_max_len a float", "", {"state": "x", "head_max_len": 1e9, "questions": QUESTIONS}, JSON, 422,
     "head_max_len"),
    ("head_max_len 0", "", {"state": "x", "head_max_len": 0, "questions": QUESTIONS}, JSON, 422, "head_max_len"),
    # 2. text limits -> 413 naming the question
    ("instructions over 8192", "", {"state": "x", "questions": _q(instructions=LONG_INS)}, JSON, 413,
     "instructions too long for 'q'"),
    ("object instructions over 8192 as JSON", "", {"state": "x", "questions": _q(instructions={"t": "i" * 8190})},
     JSON, 413, "instructions too long for 'q'"),
    ("choice description over 2048", "", {"state": "x", "questions": _q(criteria={"a": LONG_TEXT, "b": "y"})},
     JSON, 413, "criterion 'a' of 'q' too long"),
    ("choice label over 2048", "", {"state": "x", "questions": _q(criteria=["a", LONG_TEXT])}, JSON, 413,
     "criterion 1 of 'q' too long"),
    ("score level over 2048", "", {"state": "x", "questions": {"s": {"type": "score", "instructions": "?",
                                                                     "criteria": ["lo", LONG_TEXT]}}}, JSON, 413,
     "of 's' too long"),
    ("noul label over 2048", "", {"state": "x", "questions": {"n": dict(NOUL, labels={"false": "n",
                                                                                        "true": LONG_TEXT})}},
     JSON, 413, "label 'true' of 'n' too long"),
    ("batch instructions over 8192", "/batch", {"states": ["x"], "questions": _q(instructions=LONG_INS)}, JSON, 413,
     "instructions too long"),
    # 3. the body must be declared JSON (415), and is then not parsed
    ("text/plain", "", {"state": "x", "questions": QUESTIONS}, dict(AUTH, **{"Content-Type": "text/plain"}), 415,
     "Content-Type"),
    ("text/plain, not JSON either", "", b"{nope", dict(AUTH, **{"Content-Type": "text/plain"}), 415, "Content-Type"),
    ("form", "", {"state": "x", "questions": QUESTIONS},
     dict(AUTH, **{"Content-Type": "application/x-www-form-urlencoded"}), 415, "application/json"),
    ("multipart", "/batch", {"states": ["x"], "questions": QUESTIONS},
     dict(AUTH, **{"Content-Type": "multipart/form-data; boundary=x"}), 415, "Content-Type"),
    ("no Content-Type", "", {"state": "x", "questions": QUESTIONS}, AUTH, 415, "missing Content-Type"),
    ("latin-1 charset", "", {"state": "x", "questions": QUESTIONS},
     dict(AUTH, **{"Content-Type": "application/json; charset=latin-1"}), 415, "charset"),
    ("text/plain without the bearer", "", {"state": "x", "questions": QUESTIONS}, {"Content-Type": "text/plain"},
     401, "bearer"),
]
OK = [
    # (name, body, headers): answered 200
    ("instructions at 8192", {"state": "x", "questions": _q(instructions="i" * 8192)}, JSON),
    ("description at 2048", {"state": "x", "questions": _q(criteria={"a": "t" * 2048, "b": "y"})}, JSON),
    ("object instructions", {"state": "x", "questions": _q(instructions={"task": "pick", "lang": "en"})}, JSON),
    ("charset utf-8", {"state": "x", "questions": QUESTIONS},
     dict(AUTH, **{"Content-Type": "application/json; charset=UTF-8"})),
    ("+json", {"state": "x", "questions": QUESTIONS}, dict(AUTH, **{"Content-Type": "application/vnd.laya+json"})),
    ("upper case", {"state": "x", "questions": QUESTIONS}, dict(AUTH, **{"Content-Type": "Application/JSON"})),
    ("head_max_len at max_len", {"state": "x", "head_max_len": 512, "questions": QUESTIONS}, JSON),
]


def _send(url: str, body, headers: dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url, content=content, headers=headers, timeout=60)


@pytest.mark.parametrize("name,path,body,headers,status,detail", HARD, ids=[h[0] for h in HARD])
def test_bad_input_gets_its_status_and_a_detail_naming_the_problem(app, name, path, body, headers, status, detail):
    r = _send(app.url + "/v1/systemone" + path, body, headers)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json")
    assert detail in r.json()["detail"], r.text[:300]
    no_leak(r.text)


@pytest.mark.parametrize("name,body,headers", OK, ids=[o[0] for o in OK])
def test_input_at_the_limits_and_json_media_types_are_answered(app, name, body, headers):
    r = _send(app.url + "/v1/systemone", body, headers)
    assert r.status_code == 200, (name, r.text[:300])
    assert set(r.json()["answers"]) == set(body["questions"])


@pytest.mark.parametrize("path,headers", [("/health", {}), ("/ready", {}), ("/stats", AUTH), ("/info", AUTH),
                                          ("/stats", {}), ("/openapi.json", {})])
def test_head_answers_like_get_without_a_body(app, path, headers):
    get = httpx.get(app.url + path, headers=headers, timeout=30)
    head = httpx.head(app.url + path, headers=headers, timeout=30)
    assert head.status_code == get.status_code != 405, (path, head.status_code, get.status_code)
    assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"]


def test_batch_poison_state_fails_alone_with_an_error_entry(app, engine):
    states = ["the first state is fine", POISON, "the third state is fine too"]
    r = httpx.post(app.url + "/v1/systemone/batch", json={"states": states, "questions": QUESTIONS}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["results"][1] == {"model": body["results"][0]["model"], "error": "inference failed"}
    no_leak(json.dumps(body["results"][1]))
    want = [engine.predict(s, QUESTIONS) for s in (states[0], states[2])]
    for got, w in zip((body["results"][0], body["results"][2]), want):
        assert_same_result(got, w)
    assert body["total_usage"] == {"input_tokens": sum(w["usage"]["input_tokens"] for w in want), "output_tokens": 0}
    # every state poisoned: nothing to answer, the request fails as a whole
    r = httpx.post(app.url + "/v1/systemone/batch", json={"states": [POISON, POISON + " again"],
                                                          "questions": QUESTIONS}, headers=AUTH, timeout=60)
    assert r.status_code == 500 and r.json() == {"detail": "inference failed"}


def _worst_case_body() -> dict:
    """About 1.6 MB of question text, every piece at its limit; max_len 24 makes it a 422 after every head is
    tokenized, so its cost is the ingress's CPU work alone (no scorer queue to share with the small request)."""
    crit = {"opt%d" % i: ("d%d " % i * 700)[:2048] for i in range(8)}
    qs = {"q%d" % i: {"type": "choice", "instructions": ("w%d " % i * 2730)[:8192], "criteria": crit}
          for i in range(64)}
    return {"state": "big", "questions": qs, "max_len": 24}


async def _timed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[float, httpx.Response]:
    t0 = time.perf_counter()
    r = await client.post(url, json=body, headers=AUTH)
    return time.perf_counter() - t0, r


def test_a_large_request_does_not_hold_up_a_small_one(app):
    url, small = app.url + "/v1/systemone", {"state": "small and quick", "questions": {"q": NOUL}}
    big = _worst_case_body()
    assert 1_400_000 < len(json.dumps(big)) < 2 * 1024 * 1024

    async def run() -> tuple[float, float, list[float]]:
        async with httpx.AsyncClient(timeout=120) as c:
            for _ in range(3):
                await _timed(c, url, small)  # warm connections and the prepared question set
            alone = statistics.median([(await _timed(c, url, small))[0] for _ in range(7)])
            big_task = asyncio.create_task(_timed(c, url, big))
            beside = []
            while not big_task.done():  # every small request sent while the large one is in flight counts
                dt, r = await _timed(c, url, small)
                assert r.status_code == 200, r.text
                beside.append(dt)
                await asyncio.sleep(0.01)
            big_s, r = await big_task
            assert r.status_code == 422 and "'q0'" in r.json()["detail"], r.text[:300]
            return alone, big_s, beside

    alone, big_s, beside = asyncio.run(run())
    print("small alone %.1f ms, beside the large one %s ms, large %.0f ms"
          % (alone * 1e3, [round(b * 1e3, 1) for b in beside], big_s * 1e3))
    assert statistics.median(beside) < 10 * alone + big_s / 4, (alone, beside, big_s)


fused = test_serve_fused.fused  # the fused app fixture of tests/test_serve_fused.py (deploys over `app`: last)


def test_fused_batch_poison_state_fails_alone_and_head_answers(fused, engine):
    states = [POISON, "a fine state"]
    r = httpx.post(fused.url + "/v1/systemone/batch", json={"states": states, "questions": QUESTIONS}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["results"][0] == {"model": body["results"][1]["model"], "error": "inference failed"}
    assert_same_result(body["results"][1], engine.predict(states[1], QUESTIONS))
    head = httpx.head(fused.url + "/info", headers=AUTH, timeout=30)
    assert head.status_code == 200 and head.content == b""
    r = httpx.post(fused.url + "/v1/systemone", content=b'{"state": NaN, "questions": {}}', headers=JSON, timeout=30)
    assert r.status_code == 400 and "NaN" in r.json()["detail"]
