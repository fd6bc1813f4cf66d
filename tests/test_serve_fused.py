"""`topology: fused`: one deployment whose replicas hold the scorer, on a real local Ray over real HTTP.

The same config as configs/local.yaml with `args.topology: fused`; the Scorer entry's `user_config` moves to
the Ingress entry (the only deployment). Answers, batching across concurrent requests, a live `reconfigure`,
a poison request failing alone and bad input behave as in the split topology (tests/test_serve.py).
"""

from __future__ import annotations

import asyncio
import copy
import random

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from .cases import WORDS, cases  # noqa: E402
from .serve_helpers import (  # noqa: E402
    AUTH,
    POISON,
    TEST_KEY_ENV,
    LoadGen,
    app_config,
    assert_same_result,
    deploy,
    deployment,
    wait_for,
)
from .test_serve import QUESTIONS, _many  # noqa: E402

pytest_plugins = ["tests.serve_helpers"]


def _fused_config(checkpoint: str, port: int, **args) -> dict:
    """configs/local.yaml pointed at the test checkpoint, as a fused app (serve_app.app.fused_config)."""
    from serve_app.app import fused_config

    cfg = fused_config(app_config(checkpoint, port, **args))
    assert [d["name"] for d in cfg["applications"][0]["deployments"]] == ["Ingress"]
    return cfg


@pytest.fixture(scope="module")
def fused(serve_cluster, tiny_checkpoint):
    cfg = _fused_config(tiny_checkpoint, serve_cluster["ports"]["http"], api_key_env=TEST_KEY_ENV,
                       backend_wrapper="tests.serve_helpers:FaultInjector")
    deploy(cfg, serve_cluster["base"], timeout=180)

    class App:
        url = serve_cluster["base"]
        config = cfg

    return App


def _stats(url: str) -> dict:
    r = httpx.get(url + "/stats", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_fused_app_has_one_deployment_and_answers_equal_engine_predict(fused, engine):
    from ray import serve

    st = serve.status().applications["laya"]
    assert set(st.deployments) == {"Ingress"}
    for states, qs in cases(8, seed=5):
        r = httpx.post(fused.url + "/v1/systemone", json={"state": states[0], "questions": qs}, headers=AUTH,
                       timeout=60)
        assert r.status_code == 200, r.text
        assert_same_result(r.json(), engine.predict(states[0], qs))
    s = _stats(fused.url)
    assert s["requests"] > 0 and s["ingress"]["scorer_calls"] > 0  # the scorer in this replica counted them
    assert s["gc"]["pid"] == s["ingress"]["gc"]["pid"]  # one process: the scorer and its ingress
    assert s["gc"]["frozen"] > 10000  # the model and tokenizers frozen after start-up (Ray Serve; gc_pauses.py)


def test_fused_concurrent_requests_share_batches_and_a_poison_request_fails_alone(fused, engine):
    rng = random.Random(7)
    states = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) for _ in range(48)]
    states[5] = POISON + " " + states[5]
    before = _stats(fused.url)
    rs = asyncio.run(_many(fused.url + "/v1/systemone", [{"state": s, "questions": QUESTIONS} for s in states]))
    assert rs[5].status_code == 500 and "inference failed" in rs[5].text
    for i, (r, s) in enumerate(zip(rs, states)):
        if i != 5:
            assert r.status_code == 200, r.text
            assert_same_result(r.json(), engine.predict(s, QUESTIONS))
    after = _stats(fused.url)
    assert after["max_batch_requests"] > 1 and after["batches"] - before["batches"] < 48


def test_fused_reconfigure_applies_the_batching_policy_live(fused):
    r = httpx.post(fused.url + "/v1/systemone", json={"state": "one request first", "questions": QUESTIONS},
                   headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    served = _stats(fused.url)["requests"]
    assert served > 0
    cfg = copy.deepcopy(fused.config)
    policy = {"max_batch_tokens": 2048, "max_batch_rows": None, "batch_wait_timeout_s": 0.0}
    deployment(cfg["applications"][0], "Ingress")["user_config"] = policy
    deploy(cfg)
    wait_for(lambda: _stats(fused.url)["budget"] == 2048, 60, what="budget 2048")
    deploy(fused.config)
    wait_for(lambda: _stats(fused.url)["budget"] == 8192, 60, what="budget back to 8192")
    assert _stats(fused.url)["requests"] >= served  # the same replica: reconfigured, not restarted


def test_fused_bad_input_is_refused_with_a_message(fused):
    r = httpx.post(fused.url + "/v1/systemone", content=b"{not json", headers=dict(AUTH, **{
        "content-type": "application/json"}), timeout=30)
    assert r.status_code == 400 and "valid JSON" in r.text
    r = httpx.post(fused.url + "/v1/systemone", json={"state": "x", "questions": QUESTIONS}, timeout=30)
    assert r.status_code == 401
    assert httpx.get(fused.url + "/ready", timeout=30).json()["ready"] is True


def test_two_fused_replicas_per_logical_gpu_serve_and_a_killed_one_is_replaced(serve_cluster, tiny_checkpoint):
    """Fused replicas sharing a GPU (configs/prod.yaml runs three; fused_config with replicas_per_gpu=2 here) on
    the session's logical GPUs:
    two replicas of half a GPU each, each with one GPU id and the config's GIL interval, both answering; one
    killed under load is replaced while the other keeps answering, and then every request is answered."""
    import time

    import ray
    from ray import serve

    from serve_app.app import fused_config

    from .serve_helpers import running_replicas

    cfg = app_config(tiny_checkpoint, serve_cluster["ports"]["http"], api_key_env=TEST_KEY_ENV, device="auto",
                     backend="auto", scorer={"num_gpus": 1, "num_cpus": 1, "torch_threads": 1})
    fused_config(cfg, replicas_per_gpu=2, gil_switch_interval_s=0.0001)
    (only,) = cfg["applications"][0]["deployments"]
    assert only["num_replicas"] == 2 and cfg["applications"][0]["args"]["scorer"]["num_gpus"] == 0.5
    only["health_check_period_s"] = 1  # Serve finds the killed replica at its next health check (default 10 s)
    deploy(cfg, serve_cluster["base"], timeout=180)
    assert wait_for(lambda: running_replicas(deployment_name="Ingress") == 2, 120, what="2 fused replicas")
    url = serve_cluster["base"] + "/v1/systemone"
    rng = random.Random(3)
    payloads = [{"state": " ".join(rng.choice(WORDS) for _ in range(20)), "questions": QUESTIONS} for _ in range(64)]
    h = serve.get_deployment_handle("Ingress", "laya")

    def both_served():
        rs = asyncio.run(_many(url, payloads))
        assert all(r.status_code == 200 for r in rs), [r.status_code for r in rs]
        infos = {i["actor_name"]: i for i in (h.info.remote().result(timeout_s=30) for _ in range(16))}
        return len(infos) == 2 and all(i["batching"]["requests"] > 0 for i in infos.values()) and infos

    infos = wait_for(both_served, 90, what="both fused replicas answering")
    for i in infos.values():
        assert i["device"] == "cpu" and len(i["gpu_ids"]) == 1 and i["gpu_ids"] == [i["cuda_visible_devices"]]
        assert i["gil_switch_interval_s"] == pytest.approx(0.0001)

    # kill one replica under load: the other keeps answering, Serve replaces the dead one
    victim = next(iter(infos))
    load = LoadGen(url, lambda: payloads[rng.randrange(len(payloads))], clients=8, headers=AUTH).start()
    wait_for(lambda: len(load.results) >= 5, 60, what="answers before the kill")
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)

    def replaced():
        try:
            names = {h.info.remote().result(timeout_s=10)["actor_name"] for _ in range(16)}
        except Exception:  # noqa: BLE001 - a call routed to the dead replica before Serve noticed
            return False
        return len(names) == 2 and victim not in names

    wait_for(replaced, 120, interval=1.0, what="the killed fused replica replaced")
    t_new = time.monotonic()
    wait_for(lambda: sum(t > t_new + 0.5 for t, _, _ in load.results) > 10, 60, what="answers after the replacement")
    results = load.stop()
    before = [st for t, st, _ in results if t < t_kill]
    during = [st for t, st, _ in results if t_kill <= t <= t_new + 0.5]
    after = [st for t, st, _ in results if t > t_new + 0.5]
    assert before and set(before) == {200}
    assert len(after) > 10 and set(after) == {200}, after
    # the surviving replica answered while the other was down (only requests the dead one held may fail)
    assert during.count(200) > len(during) // 2, {x: during.count(x) for x in set(during)}
    print("fused replica replaced in %.1fs; during: %s" % (t_new - t_kill, {x: during.count(x) for x in set(during)}))


def test_a_replica_whose_forward_is_stuck_fails_its_health_check_and_is_replaced(serve_cluster, tiny_checkpoint):
    """A forward that never returns (a wedged GPU raises nothing): once it has run past the scorer's
    `forward_stall_s`, the replica's health check fails, Serve replaces it, and requests are answered again."""
    import threading
    import time

    from ray import serve

    from .serve_helpers import HANG, HANG_S

    cfg = _fused_config(tiny_checkpoint, serve_cluster["ports"]["http"], api_key_env=TEST_KEY_ENV,
                        backend_wrapper="tests.serve_helpers:FaultInjector",
                        scorer={"num_cpus": 0.75, "num_gpus": 0, "torch_threads": 1, "forward_stall_s": 2})
    (only,) = cfg["applications"][0]["deployments"]
    only["health_check_period_s"] = 1
    only["graceful_shutdown_timeout_s"] = 2
    deploy(cfg, serve_cluster["base"], timeout=180)
    url = serve_cluster["base"] + "/v1/systemone"
    h = serve.get_deployment_handle("Ingress", "laya")
    first = h.info.remote().result(timeout_s=30)
    assert first["forward_stall_s"] == 2 and first["healthy"]
    ok = httpx.post(url, json={"state": "a working state", "questions": QUESTIONS}, headers=AUTH, timeout=60)
    assert ok.status_code == 200, ok.text

    stuck: dict = {}

    def send_stuck():
        t = time.monotonic()
        try:
            r = httpx.post(url, json={"state": "the state %s here" % HANG, "questions": QUESTIONS}, headers=AUTH,
                           timeout=HANG_S + 30)
            stuck["status"] = r.status_code
        except httpx.HTTPError as e:
            stuck["status"] = type(e).__name__
        stuck["s"] = time.monotonic() - t

    th = threading.Thread(target=send_stuck, daemon=True)
    th.start()

    def replaced():
        try:
            info = h.info.remote().result(timeout_s=5)
        except Exception:  # noqa: BLE001 - the stuck replica is going away
            return False
        return info["actor_name"] != first["actor_name"] and info["healthy"]

    t0 = time.monotonic()
    wait_for(replaced, 60, interval=1.0, what="the stuck replica replaced")
    replaced_s = time.monotonic() - t0
    th.join(HANG_S + 40)
    # the stuck request ended with the replica, long before the forward would have returned
    assert stuck.get("status") != 200 and stuck["s"] < HANG_S - 30, stuck
    rs = asyncio.run(_many(url, [{"state": "state %d" % i, "questions": QUESTIONS} for i in range(16)]))
    assert [r.status_code for r in rs] == [200] * 16
    print("stuck replica replaced in %.1fs; the stuck request: %s" % (replaced_s, stuck))
