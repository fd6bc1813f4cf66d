"""Scorer replicas on logical GPUs: distinct GPU ids, CPU fallback, autoscaling 1 -> 2 -> 1 under load.

The session cluster declares 2 logical GPUs on this CPU machine: each `num_gpus: 1` replica gets its own
CUDA_VISIBLE_DEVICES but torch cannot use CUDA, so `device: auto` must land on CPU.
"""

from __future__ import annotations

import json
import os
import random
import time

import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from .cases import WORDS  # noqa: E402
from .serve_helpers import (  # noqa: E402
    AUTH,
    TEST_KEY_ENV,
    LoadGen,
    app_config,
    deploy,
    deployment,
    running_replicas,
    scorer_handle,
    wait_for,
)

pytest_plugins = ["tests.serve_helpers"]

QUESTIONS = json.load(open(os.path.join(os.path.dirname(__file__), "..", "configs", "example_questions.json")))


@pytest.fixture(scope="module")
def gpu_app(serve_cluster, tiny_checkpoint):
    """The app with one logical GPU per scorer replica, autoscaled between 1 and 2 with short delays."""
    cfg = app_config(tiny_checkpoint, serve_cluster["ports"]["http"], api_key_env=TEST_KEY_ENV, device="auto",
                     backend="auto", scorer={"num_gpus": 1, "num_cpus": 1, "torch_threads": 1})
    scorer = deployment(cfg["applications"][0], "Scorer")
    scorer.pop("num_replicas")
    scorer.update(autoscaling_config={"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
                                      "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2,
                                      "metrics_interval_s": 0.5,
                                      # what configs/prod.yaml uses: requests pending in the batcher
                                      "policy": {"policy_function": "serve_app.autoscale:pending_requests_policy"}},
                  graceful_shutdown_timeout_s=2, graceful_shutdown_wait_loop_s=0.5, health_check_period_s=1)
    deploy(cfg, serve_cluster["base"], timeout=180)
    return serve_cluster["base"]


def _infos(n: int = 12) -> dict[str, dict]:
    """Replica infos by actor name, from `n` handle calls (the router spreads them over replicas)."""
    h = scorer_handle()
    out = {}
    for r in [h.info.remote() for _ in range(n)]:
        i = r.result(timeout_s=30)
        out[i["actor_name"]] = i
    return out


def test_replicas_get_distinct_gpus_run_on_cpu_and_autoscale_1_to_2_to_1(gpu_app):
    assert wait_for(lambda: running_replicas() == 1, 60, what="1 replica at rest")
    (first,) = _infos(4).values()
    assert first["device"] == "cpu" and first["backend"] == "eager"
    assert first["gpu_ids"] == [first["cuda_visible_devices"]] and first["cuda_visible_devices"] in ("0", "1")

    rng = random.Random(1)
    load = LoadGen(gpu_app + "/v1/systemone",
                   lambda: {"state": " ".join(rng.choice(WORDS) for _ in range(30)), "questions": QUESTIONS},
                   clients=16, headers=AUTH).start()
    try:
        t0 = time.monotonic()
        wait_for(lambda: running_replicas() == 2, 90, what="upscale to 2 replicas")
        t_up = time.monotonic() - t0
        infos = wait_for(lambda: len(i := _infos()) == 2 and all(x["batching"]["requests"] for x in i.values()) and i,
                         30, what="both replicas serving")
    finally:
        results = load.stop()
    gpus = sorted(i["cuda_visible_devices"] for i in infos.values())
    assert gpus == ["0", "1"], gpus
    assert all(i["device"] == "cpu" and i["gpu_ids"] == [i["cuda_visible_devices"]] for i in infos.values())
    statuses = [s for _, s, _ in results]
    assert len(statuses) > 50 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}

    t1 = time.monotonic()
    wait_for(lambda: running_replicas() == 1, 90, what="downscale back to 1 replica")
    t_down = time.monotonic() - t1
    print("upscale %.1fs, downscale %.1fs, %d requests under load" % (t_up, t_down, len(statuses)))
    import httpx

    r = httpx.post(gpu_app + "/v1/systemone", json={"state": "after", "questions": QUESTIONS}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200


def test_pending_requests_policy_counts_requests_not_calls():
    from types import SimpleNamespace

    from serve_app.autoscale import pending_requests_policy

    cfg = SimpleNamespace(get_target_ongoing_requests=lambda: 64)

    def ctx(n, pending, calls=3):
        return SimpleNamespace(current_num_replicas=n, target_num_replicas=n, total_num_requests=calls,
                               aggregated_metrics={"pending_requests": pending} if pending is not None else {},
                               config=cfg)

    # 3 coalesced calls carrying 300 pending requests on one replica: ask for 300 / 64 replicas, not 3 / 64
    assert pending_requests_policy(ctx(1, {"r1": 300.0}))[0] == 300 / 64
    assert pending_requests_policy(ctx(2, {"r1": 10.0, "r2": 6.0}))[0] == 16 / 64
    assert pending_requests_policy(ctx(1, None, calls=128))[0] == 2.0  # no metric yet: Serve's own count
    assert pending_requests_policy(ctx(0, {"r1": 5.0}))[0] == 0
