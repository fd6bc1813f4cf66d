"""Metrics as Prometheus scrapes them: every series of serve_app/online/metrics.py with its labels, the
Grafana dashboard (deploy/grafana/laya-fleet.json) querying only those series, and docs/serving.md's table
naming exactly them.

The app is configs/local.yaml's two checkpoints (`english` the session's tiny one, `multilingual` a
tiny-multilingual one) with the FaultInjector backend wrapper (so errors, batch fallbacks and OOM halvings
happen too), on the session's local Ray; the scrape is Ray's metrics export port, polled until the replicas'
series arrive. A request's `checkpoint` label is the checkpoint it was routed to.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import warnings

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
SERVING_DOC = os.path.join(REPO, "docs", "serving.md")
QUESTIONS = json.load(open(os.path.join(REPO, "configs", "example_questions.json")))
ONE, BATCH = "/v1/systemone", "/v1/systemone/batch"
POLICY = {"max_batch_tokens": 8192, "max_batch_rows": None, "batch_wait_timeout_s": 0.3}
CKPT, ML = "tiny", "tiny-multilingual"  # the checkpoints' labels: their directories' basenames
BOTH = CKPT + "," + ML  # a batch split between the two
EN = {"model": "english"}  # pins a request to the default checkpoint, whatever the state's language
EN_STATE = "Hi, my order arrived broken and I want my money back today."
RU = "Привет, мой заказ пришёл сломанным, я хочу вернуть деньги сегодня."  # non-Latin script: multilingual


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


def test_serving_doc_lists_every_metric_with_its_type_and_labels():
    section = open(SERVING_DOC, encoding="utf-8").read().split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(ray_laya_fleet_\w+)` \| (\w+) \| ([^|]*) \|", section, re.M)
    documented = {name: (kind, {x.strip(" `") for x in labels.split(",")}) for name, kind, labels in rows}
    assert len(documented) == len(rows), "a metric is listed twice"
    # counters as scraped (`_total`), histograms and gauges by their base name
    want = {"ray_" + n + ("_total" if kind == "counter" else ""): (kind, set(keys))
            for n, (kind, _, keys, _) in metrics.NAMES.items()}
    assert documented == want


def test_request_tags_name_the_checkpoint_each_concurrent_request_was_routed_to():
    async def request(paths: tuple[str, ...], out: list) -> None:
        metrics.routed_to()  # as the ingress does when a request starts
        out.append(metrics.request_tags(ONE, 400))
        await asyncio.sleep(0.01)
        metrics.routed_to(*paths)
        await asyncio.sleep(0.02)  # the other requests route meanwhile
        out.append(metrics.request_tags(ONE, 200))

    async def main() -> list[list]:
        outs: list[list] = [[], [], []]
        await asyncio.gather(request(("/c/" + CKPT,), outs[0]), request(("/c/" + ML + "/",), outs[1]),
                             request(("/c/" + ML, "/c/" + CKPT, "/d/" + ML), outs[2]))
        return outs

    outs = asyncio.run(main())
    assert [o[0] for o in outs] == [{"route": ONE, "status": "400"}] * 3  # not routed: the default tag stays
    assert [o[1]["checkpoint"] for o in outs] == [CKPT, ML, BOTH]


@pytest.fixture(scope="module")
def app(serve_cluster, tiny_checkpoint, tmp_path_factory):
    """The deployed two-checkpoint app (FaultInjector backend, a 300 ms batching window); deleted afterwards."""
    from ray import serve

    from model.make_checkpoint import make_checkpoint

    ml = str(tmp_path_factory.mktemp("ckpt") / ML)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_checkpoint(ml, "tiny-multilingual", seed=0)
    cfg = app_config(tiny_checkpoint, serve_cluster["ports"]["http"],
                     backend_wrapper="tests.serve_helpers:FaultInjector", checkpoints={"multilingual": ml})
    deployment(cfg["applications"][0], "Scorer").update(user_config=POLICY)
    deploy(cfg, serve_cluster["base"], timeout=180)
    yield serve_cluster
    serve.delete("laya")


async def _many(url: str, bodies: list) -> list[int]:
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*(c.post(url, json=b) for b in bodies))
    return [r.status_code for r in rs]


def _routed(base: str, path: str, body: dict) -> list[str]:
    """The checkpoints (served names) that answered `body`, each state's in order; asserts a 200."""
    r = httpx.post(base + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [x["routing"]["model"] for x in r.json().get("results", [r.json()])]


def _traffic(base: str) -> None:
    """Good and bad requests on both routes, a poison request inside a batch, one OOM-halving request (all on
    the default checkpoint), and requests routed to `multilingual`: by `model`, by the state's script, and a
    batch split between the two."""
    rng = random.Random(3)
    post = lambda path, **kw: httpx.post(base + path, timeout=60, **kw).status_code  # noqa: E731
    assert _routed(base, ONE, {"state": "metrics", "questions": QUESTIONS, **EN}) == ["english"]
    assert _routed(base, BATCH, {"states": ["a", "b c"], "questions": QUESTIONS, **EN}) == ["english"] * 2
    assert _routed(base, ONE, {"state": "metrics", "questions": QUESTIONS, "model": "multilingual"}) \
        == ["multilingual"]
    assert _routed(base, ONE, {"state": RU, "questions": QUESTIONS}) == ["multilingual"]
    # an English state goes to english, a non-Latin one to multilingual
    assert _routed(base, BATCH, {"states": [EN_STATE, RU], "questions": QUESTIONS}) == ["english", "multilingual"]
    assert post(ONE, content=b"{not json", headers={"content-type": "application/json"}) == 400
    assert post(BATCH, json={"states": [], "questions": QUESTIONS}) == 400
    assert post(ONE, json={"state": "x" * 50_001, "questions": QUESTIONS}) == 413
    for _ in range(4):  # until the poison shared a batch (arrival decides) and its batch fell back
        before = scorer_handle().stats.remote().result(timeout_s=30)["fallback_batches"]
        states = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(5)] + [POISON]
        codes = asyncio.run(_many(base + ONE, [{"state": s, "questions": QUESTIONS, **EN} for s in states]))
        assert codes == [200] * 5 + [500], codes
        if scorer_handle().stats.remote().result(timeout_s=30)["fallback_batches"] > before:
            break
    questions = dict(QUESTIONS, **{"%s_again" % k: v for k, v in QUESTIONS.items()})  # over OOM_LIMIT tokens
    state = OOM_TRIGGER + " " + " ".join(rng.choice(WORDS) for _ in range(400))
    assert post(ONE, json={"state": state, "questions": questions, **EN}) == 200
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
    # (checkpoint, route, status) of requests that must be counted; both checkpoints' scorers must report batches
    expected = {(CKPT, ONE, "200"), (CKPT, ONE, "400"), (CKPT, ONE, "413"), (CKPT, ONE, "500"), (CKPT, BATCH, "200"),
                (CKPT, BATCH, "400"), (ML, ONE, "200"), (BOTH, BATCH, "200")}
    # the counts the traffic makes (at least: the exact values are checked below); each process exports on its own
    # interval, so a series can be there before its last increment
    least = {(CKPT, ONE, "200"): 1 + 5 + 1, (ML, ONE, "200"): 2, (CKPT, BATCH, "200"): 1, (BOTH, BATCH, "200"): 1,
             (CKPT, ONE, "400"): 1, (CKPT, ONE, "413"): 1}
    missing: list = []

    def complete():
        seen.clear()
        seen.update(_scrape(app["metrics"]))
        counted = _by_request(seen.get("ray_laya_fleet_requests_total", []))
        timed = _by_request(seen.get("ray_laya_fleet_request_duration_seconds_count", []))
        scored = set(_by_request(seen.get("ray_laya_fleet_forward_seconds_count", []), ("checkpoint",)))
        short = {k: counted.get(k, 0) for k, n in least.items() if counted.get(k, 0) < n}
        if timed.get((ML, ONE, "200"), 0) < 2:
            short["duration count %s" % ((ML, ONE, "200"),)] = timed.get((ML, ONE, "200"), 0)
        missing[:] = [sorted(set(want) - set(seen)), sorted(expected - set(counted)),
                      sorted({(CKPT,), (ML,)} - scored), short]
        return not any(missing)

    try:
        wait_for(complete, 60, interval=2, what="every laya_fleet series")
    except AssertionError:
        raise AssertionError("not exported: series %s; requests (checkpoint, route, status) %s; scorer batches "
                             "of %s; counts short of the traffic's %s" % tuple(missing)) from None
    for series, name in want.items():
        keys = metrics.NAMES[name][2]
        for labels in seen[series]:
            assert set(keys) | set(metrics.SERVE_LABELS) <= set(labels), (series, labels)
            assert labels["checkpoint"] in ((CKPT, ML, BOTH) if "route" in keys else (CKPT, ML)), (series, labels)
            if "backend" in keys:
                assert labels["backend"] == "eager", (series, labels)
            if "route" in keys:
                assert labels["route"] in (ONE, BATCH) and labels["status"].isdigit(), (series, labels)
    requests = _by_request(seen["ray_laya_fleet_requests_total"])
    # each request counted once, under the checkpoint that answered it; refusals before routing under the default
    assert requests[(CKPT, ONE, "200")] >= 1 + 5 + 1 and requests[(ML, ONE, "200")] == 2
    assert requests[(CKPT, BATCH, "200")] == 1 and requests[(BOTH, BATCH, "200")] == 1
    assert requests[(CKPT, ONE, "400")] == 1 and requests[(CKPT, ONE, "413")] == 1
    assert not any(k[0] != CKPT and k[2] != "200" for k in requests), requests
    # durations are in seconds: a request on a tiny checkpoint takes well under 10 s on average
    sums = _by_request(seen["ray_laya_fleet_request_duration_seconds_sum"])
    counts = _by_request(seen["ray_laya_fleet_request_duration_seconds_count"])
    assert counts[(ML, ONE, "200")] == 2
    for key in ((CKPT, ONE, "200"), (ML, ONE, "200")):
        assert 0 < sums[key] / counts[key] < 10.0, key


def _by_request(samples: list[dict], keys: tuple[str, ...] = ("checkpoint", "route", "status")) -> dict:
    """{label values of `keys`: the samples' values summed over the other labels (replicas, deployments)}."""
    out: dict[tuple, float] = {}
    for x in samples:
        k = tuple(x[key] for key in keys)
        out[k] = out.get(k, 0) + x["value"]
    return out
