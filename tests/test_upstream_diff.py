"""The differential test: upstream's own `laya-serve` and laya-fleet's app answer the same requests alike.

Both servers run on the same local checkpoints under the same names (tests/upstream_server.py) and get every
request of tests/upstream_corpus.py: status codes must match, error texts where upstream's are fixed, answers and
usage within 1e-4 with identical keys in the same order, `routing.model` wherever a checkpoint answered, and the
timing headers. Every mismatch is printed as one table before the assertion, so one run shows them all. A
request where laya-fleet differs on purpose is marked in the corpus with its reason, and checked against that.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

pytest.register_assert_rewrite("tests.upstream_server")

from .upstream_corpus import (  # noqa: E402
    BATCH,
    CONTROLS,
    ONE,
    ROUTING,
    SERVING,
    Case,
    corpus,
)
from .upstream_server import API_KEY, REPO  # noqa: E402

pytest_plugins = ["tests.upstream_server"]

ATOL = 1e-4 + 1e-9  # both sides round to 4 decimals, so one rounding step apart is equal
TIMING_HEADERS = ("server-timing", "x-inference-time-ms")
# routing keys a client reads; upstream adds its own detection report beside them
ROUTING_KEYS = ("model", "repo", "reason")
AUTH_HEADERS = {"key": {"Authorization": "Bearer " + API_KEY}, "none": {},
                "wrong": {"Authorization": "Bearer not-the-key"}, "scheme": {"Authorization": "Token " + API_KEY}}


@dataclass
class Answer:
    """What one server answered: status, headers (lowercase names) and the body as JSON or text."""

    status: int
    headers: dict[str, str]
    body: Any

    def detail(self) -> Any:
        """The error's `detail`, else the whole body."""
        return self.body.get("detail", self.body) if isinstance(self.body, dict) else self.body

    def excerpt(self, n: int = 160) -> str:
        """The status and the start of the body, on one line."""
        text = self.body if isinstance(self.body, str) else json.dumps(self.body, ensure_ascii=False)
        return "%d %s" % (self.status, text[:n].replace("\n", " "))


@dataclass
class Mismatch:
    """One difference between the two servers' answers to one request."""

    case: str
    owner: str
    what: str
    upstream: str
    ours: str


def send(client: httpx.Client, base: str, case: Case) -> Answer:
    """Send `case` to the server at `base`; returns its answer."""
    headers = {"Content-Type": "application/json"} if case.method == "POST" else {}
    headers.update(AUTH_HEADERS[case.auth])
    headers.update(case.headers)
    headers = {k: v for k, v in headers.items() if v is not None}
    r = client.request(case.method, base + case.path, content=case.content(), headers=headers)
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return Answer(r.status_code, {k.lower(): v for k, v in r.headers.items()}, body)


def _registry_free(text: str) -> tuple[str, bool]:
    """An "unknown model" text without the list of names the server formats into it."""
    return text.split("; choose one of", 1)[0], text.endswith(", or omit model to let the router choose")


def deep_diff(up: Any, us: Any, path: str = "", ordered: bool = True) -> list[tuple[str, str, str]]:
    """(path, upstream, ours) for every difference: dict keys (in order unless not `ordered`), numbers within
    ATOL, others equal."""
    if isinstance(up, dict) and isinstance(us, dict):
        if list(up) != list(us) and (ordered or set(up) != set(us)):
            if set(up) != set(us):
                return [(path + " keys", str(list(up)), str(list(us)))]
            out = [(path + " key order", str(list(up)), str(list(us)))]
        else:
            out = []
        for k in up:
            out += deep_diff(up[k], us[k], "%s.%s" % (path, k) if path else str(k), ordered)
        return out
    if isinstance(up, list) and isinstance(us, list) and len(up) == len(us):
        return [d for i, (a, b) in enumerate(zip(up, us)) for d in deep_diff(a, b, "%s[%d]" % (path, i), ordered)]
    numeric = (int, float)
    if (isinstance(up, numeric) and isinstance(us, numeric) and not isinstance(up, bool)
            and not isinstance(us, bool) and isinstance(up, float) | isinstance(us, float)):
        return [] if abs(up - us) <= ATOL else [(path, repr(up), repr(us))]
    return [] if up == us and type(up) is type(us) else [(path, json.dumps(up)[:80], json.dumps(us)[:80])]


def _grouped(owner: str, what: str, diffs: list[tuple[str, str, str]]) -> list[tuple[str, str, str, str]]:
    """One (owner, what, upstream, ours) line for a group of differences, naming the first two."""
    if not diffs:
        return []
    first = diffs[:2]
    return [(owner, "%s (%d)" % (what, len(diffs)), "; ".join("%s=%s" % (p, a) for p, a, _ in first),
             "; ".join("%s=%s" % (p, b) for p, _, b in first))]


def _result_diff(up: dict, us: dict, where: str) -> list[tuple[str, str, str, str]]:
    """(owner, what, upstream, ours) between two /v1/systemone results; when another checkpoint answered, only
    that (its answers differ as a consequence)."""
    up_routing, us_routing = up.get("routing"), us.get("routing")
    if up_routing is not None:
        if not isinstance(us_routing, dict):
            return [(ROUTING, where + "routing", json.dumps(up_routing)[:80], json.dumps(us_routing))]
        if us_routing.get("model") != up_routing.get("model"):
            return [(ROUTING, where + "routing.model", str(up_routing.get("model")),
                     "%s (%s)" % (us_routing.get("model"), us_routing.get("reason")))]
    out = []
    if up_routing is not None and any(k not in us_routing for k in ROUTING_KEYS):
        out.append((ROUTING, where + "routing keys", str(list(up_routing)), str(list(us_routing))))
    if list(up) != list(us):
        out.append((CONTROLS, where + "keys", str(list(up)), str(list(us))))
    answers = deep_diff(up.get("answers"), us.get("answers"), "")
    out += _grouped(CONTROLS, where + "answers", answers)
    out += _grouped(CONTROLS, where + "usage", deep_diff(up.get("usage"), us.get("usage"), ""))
    for k in up:
        if k not in ("answers", "usage", "routing") and k in us:
            out += _grouped(CONTROLS, where + k, deep_diff(up[k], us[k], k))
    return out


def compare(case: Case, up: Answer, us: Answer) -> list[Mismatch]:
    """Every mismatch between the two answers to `case`."""
    def miss(owner: str, what: str, a: str, b: str) -> Mismatch:
        return Mismatch(case.name, owner, what, a, b)

    if up.status != us.status:
        return [miss(case.owner, "status", up.excerpt(), us.excerpt())]
    out = []
    if up.status != 200:
        a, b = up.detail(), us.detail()
        if case.text == "prefix" and isinstance(a, str) and isinstance(b, str):
            a, b = _registry_free(a), _registry_free(b)
        if a != b:
            out.append(miss(case.owner, "error text", up.excerpt(), us.excerpt()))
        return out
    route = case.path.split("?", 1)[0]
    if route in (ONE, BATCH):
        for h in TIMING_HEADERS:
            if h in up.headers and h not in us.headers:
                out.append(miss(SERVING, "header " + h, up.headers[h], "absent"))
    if not (isinstance(up.body, dict) and isinstance(us.body, dict)):
        return out + ([] if up.body == us.body else [miss(case.owner, "body", up.excerpt(), us.excerpt())])
    if route == ONE:
        diffs = _result_diff(up.body, us.body, "")
    elif route == BATCH:
        a, b = up.body.get("results"), us.body.get("results")
        if list(us.body) != list(up.body):
            out.append(miss(SERVING, "batch keys", str(list(up.body)), str(list(us.body))))
        if not isinstance(b, list) or len(a) != len(b):
            return out + [miss(CONTROLS, "batch results", up.excerpt(), us.excerpt())]
        diffs = _grouped(CONTROLS, "total_usage", deep_diff(up.body["total_usage"], us.body["total_usage"]))
        for i, (x, y) in enumerate(zip(a, b)):
            diffs += _result_diff(x, y, "results[%d]." % i)
    else:
        diffs = _grouped(case.owner, "body", deep_diff(_lru_free(up.body), _lru_free(us.body), ordered=False))
    return out + [miss(o, w, x, y) for o, w, x, y in diffs]


def _lru_free(health: dict) -> dict:
    """A /health body with `loaded` sorted: upstream lists it (and orders its per-checkpoint maps) least recently
    used first, which follows the requests before it, not the server."""
    if isinstance(health.get("loaded"), list):
        return {**health, "loaded": sorted(health["loaded"], key=str)}
    return health


def table(mismatches: list[Mismatch]) -> str:
    """The mismatches as a fixed-width table, one line each."""
    row = "%-38s %-8s %-24s %-60s %s"
    lines = [row % ("request", "owner", "what", "upstream", "laya-fleet")]
    for m in mismatches:
        lines.append(row % (m.case[:38], m.owner, m.what[:24], m.upstream[:60], m.ours[:100]))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def answers(upstream, ours) -> dict[str, tuple[Case, Answer, Answer]]:
    """{case name: (case, upstream's answer, ours)} for the whole corpus, sent once."""
    out = {}
    with httpx.Client(timeout=120.0) as client:
        for case in corpus():
            out[case.name] = (case, send(client, upstream.base, case), send(client, ours.base, case))
    return out


def test_the_corpus_sends_every_upstream_control_good_and_bad(answers):
    """80+ requests; on each route, every body control upstream's laya.serve knows is sent at least once accepted
    and once refused by upstream, and every refused key at least once, so a new upstream key fails here until the
    corpus sends it."""
    from laya import serve

    assert len(answers) >= 80
    seen: dict[tuple[str, str], set[int]] = {}
    for case, up, _ in answers.values():
        if isinstance(case.body, dict):
            for key in (k for k, v in case.body.items() if v is not None):  # null: "not sent", upstream's reading
                seen.setdefault((case.path, key), set()).add(up.status)
    controls = {ONE: serve.BODY_CONTROLS,
                BATCH: ("model",) + serve.BATCH_BODY_CALL_CONTROLS + serve.BATCH_BODY_ITEM_CONTROLS}
    refused = {ONE: serve.BODY_REFUSALS, BATCH: serve.BODY_REFUSALS + serve.BATCH_BODY_OUT_PARAMETERS}
    for route in (ONE, BATCH):
        for key in controls[route]:
            assert {200, 422} <= seen.get((route, key), set()), (route, key, seen.get((route, key)))
        for key in refused[route]:
            assert seen.get((route, key)) == {422}, (route, key, seen.get((route, key)))
    routed = {up.body["routing"]["model"] for case, up, _ in answers.values()
              if case.path == ONE and up.status == 200 and isinstance(up.body, dict) and "routing" in up.body}
    assert routed == {"english", "multilingual"}, routed


def test_every_request_answers_as_upstream_does(answers):
    """Same status, same fixed error texts, answers within 1e-4 with the same keys, same routing.model, the timing
    headers; the table of every mismatch is printed first."""
    mismatches = []
    for case, up, us in answers.values():
        if case.differs is None:
            mismatches += compare(case, up, us)
    if mismatches:
        print("\n%d mismatches over %d requests:\n%s" % (len(mismatches), len(answers), table(mismatches)))
    assert not mismatches, "%d mismatches (table above)" % len(mismatches)


def doc_section(doc: tuple[str, str]) -> str:
    """The text of one section of a doc file: `doc` is (path from the repository root, its heading line)."""
    path, heading = doc
    with open(os.path.join(REPO, path), encoding="utf-8") as fh:
        text = fh.read()
    start = text.index(heading)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else len(text)]


def test_deliberate_differences_are_as_documented(answers):
    """Where laya-fleet differs on purpose, it answers what the corpus says (status, and the checkpoint where the
    difference is routing), and the doc section that lists laya-fleet's deliberate differences names it."""
    marked = [(case, up, us) for case, up, us in answers.values() if case.differs is not None]
    assert marked
    for case, up, us in marked:
        assert us.status in case.ours, (case.name, case.differs, us.excerpt())
        if case.routed is not None:
            assert up.status == 200 and up.body["routing"]["model"] != case.routed, (case.name, up.excerpt())
            assert us.body["routing"]["model"] == case.routed, (case.name, us.body["routing"])
        assert case.documented in doc_section(case.doc), (case.name, "%s does not list it (%r)"
                                                          % (case.doc, case.documented))
