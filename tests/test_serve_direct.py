"""Direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1): the Ingress replica serves HTTP on its own port.

A real `serve run` of configs/local.yaml (its own local Ray, in a subprocess, as an operator would start it)
with direct ingress on: the replica's port answers exactly like the proxy port and the in-process Engine,
and refuses bad input with the same statuses and messages (no traceback, no path).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from serve_app.online.direct_ingress import ingress_ports  # noqa: E402

from .serve_helpers import (  # noqa: E402
    AUTH,
    REPO,
    TEST_KEY,
    TEST_KEY_ENV,
    ServeRun,
    app_config,
    assert_same_result,
    free_port,
    free_port_range,
    jsonify,
    no_leak,
)
from .test_serve import BAD, QUESTIONS  # noqa: E402

DIRECT_PORTS = 41  # the replica's HTTP port is taken from a range of our own, away from other tests' Serve


@pytest.fixture(scope="module")
def direct(tiny_checkpoint):
    """(proxy base URL, direct-ingress base URL, the replica ports) of a `serve run` with direct ingress on."""
    port = free_port()
    cfg = app_config(tiny_checkpoint, port, api_key_env=TEST_KEY_ENV)
    lo = free_port_range(DIRECT_PORTS)
    hi = lo + DIRECT_PORTS - 1
    env = dict(os.environ, RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(lo),
               RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(hi), RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="1",
               RAY_AUTH_MODE="disabled", PYTHONPATH=REPO)
    env[TEST_KEY_ENV] = TEST_KEY
    base = "http://127.0.0.1:%d" % port
    with ServeRun(cfg, env, base, timeout=240):
        ports = ingress_ports(1, timeout=60, ports=(lo, hi))
        yield base, "http://127.0.0.1:%d" % ports[0], ports


def test_the_ingress_replica_answers_on_its_own_port_like_the_proxy_and_the_engine(direct, engine):
    proxy, replica, ports = direct
    assert len(ports) == 1 and ports[0] != int(proxy.rsplit(":", 1)[1])
    for path in ("/health", "/ready"):
        assert httpx.get(replica + path, timeout=30).status_code == 200
    states = ["I was charged twice for order 4412 and nobody answers my emails!",
              {"subject": "invoice", "body": "Where is my invoice for March?"}]
    for state in states:
        body = {"state": state, "questions": QUESTIONS}
        got = httpx.post(replica + "/v1/systemone", json=body, headers=AUTH, timeout=60)
        via_proxy = httpx.post(proxy + "/v1/systemone", json=body, headers=AUTH, timeout=60)
        assert got.status_code == 200 and via_proxy.status_code == 200, (got.text[:300], via_proxy.text[:300])
        assert got.json()["answers"] == via_proxy.json()["answers"]
        assert_same_result(got.json(), jsonify(engine.predict(state, QUESTIONS)))
    r = httpx.post(replica + "/v1/systemone/batch", json={"states": states, "questions": QUESTIONS}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["results"]) == 2


@pytest.mark.parametrize("name,path,body,status,detail", BAD, ids=[b[0] for b in BAD])
def test_bad_input_on_the_direct_port_gets_the_same_status_and_message(direct, name, path, body, status, detail):
    _, replica, _ = direct
    url = replica + "/v1/systemone" + path
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=content, headers=dict(AUTH, **{"Content-Type": "application/json"}), timeout=30)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert detail in r.json()["detail"], r.text[:300]
    no_leak(r.text)


def test_direct_port_checks_the_bearer_and_the_body_limit(direct):
    _, replica, _ = direct
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(replica + "/v1/systemone", json={"state": "x", "questions": QUESTIONS}, headers=headers,
                       timeout=30)
        assert r.status_code == 401 and r.json() == {"detail": "invalid or missing bearer token"}
    big = json.dumps({"state": "a" * (2 * 1024 * 1024 + 10), "questions": QUESTIONS}).encode()

    def chunks():  # chunked, no Content-Length
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]

    r = httpx.post(replica + "/v1/systemone", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and "too large" in r.json()["detail"]
    no_leak(r.text)
