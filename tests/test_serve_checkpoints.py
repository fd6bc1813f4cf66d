"""Several checkpoints in one application, on a real local Ray over real HTTP: routing, scale to zero, a lost replica.

One application (configs/local.yaml with three tiny checkpoints: `english` the session's, `multilingual` a
multilingual-shaped one that may scale to zero, `typed-decisions` one of another seed) serves every test in this
module.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from . import serve_helpers as sh  # noqa: E402
from .serve_helpers import AUTH, LoadGen, assert_same_result, deployment, wait_for  # noqa: E402

pytest_plugins = ["tests.serve_helpers"]

QUESTIONS = json.load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "example_questions.json")))
EN = "Hi, my order #1234 arrived broken and I want my money back today."
ZH = "你好，我的订单到了但是坏了，我想今天退款。请帮帮我。"
RU = "Привет, мой заказ пришёл сломанным, я хочу вернуть деньги сегодня."
FR = "Bonjour, ma commande est arrivée cassée et je veux être remboursé aujourd'hui."
COLD = "Scorer-multilingual"
COLD_SCALING = {"min_replicas": 0, "initial_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 4,
                "upscale_delay_s": 0, "downscale_delay_s": 600, "look_back_period_s": 1, "metrics_interval_s": 0.5}


def _make(tmp_path_factory, shape: str, seed: int) -> str:
    from model.make_checkpoint import make_checkpoint

    out = str(tmp_path_factory.mktemp("ckpt") / shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_checkpoint(out, shape, seed=seed)


def _load(path: str):
    import model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return model.load(path, device="cpu", backend="eager")


@pytest.fixture(scope="module")
def multi(serve_cluster, tiny_checkpoint, tmp_path_factory):
    """The deployed three-checkpoint app: its base URL and {served name: Engine over that checkpoint}."""
    ml = _make(tmp_path_factory, "tiny-multilingual", 0)
    typed = _make(tmp_path_factory, "tiny", 7)
    cfg = sh.app_config(tiny_checkpoint, serve_cluster["ports"]["http"], api_key_env=sh.TEST_KEY_ENV,
                        checkpoints={"multilingual": ml, "typed-decisions": typed})
    app = cfg["applications"][0]
    app["args"]["scorer"]["num_cpus"] = 0.5
    cold = deployment(app, COLD)
    cold.clear()
    cold.update(name=COLD, autoscaling_config=COLD_SCALING, graceful_shutdown_timeout_s=1,
                graceful_shutdown_wait_loop_s=0.2)
    deployment(app, "Scorer-typed-decisions").update(num_replicas=1, health_check_period_s=1,
                                                     graceful_shutdown_timeout_s=1)
    sh.deploy(cfg, serve_cluster["base"], timeout=240)

    class Multi:
        url = serve_cluster["base"]
        config = cfg
        engines = {"english": _load(tiny_checkpoint), "multilingual": _load(ml), "typed-decisions": _load(typed)}

    return Multi


def _post(url: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=90)


def _health(url: str, headers=AUTH) -> dict:
    r = httpx.get(url + "/health", headers=headers, timeout=30)
    assert r.status_code == 200
    return r.json()


ROUTES = [  # (body controls, state, the checkpoint upstream's router picks)
    ({}, EN, "english"),
    ({}, ZH, "multilingual"),  # a non-Latin script
    ({}, RU, "multilingual"),
    ({"model": "multilingual"}, EN, "multilingual"),
    ({"model": "ml"}, EN, "multilingual"),  # an alias
    ({"model": "english"}, ZH, "english"),  # an explicit model beats the script
    ({"task": "typed-decisions"}, EN, "typed-decisions"),
    ({"lang": "fr"}, EN, "multilingual"),
    ({"lang": "en"}, ZH, "english"),
    ({"lang_guess": "ru"}, EN, "multilingual"),
    ({}, FR, "multilingual"),  # Latin script, not English
]


@pytest.mark.parametrize("controls, state, want", ROUTES, ids=[
    "-".join([*map(str, c.values())] or ["auto"]) + "-" + w for c, _, w in ROUTES])
def test_routing_reaches_the_checkpoint_it_names_and_that_checkpoint_answers(multi, controls, state, want):
    r = _post(multi.url + "/v1/systemone", dict(controls, state=state, questions=QUESTIONS))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["routing"]["model"] == want, body["routing"]
    assert {"model", "repo", "reason"} <= set(body["routing"]) and float(r.headers["X-Inference-Time-Ms"]) >= 0
    assert_same_result(body, multi.engines[want].predict(state, QUESTIONS))
    for name, engine in multi.engines.items():  # the checkpoints answer differently, so the equality names one
        if name != want:
            with pytest.raises(AssertionError):
                assert_same_result(body, engine.predict(state, QUESTIONS), atol=1e-6)


def test_a_batch_routes_each_state_to_its_own_checkpoint(multi):
    states = [EN, ZH, FR, RU, {"subject": "invoice", "body": EN}]
    r = _post(multi.url + "/v1/systemone/batch", {"states": states, "questions": QUESTIONS})
    assert r.status_code == 200, r.text
    assert r.headers["Server-Timing"].startswith("inference;dur=")
    results = r.json()["results"]
    assert [x["routing"]["model"] for x in results][:2] == ["english", "multilingual"]
    for state, got in zip(states, results):
        assert_same_result(got, multi.engines[got["routing"]["model"]].predict(state, QUESTIONS))
    r = _post(multi.url + "/v1/systemone/batch", {"states": states, "questions": QUESTIONS, "model": "ml"})
    assert {x["routing"]["model"] for x in r.json()["results"]} == {"multilingual"}


def test_health_reports_the_loaded_checkpoints_to_an_authorized_caller_only(multi):
    import laya.mcp.remote as remote

    wait_for(lambda: len(_health(multi.url)["loaded"]) >= 2, 60, what="two checkpoints loaded")
    full = _health(multi.url)
    assert {"english", "typed-decisions"} <= set(full["loaded"]) and full["loaded"][0] == "english"
    assert full["revisions"] == {n: None for n in full["loaded"]}
    assert full["checkpoint_devices"] == {n: "cpu" for n in full["loaded"]}
    assert full["device"] == "cpu" and full["device_is_preference"] is False
    assert full["cpu_fallbacks"] == {n: {"count": 0, "last_reason": None} for n in full["loaded"]}
    assert _health(multi.url, headers={}) == {"status": "ok"}
    assert _health(multi.url, headers={"Authorization": "Bearer wrong"}) == {"status": "ok"}
    # upstream's own client reads it (and sends the non-ASCII key as urllib writes headers, latin-1)
    router = remote.RemoteRouter(multi.url, api_key=sh.TEST_KEY)
    assert set(router.loaded) == set(_health(multi.url)["loaded"]) and "english" in router.loaded


def test_a_checkpoint_scaled_to_zero_comes_back_under_load_without_failing_a_request(multi):
    """`multilingual` idles to zero replicas while `english` serves load; then requests for it wait for the
    warm-up and answer (or get a documented 503 + Retry-After), and `english` fails nothing meanwhile."""
    cfg = copy.deepcopy(multi.config)  # a live update: idle for 2 s is idle enough
    deployment(cfg["applications"][0], COLD)["autoscaling_config"].update(downscale_to_zero_delay_s=2)
    sh.deploy(cfg)
    english = LoadGen(multi.url + "/v1/systemone", lambda: {"state": EN, "questions": QUESTIONS}, clients=2,
                      headers=AUTH).start()
    try:
        wait_for(lambda: sh.running_replicas("laya", COLD) == 0, 90, what="multilingual scaled to zero")
        assert "multilingual" not in _health(multi.url)["loaded"]
        cold = LoadGen(multi.url + "/v1/systemone", lambda: {"state": ZH, "questions": QUESTIONS}, clients=3,
                       headers=AUTH).start()
        # the cold start's bound (a loaded 2-core machine takes 10-30 s)
        wait_for(lambda: any(s == 200 for _, s, _ in cold.results), 60, what="a multilingual answer")
        time.sleep(1.0)
        # while the traffic still holds it up (it scales to zero again 2 s after the traffic stops)
        assert sh.running_replicas("laya", COLD) == 1 and "multilingual" in _health(multi.url)["loaded"]
        cold_results = cold.stop()
    finally:
        english_results = english.stop()
    assert {s for _, s, _ in english_results} == {200}, english_results[-5:]
    assert {s for _, s, _ in cold_results} <= {200, 503} and cold_results, cold_results


def test_a_killed_replica_of_one_checkpoint_leaves_the_others_answering(multi):
    import ray
    from ray import serve

    typed = serve.get_deployment_handle("Scorer-typed-decisions", "laya")
    victim = typed.info.remote().result(timeout_s=60)["actor_name"]
    load = LoadGen(multi.url + "/v1/systemone", lambda: {"state": EN, "questions": QUESTIONS}, clients=2,
                   headers=AUTH).start()
    try:
        time.sleep(0.5)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        for state in (ZH, EN):  # the other checkpoints answer while the killed one is replaced
            r = _post(multi.url + "/v1/systemone", {"state": state, "questions": QUESTIONS})
            assert r.status_code == 200, r.text
        def replaced() -> bool:
            try:
                return typed.info.remote().result(timeout_s=10)["actor_name"] != victim
            except Exception:  # noqa: BLE001 - a call routed to the dead replica before Serve noticed
                return False

        wait_for(replaced, 120, what="a new typed-decisions replica")
    finally:
        results = load.stop()
    assert {s for _, s, _ in results} == {200}, results[-5:]
    r = _post(multi.url + "/v1/systemone", {"state": EN, "questions": QUESTIONS, "task": "typed-decisions"})
    assert r.status_code == 200 and r.json()["routing"]["model"] == "typed-decisions"
    assert_same_result(r.json(), multi.engines["typed-decisions"].predict(EN, QUESTIONS))


def test_fused_replicas_hold_the_default_and_call_the_other_checkpoints(multi):
    """configs/prod.yaml's shape: the fused Ingress scores `english` in-process, `multilingual` through its
    scorer deployment (the last test here: deploying it replaces the split app)."""
    from serve_app.app import fused_config

    cfg = fused_config(copy.deepcopy(multi.config))
    assert [d["name"] for d in cfg["applications"][0]["deployments"]] == ["Ingress", COLD, "Scorer-typed-decisions"]
    sh.deploy(cfg, multi.url, timeout=240)
    for state, want in ((EN, "english"), (ZH, "multilingual")):
        r = _post(multi.url + "/v1/systemone", {"state": state, "questions": QUESTIONS})
        assert r.status_code == 200 and r.json()["routing"]["model"] == want, r.text
        assert_same_result(r.json(), multi.engines[want].predict(state, QUESTIONS))
    assert sh.running_replicas("laya", "Scorer") == 0 and "english" in _health(multi.url)["loaded"]
