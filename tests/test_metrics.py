"""Metrics as Prometheus scrapes them: every series of serve_app/online/metrics.py with its labels, and the
Grafana dashboard (deploy/grafana/laya-fleet.json) querying only those series.

The app is configs/local.yaml on the tiny checkpoint with the FaultInjector backend wrapper (so errors,
batch fallbacks and OOM halvings happen too), on the session's local Ray; the scrape is Ray's metrics
export port, polled until the replicas' series arrive.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from serve_app.online import metrics  # noqa: E402

from .cases import WORDS  # noqa: E402
from .serve_helpers import (  # noqa: E402
    OOM_LIMIT,
    OOM_TRIGGER,
    POISON,
    app_config,
    deploy,
    deployment,
    scorer_handle,
    wait_for,
)

pytest_plugins = ["tests.serve_helpers"]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(REPO, "deploy", "grafana", "laya-fleet.json")
QUESTIONS = json.load(open(os.path.join(REPO, "configs", "example_questions.json")))
ONE, BATCH = "/v1/systemone", "/v1/systemone/batch"
POLICY = {"max_batch_tokens": 8192, "max_batch_rows": None, "batch_wait_timeout_s": 0.3}


def _series_names() -> dict[str, str]:
    """{exported series name: its NAMES entry}."""
    return {s: name for name in metrics.NAMES for s in metrics.exported(name)}


def _exprs(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows' nested panels included)."""
    out, stack = [], list(dash["panels"])
    while stack:
        p = stack.pop()
        stack.extend(p.get("panels", []))
        out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
    return out


def test_dashboard_queries_only_declared_metrics_and_shows_each():
    dash = json.load(open(DASHBOARD))
    series = _series_names()
    queries = [v["query"] for v in dash["templating"]["list"] if v.get("type") == "query"]
    on_panels: set[str] = set()
    for expr in _exprs(dash) + queries:
        used = re.findall(r"\bray_laya_fleet_\w+", expr)
        assert used, expr
        unknown = [u for u in used if u not in series]
        assert not unknown, (unknown, expr)
        # every label the query names (selectors, by (...), label_values) is one the series carry
        allowed = {"le"} | set(metrics.SERVE_LABELS)
        for u in used:
            allowed |= set(metrics.NAMES[series[u]][2])
        named = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for grouping in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            named |= {x.strip() for x in grouping.split(",") if x.strip()}
        named |= set(re.findall(r"label_values\(\w+,\s*(\w+)\)", expr))
        assert named <= allowed, (named - allowed, expr)
        if expr not in queries:
            on_panels |= {series[u] for u in used}
    assert on_panels == set(metrics.NAMES), set(metrics.NAMES) - on_panels


@pytest.fixture(scope="module")
def app(serve_cluster, tiny_checkpoint):
    """The deployed app (FaultInjector backend, a 300 ms batching window); deleted afterwards."""
    from ray import serve

    cfg = app_config(tiny_checkpoint, serve_cluster["ports"]["http"],
                     backend_wrapper="tests.serve_helpers:FaultInjector")
    deployment(cfg["applications"][0], "Scorer").update(user_config=POLICY)
    deploy(cfg, serve_cluster["base"], timeout=180)
    yield serve_cluster
    serve.delete("laya")


async def _many(url: str, bodies: list) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*(c.post(url, json=b) for b in bodies))
    return [r.status_code for r in rs]


def _traffic(base: str) -> None:
    """Good and bad requests on both routes, a poison request inside a batch, and one OOM-halving request."""
    rng = random.Random(3)
    post = lambda path, **kw: httpx.post(base + path, timeout=60, **kw).status_code  # noqa: E731
    assert post(ONE, json={"state": "metrics", "questions": QUESTIONS}) == 200
    assert post(BATCH, json={"states": ["a", "b c"], "questions": QUESTIONS}) == 200
    assert post(ONE, content=b"{not json", headers={"content-type": "application/json"}) == 400
    assert post(BATCH, json={"states": [], "questions": QUESTIONS}) == 400
    assert post(ONE, json={"state": "x" * 50_001, "questions": QUESTIONS}) == 413
    for _ in range(4):  # until the poison shared a batch (arrival decides) and its batch fell back
        before = scorer_handle().stats.remote().result(timeout_s=30)["fallback_batches"]
        states = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(5)] + [POISON]
        codes = asyncio.run(_many(base + ONE, [{"state": s, "questions": QUESTIONS} for s in states]))
        assert codes == [200] * 5 + [500], codes
        if scorer_handle().stats.remote().result(timeout_s=30)["fallback_batches"] > before:
            break
    questions = dict(QUESTIONS, **{"%s_again" % k: v for k, v in QUESTIONS.items()})  # over OOM_LIMIT tokens
    state = OOM_TRIGGER + " " + " ".join(rng.choice(WORDS) for _ in range(400))
    assert post(ONE, json={"state": state, "questions": questions}) == 200
    stats = scorer_handle().stats.remote().result(timeout_s=30)
    assert stats["oom_retries"] > 0 and stats["budget"] <= OOM_LIMIT and stats["fallback_batches"] > 0, stats


def _scrape(url: str) -> dict[str, list[dict[str, str]]]:
    """{series name: the label sets of its samples} for this app's laya_fleet series at `url`."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[dict[str, str]]] = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            if s.name.startswith("ray_laya_fleet_") and s.labels.get("application") == "laya":
                out.setdefault(s.name, []).append(dict(s.labels, value=s.value))
    return out


def test_every_metric_is_scraped_with_its_labels(app):
    _traffic(app["base"])
    want = _series_names()
    seen: dict[str, list[dict[str, str]]] = {}

    def complete():
        seen.clear()
        seen.update(_scrape(app["metrics"]))
        statuses = {(x["route"], x["status"]) for x in seen.get("ray_laya_fleet_requests_total", [])}
        return set(want) <= set(seen) and {(ONE, "200"), (ONE, "400"), (ONE, "413"), (ONE, "500"),
                                           (BATCH, "200"), (BATCH, "400")} <= statuses

    try:
        wait_for(complete, 60, interval=2, what="every laya_fleet series")
    except AssertionError:
        raise AssertionError("not exported: %s" % sorted(set(want) - set(seen))) from None
    for series, name in want.items():
        keys = metrics.NAMES[name][2]
        for labels in seen[series]:
            assert set(keys) | set(metrics.SERVE_LABELS) <= set(labels), (series, labels)
            assert labels["checkpoint"] == "tiny", (series, labels)
            if "backend" in keys:
                assert labels["backend"] == "eager", (series, labels)
            if "route" in keys:
                assert labels["route"] in (ONE, BATCH) and labels["status"].isdigit(), (series, labels)
    ok = [x for x in seen["ray_laya_fleet_requests_total"] if x["route"] == ONE and x["status"] == "200"]
    assert sum(x["value"] for x in ok) >= 1 + 5 + 1
    # durations are in seconds: a request on the tiny checkpoint takes well under 10 s on average
    sums = {(x["route"], x["status"]): x["value"] for x in seen["ray_laya_fleet_request_duration_seconds_sum"]}
    counts = {(x["route"], x["status"]): x["value"] for x in seen["ray_laya_fleet_request_duration_seconds_count"]}
    assert 0 < sums[(ONE, "200")] / counts[(ONE, "200")] < 10.0
