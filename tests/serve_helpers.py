"""Helpers for the Ray Serve tests: a local cluster on loopback, config-file deploys, fault injection.

`deploy` does what `serve run <config.yaml>` does (validate a `ServeDeploySchema` and hand it to the
Serve controller), so the tests exercise the builder, the YAML args and live `user_config` updates
exactly as production does. This module is also a pytest plugin (the `serve_cluster` session fixture)
and is imported by scorer replicas for `FaultInjector`.
"""

from __future__ import annotations

import copy
import json
import os
import socket
import sys
import time
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = "zz-poison-pill-zz"
OOM_TRIGGER = "zz-oom-trigger-zz"
OOM_LIMIT = 2000
HANG = "zz-stuck-device-zz"  # FaultInjector: the forward blocks, as one on a wedged GPU does
HANG_S = 90.0
SECRET_PATH = "/srv/secret/laya_fleet/internal.py"
AUTOSCALING_ENV = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_AUTOSCALING_METRIC_RECORD_INTERVAL_FACTOR": "0.2",
}


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_cluster(num_cpus: int = 8, num_gpus: int = 2) -> dict[str, int]:
    """Start a local Ray (loopback only, logical CPUs/GPUs) plus Serve's proxy; returns its ports."""
    import ray
    from ray import serve

    os.environ.update(AUTOSCALING_ENV)
    os.environ["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    ports = {"http": free_port(), "metrics": free_port()}
    ray.init(num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             _metrics_export_port=ports["metrics"], _system_config={"metrics_report_interval_ms": 1000},
             namespace="serve", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": ports["http"]})
    return ports


def load_config(name: str = "local.yaml") -> dict:
    """A config file from configs/ as a dict."""
    with open(os.path.join(REPO, "configs", name), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def deployment(app: dict, name: str) -> dict:
    """The `deployments[]` entry called `name` of an application config (created if absent)."""
    for d in app.setdefault("deployments", []):
        if d["name"] == name:
            return d
    d = {"name": name}
    app["deployments"].append(d)
    return d


def deploy(config: dict, base_url: str | None = None, timeout: float = 120.0) -> None:
    """Apply a whole Serve config (as `serve run cfg.yaml` does) and wait until every app is RUNNING it
    (and answers /ready under `base_url` when given)."""
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(copy.deepcopy(config))
    client = serve_start(http_options=schema.http_options.model_dump())
    t0 = time.time()
    client.deploy_apps(schema, _blocking=False)

    def applied():
        apps = serve.status().applications
        return all(a["name"] in apps and apps[a["name"]].last_deployed_time_s >= t0 - 1.0
                   and apps[a["name"]].status == "RUNNING" for a in config["applications"])

    wait_for(applied, timeout, what="config applied and RUNNING")
    if base_url:
        for app in config["applications"]:
            wait_ready(base_url + app.get("route_prefix", "/").rstrip("/"), timeout)


def wait_ready(url: str, timeout: float = 120.0) -> float:
    """Poll `url`/ready until it answers 200; returns seconds waited (AssertionError on timeout)."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        try:
            r = httpx.get(url + "/ready", timeout=5.0)
            last = r.status_code
            if r.status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.5)
    raise AssertionError("%s/ready not 200 after %.0fs (last: %s)" % (url, timeout, last))


def wait_for(pred, timeout: float, interval: float = 0.5, what: str = "condition"):
    """Poll `pred()` until truthy; returns its value (AssertionError on timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError("timed out after %.0fs waiting for %s" % (timeout, what))


def jsonify(obj: Any) -> Any:
    """What a result looks like after a JSON round trip (int keys become strings)."""
    return json.loads(json.dumps(obj))


def on_the_wire(result: dict, routing: dict) -> dict:
    """What the service sends for an `Engine.predict` result routed by `routing` with no body controls: upstream's
    answer JSON (`routing`, `x_jev_confidence`), after a JSON round trip."""
    from serve_app.online.controls import finish_answer, parse_controls

    return jsonify(finish_answer(result, parse_controls({}, batch=False), routing))


def assert_same_result(got: dict, want: dict, atol: float = 2e-4) -> None:
    """`got` (HTTP) equals `want` (Engine.predict): same structure and answers, floats within `atol`, apart
    from what only the wire adds (`routing`, each answer's `x_jev_confidence`)."""
    want = jsonify(want)
    got = {k: v for k, v in got.items() if k != "routing"}
    if isinstance(got.get("answers"), dict):
        got["answers"] = {q: {k: v for k, v in a.items() if k != "x_jev_confidence"}
                          for q, a in got["answers"].items()}
    assert got.keys() == want.keys()
    assert got["model"] == want["model"] and got["usage"] == want["usage"]
    assert got["answers"].keys() == want["answers"].keys()
    for qid, w in want["answers"].items():
        g = got["answers"][qid]
        assert g.keys() == w.keys(), qid
        for key, wv in w.items():
            gv = g[key]
            if key == "choice" and gv != wv:  # only a near-tie may flip
                pr = w["probabilities"]
                assert abs(pr[str(gv)] - pr[str(wv)]) < 1e-3, (qid, gv, wv)
            elif isinstance(wv, dict):
                assert gv.keys() == wv.keys(), (qid, key)
                for k in wv:
                    if isinstance(wv[k], float):
                        assert abs(gv[k] - wv[k]) <= atol, (qid, key, k, gv[k], wv[k])
                    else:
                        assert gv[k] == wv[k], (qid, key, k)
            elif isinstance(wv, float):
                assert abs(gv - wv) <= atol, (qid, key, gv, wv)
            else:
                assert gv == wv, (qid, key)


def no_leak(text: str) -> None:
    """Assert an error body carries no traceback, exception repr or file path."""
    for bad in ("Traceback", "File \"", ".py", "site-packages", "/work/", "/srv/", "/tmp/", "Error("):
        assert bad not in text, (bad, text[:500])


def _contains(seq: list[int], sub: list[int]) -> bool:
    n = len(sub)
    return n > 0 and any(seq[i:i + n] == sub for i in range(len(seq) - n + 1))


class FaultInjector:
    """Wraps the scorer's real backend: a poison state raises; an OOM-trigger batch above a size OOMs; a HANG
    state blocks the forward for `hang_s` seconds (HANG_S; a wedged GPU: no answer, no error).

    Installed through the app arg `backend_wrapper: tests.serve_helpers:FaultInjector`; ordinary
    requests go straight to the real forward.
    """

    def __init__(self, backend, engine, oom_limit: int = OOM_LIMIT):
        self.inner = backend
        self.oom_limit = oom_limit
        self.poison = engine.builder.state_ids(POISON)
        self.trigger = engine.builder.state_ids(OOM_TRIGGER)
        self.hang = engine.builder.state_ids(HANG)
        self.hang_s = HANG_S
        self.oom_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows, max_tokens=None):
        """The real forward, unless a fault is triggered (see the class docstring)."""
        import torch

        if any(_contains(r.ids, self.poison) for r in rows):
            raise ValueError("poisoned row rejected by %s" % SECRET_PATH)
        if any(_contains(r.ids, self.hang) for r in rows):
            time.sleep(self.hang_s)
        cost = len(rows) * max(len(r.ids) for r in rows)
        if cost > self.oom_limit and any(_contains(r.ids, self.trigger) for r in rows):
            self.oom_calls += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (%s)" % SECRET_PATH)
        return self.inner.forward(rows) if max_tokens is None else self.inner.forward(rows, max_tokens)


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of xs (0 for an empty list)."""
    return float(np.percentile(xs, q)) if xs else 0.0


TEST_KEY_ENV = "LAYA_FLEET_TEST_API_KEY"
TEST_KEY = "test-key-\u00e9\u00df-0123456789"
AUTH = {"Authorization": ("Bearer " + TEST_KEY).encode("utf-8")}  # a non-ASCII key, sent as UTF-8 bytes


class LoadGen:
    """Closed-loop HTTP clients in a background thread: each sends `payload()` again as soon as answered."""

    def __init__(self, url: str, payload, clients: int, headers: dict | None = None, timeout: float = 60.0):
        self.url, self.payload, self.clients, self.headers, self.timeout = url, payload, clients, headers, timeout
        self.results: list[tuple[float, int, float]] = []  # (finished at, status, seconds)
        self._stop = None
        self._thread = None

    def start(self) -> LoadGen:
        """Start the clients; returns self."""
        import asyncio
        import threading

        self._stop = threading.Event()

        async def client(c: httpx.AsyncClient):
            while not self._stop.is_set():
                await self._one(c)

        async def main():
            limits = httpx.Limits(max_connections=self.clients, max_keepalive_connections=self.clients)
            async with httpx.AsyncClient(timeout=self.timeout, limits=limits) as c:
                await asyncio.gather(*(client(c) for _ in range(self.clients)))

        self._thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self._thread.start()
        return self

    async def _one(self, c: httpx.AsyncClient) -> None:
        """One request; appends (finished at, status or -1 for a transport error, seconds) to `results`."""
        t = time.monotonic()
        try:
            r = await c.post(self.url, json=self.payload(), headers=self.headers)
            status = r.status_code
        except httpx.HTTPError:
            status = -1
        self.results.append((time.monotonic(), status, time.monotonic() - t))

    def stop(self) -> list[tuple[float, int, float]]:
        """Stop after the in-flight requests finish; returns all results."""
        self._stop.set()
        self._thread.join(timeout=self.timeout + 10)
        return self.results


@pytest.fixture(scope="session")
def serve_cluster():
    """One local Ray (8 logical CPUs, 2 logical GPUs, loopback) + Serve proxy for all serve tests; shut down
    at the end of the session. Test modules load this with `pytest_plugins = ["tests.serve_helpers"]`."""
    import ray
    from ray import serve

    saved = dict(os.environ)
    os.environ[TEST_KEY_ENV] = TEST_KEY  # inherited by every Ray worker, like a key in `ray start`'s env
    ports = start_cluster()
    try:
        yield {"ports": ports, "base": "http://127.0.0.1:%d" % ports["http"],
               "metrics": "http://127.0.0.1:%d/metrics" % ports["metrics"]}
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def app_config(checkpoint: str, port: int, **args: Any) -> dict:
    """configs/local.yaml pointed at `checkpoint` (the default checkpoint; the only one unless `args` name
    `checkpoints`) and `port`, with `args` merged into the app's args."""
    cfg = load_config("local.yaml")
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["args"]["checkpoint"] = checkpoint
    app["args"].pop("checkpoints", None)
    app["args"].update(args)
    others = {"Scorer-" + n for n in app["args"].get("checkpoints", {})}
    app["deployments"] = [d for d in app["deployments"] if not d["name"].startswith("Scorer-") or d["name"] in others]
    return cfg


def scorer_handle(app: str = "laya"):
    """A DeploymentHandle to the app's Scorer deployment."""
    from ray import serve

    return serve.get_deployment_handle("Scorer", app)


def running_replicas(app: str = "laya", deployment_name: str = "Scorer") -> int:
    """How many replicas of a deployment are RUNNING now."""
    from ray import serve

    a = serve.status().applications.get(app)
    st = a.deployments.get(deployment_name) if a else None
    return int(st.replica_states.get("RUNNING", 0)) if st else 0


# -- a `serve run` of its own (a second local Ray, as an operator starts one), and what it listens on ------

SERVE_BIN = os.path.join(os.path.dirname(sys.executable), "serve")
# A shell without job control starts background commands with SIGINT ignored, and an ignored signal stays ignored
# across exec: `serve run` would then miss the SIGINT that shuts Serve and Ray down cleanly, and wait for SIGTERM.
_EXEC_WITH_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                     "os.execv(sys.argv[1], sys.argv[1:])")


def free_port_range(n: int, lo: int = 20000, hi: int = 29000) -> int:
    """The first port of `n` consecutive ports in lo..hi that nothing listens on now (below Linux's ephemeral
    range, so Ray's own random ports do not land there)."""
    import random

    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(lo, hi - n)
        try:
            for p in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("", p))
        except OSError:
            continue
        return first
    raise RuntimeError("no %d free consecutive ports in %d..%d" % (n, lo, hi))


class ServeRun:
    """`serve run --address local CONFIG` in a session of its own (its own local Ray), stopped by signalling
    that session's process group: SIGINT (Serve and Ray shut down), then SIGTERM, then SIGKILL."""

    def __init__(self, config: dict, env: dict[str, str], base: str, timeout: float = 240.0):
        import tempfile

        self.config, self.env, self.base, self.timeout = config, env, base, timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="laya-serve-run-")
        self.log_path = os.path.join(self._tmp.name, "serve.log")
        self.proc = None

    def __enter__(self) -> ServeRun:
        import subprocess

        path = os.path.join(self._tmp.name, "config.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(self.config, fh)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _EXEC_WITH_SIGINT, SERVE_BIN, "run", "--address", "local",
                                      path], env=self.env, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_ready(self.base, timeout=self.timeout)
        except AssertionError as e:  # never ready: say why, from what serve run printed
            tail = self.log_tail(3000)
            self.__exit__(None, None, None)
            raise AssertionError("%s\n--- serve run's output, last 3000 characters ---\n%s" % (e, tail)) from None
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def log_tail(self, n: int = 4000) -> str:
        """The last `n` characters of the `serve run` output."""
        with open(self.log_path, encoding="utf-8", errors="replace") as fh:
            return fh.read()[-n:]

    def processes(self) -> dict[int, str]:
        """{pid: process title} of every live process of this `serve run`'s session (Ray's daemons, workers,
        HAProxy): they all inherit its session id."""
        return session_processes(self.proc.pid)

    def __exit__(self, *exc) -> None:
        import signal
        import subprocess

        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()
        self._tmp.cleanup()


def _title(pid: int) -> str:
    """A process's title (Ray workers set theirs, e.g. `ray::ServeReplica:laya:Ingress`), else its command line."""
    with open("/proc/%d/cmdline" % pid, "rb") as fh:
        parts = [p for p in fh.read().split(b"\0") if p.strip()]
    return " ".join(p.decode("utf-8", "replace").strip() for p in parts)


def session_processes(sid: int) -> dict[int, str]:
    """{pid: title} of the live processes whose session id is `sid` (Linux /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name, encoding="utf-8", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out[int(name)] = _title(int(name))
        except (OSError, IndexError, ValueError):  # gone meanwhile, or not ours to read
            continue
    return out


def _hex_addr(text: str) -> tuple[str, int]:
    import ipaddress

    host, port = text.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(raw)
    if ip.version == 6 and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def listening_sockets(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes `pids` hold (Linux /proc)."""
    inodes: dict[str, tuple[str, int]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A":  # TCP_LISTEN
                inodes[f[9]] = _hex_addr(f[1])
    out = []
    for pid in pids:
        try:
            fds = os.listdir("/proc/%d/fd" % pid)
        except OSError:
            continue
        seen = set()
        for fd in fds:
            try:
                target = os.readlink("/proc/%d/fd/%s" % (pid, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inode = target[8:-1]
                if inode in inodes and inode not in seen:
                    seen.add(inode)
                    out.append((pid, *inodes[inode]))
    return sorted(out)


def is_loopback(address: str) -> bool:
    """Whether an IP address is a loopback one (127.0.0.0/8, ::1)."""
    import ipaddress

    return ipaddress.ip_address(address).is_loopback


def haproxy_servers(stats_url: str, backend: str) -> dict[str, dict[str, str]]:
    """{server name: its row} of one backend on HAProxy's stats page (`<stats_url>;csv`): `status` (UP, DOWN,
    `UP 1/2` while checks fail...), `bck` ("1" for a backup server), `scur` / `stot` (current / total sessions
    since this HAProxy process started: a reload restarts them)."""
    import csv
    import io

    r = httpx.get(stats_url + ";csv", timeout=5.0)
    r.raise_for_status()
    rows = csv.DictReader(io.StringIO(r.text.lstrip("# ")))
    return {row["svname"]: row for row in rows
            if row["pxname"] == backend and row["svname"] not in ("FRONTEND", "BACKEND")}
