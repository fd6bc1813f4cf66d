"""Closed-loop HTTP load against the online service: requests/s and p50/p99 latency per client count.

Each client sends one state x the 3 questions of configs/example_questions.json, waits for the answer and sends
the next; a level is `--duration` seconds measured after `--warmup`. The server is `--url`, a config file run as
shipped (`--config`, through Ray's HAProxy ingress when its args say `haproxy: true`), or configs/local.yaml
pointed at `--checkpoint`; `--floor` first runs that topology doing no work (bench/serve_floor_app.py) and
`--compare-upstream` then runs upstream's `laya-serve` on the same checkpoint, one server at a time. Each row also
reports the cores Serve's processes used, GPU busy time and the scorer's batching counters. Prints a table,
writes JSON, draws a PNG next to it.

    python bench/serve_load.py --checkpoint DIR --backend auto --config configs/prod.yaml --levels 1,16,64,512
    python bench/serve_load.py --url http://127.0.0.1:8000 --levels 1,8,64 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from typing import Any

import numpy as np
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from serve_app.online.haproxy_launcher import GPU_NODE_ENV  # noqa: E402  (the cluster environment prod.yaml asks)

QUESTIONS = json.load(open(os.path.join(REPO, "configs", "example_questions.json"), encoding="utf-8"))
UPSTREAM_MODEL = "bench"
# a client that gets 503 / 429 waits Retry-After seconds (capped here) before its next request, as clients with
# backoff do
RETRY_AFTER_CAP_S = 2.0
# the errors key of a 429 / 503 that came without Retry-After ("503-no-Retry-After"): shed load must say when
NO_RETRY_AFTER = "-no-Retry-After"


def retry_after_cap() -> float:
    """RETRY_AFTER_CAP_S, or 0 under --no-retry-after (which the spawned client processes see in their env)."""
    return float(os.environ.get("LAYA_FLEET_BENCH_RETRY_AFTER_CAP_S", RETRY_AFTER_CAP_S))


_OPENERS = ["Hi,", "Hello team,", "Dear support,", "URGENT:", "Quick question:", "Thanks for the help.", "Ugh."]
_TOPICS = ["my order #%d arrived broken", "the invoice for order #%d is wrong", "I was charged twice for #%d",
           "my password reset link for account %d does not work", "the delivery of #%d is three weeks late",
           "I want to upgrade plan %d", "can you cancel subscription %d", "the app crashes when I open ticket %d"]
_ASKS = ["and I want my money back today.", "please send a replacement.", "what are my options?",
         "this is unacceptable!", "no rush, just curious.", "can someone call me?", "thanks in advance."]


def free_port() -> int:
    """An unused TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_payloads(n: int = 512, seed: int = 0) -> list[dict]:
    """`n` deterministic request bodies: one customer-message state x the 3 example questions."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = " ".join([rng.choice(_OPENERS), rng.choice(_TOPICS) % rng.randint(1000, 99999),
                         rng.choice(_ASKS)] + [rng.choice(_ASKS) for _ in range(rng.randint(0, 3))])
        out.append({"state": text, "questions": QUESTIONS, "model": UPSTREAM_MODEL})
    return out


def replica_ports(expect: int, lo: int, hi: int, timeout: float = 120.0) -> list[int]:
    """Ports in lo..hi whose replica answers GET /ready with 200, once `expect` do (Serve hands out direct-ingress
    ports from the bottom of its range); RuntimeError naming what answered if that is not exactly `expect`."""
    import http.client
    import urllib.request

    def ready(port: int) -> bool:
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/ready" % port, timeout=2) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):  # nothing listening, or a gRPC port
            return False

    deadline = time.monotonic() + timeout
    found = [p for p in range(lo, hi + 1) if ready(p)]
    while len(found) < expect and time.monotonic() < deadline:
        time.sleep(1.0)
        found = [p for p in range(lo, hi + 1) if ready(p)]
    if len(found) != expect:
        raise RuntimeError("expected %d replica ports in %d..%d, found %s" % (expect, lo, hi, found))
    return found


# -- servers ----------------------------------------------------------------------------------------

def stop_group(proc: subprocess.Popen, steps) -> None:
    """Signal `proc`'s process group with each (signal, seconds to wait) in turn until it has exited."""
    for sig, wait in steps:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class Server:
    """A server process started in its own session (so it and its children are stopped together)."""

    name = "server"

    def __init__(self, log_path: str):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def _spawn(self, cmd: list[str], env: dict | None = None) -> None:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, path: str, timeout: float) -> float:
        """Poll `url + path` until 200; returns seconds waited (RuntimeError if the process dies)."""
        import urllib.request

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError("%s exited with %s; %s:\n%s" % (self.name, self.proc.returncode, self.log_path,
                                                                    self.log_tail()))
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError("%s not ready after %.0fs; %s:\n%s" % (self.name, timeout, self.log_path, self.log_tail()))

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log (a GPU host's run keeps only what the command prints)."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError as e:
            return "(no log: %s)" % e

    def stop(self) -> None:
        """SIGINT the process group (serve run shuts Serve and its local Ray down), then escalate."""
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_group(self.proc, ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)))
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class FleetServer(Server):
    """`serve run <config>`: this project's Ray Serve application."""

    name = "laya-fleet"

    def __init__(self, config: dict | str, log_path: str, ready_timeout: float = 300.0, address: str | None = None,
                 direct: bool = False, extra_env: dict | None = None, haproxy: bool = False,
                 keep_logs: str | None = None):
        super().__init__(log_path)
        self._tmp = None
        self.keep_logs = keep_logs  # a .tar.gz for the Serve logs' tails when stopped (`save_serve_logs`)
        if isinstance(config, str):  # a config file, run as is
            path = config
            with open(path, encoding="utf-8") as fh:
                config = yaml.safe_load(fh)
        else:
            fd, path = self._tmp = tempfile.mkstemp(prefix="laya-fleet-bench-", suffix=".yaml")
            with os.fdopen(fd, "w") as fh:
                yaml.safe_dump(config, fh, sort_keys=False)
        self.url = "http://127.0.0.1:%d" % config["http_options"]["port"]
        # the given cluster, else $RAY_ADDRESS (bench/multi_gpu.py sets it), else "local": a fresh single-node
        # Ray, never a cluster some earlier `ray start` left recorded in /tmp/ray
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        env = None
        self.balanced = haproxy  # clients go to the HTTP port (HAProxy); replicas' own ports only for /stats
        direct = direct or haproxy
        if direct:  # every Ingress replica also serves HTTP on its own port (Serve's direct ingress)
            if address != "local":
                raise ValueError("direct ingress is set when Ray starts: only with serve run's own local Ray")
            # a port range of this instance's own: a leftover Serve on the host must not take the load
            lo = 30000 + (free_port() % 400) * 50
            self._direct_range = (lo, lo + 49)
            env = dict(os.environ, RAY_SERVE_ENABLE_DIRECT_INGRESS="1",
                       RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="1",
                       RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(lo),
                       RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(lo + 49))
        if haproxy:  # Ray's HAProxy ingress on the HTTP port, as configs/prod.yaml's header says to start it
            env.update(GPU_NODE_ENV, RAY_SERVE_ENABLE_HA_PROXY="1",
                       RAY_SERVE_HAPROXY_BINARY_PATH=os.path.join(BIN, "laya-fleet-haproxy"),
                       RAY_SERVE_HAPROXY_STATS_PORT=str(free_port()), RAY_SERVE_HAPROXY_METRICS_PORT=str(free_port()))
        if extra_env:
            env = dict(env or os.environ, **extra_env)
        self._spawn([os.path.join(BIN, "serve"), "run", "--address", address, path], env)
        self.urls: list[str] = []
        try:
            self.ready_s = self.wait_ready("/ready", ready_timeout)
            if direct:
                ing = next(d for d in config["applications"][0]["deployments"] if d["name"] == "Ingress")
                # an autoscaled ingress starts at its initial (else minimum) replica count
                auto = ing.get("autoscaling_config") or {}
                n = ing.get("num_replicas") if isinstance(ing.get("num_replicas"), int) else \
                    auto.get("initial_replicas") or auto.get("min_replicas") or 1
                found = replica_ports(n, *self._direct_range)
                self.urls = ["http://127.0.0.1:%d" % p for p in found]
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.keep_logs and self.proc is not None:
            save_serve_logs(self.keep_logs)
        super().stop()
        if self._tmp and os.path.exists(self._tmp[1]):
            os.unlink(self._tmp[1])


def save_serve_logs(dest: str, tail_bytes: int = 65536, root: str | None = None) -> None:
    """The tail of each Serve log (controller, replicas, proxies, HAProxy) and of the raylet's, from the newest
    local Ray session (or the logs folder `root`), into the one gzipped tar `dest`: a GPU host's run keeps only
    what its command writes under $OUT, and only a few files of it."""
    root = root or os.path.join(tempfile.gettempdir(), "ray", "session_latest", "logs")
    names = [os.path.join("serve", n) for n in sorted(os.listdir(os.path.join(root, "serve")))] \
        if os.path.isdir(os.path.join(root, "serve")) else []
    names += [n for n in ("raylet.out", "raylet.err", "gcs_server.out") if os.path.exists(os.path.join(root, n))]
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    with tarfile.open(dest, "w:gz") as tar:
        for n in names:
            src = os.path.join(root, n)
            try:
                with open(src, "rb") as fh:
                    fh.seek(max(0, os.path.getsize(src) - tail_bytes))
                    data = fh.read()
            except OSError:
                continue
            info = tarfile.TarInfo(n.replace(os.sep, "_"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


class UpstreamServer(Server):
    """`laya-serve` (laya 0.4.15) with the same checkpoint registered as model `bench`."""

    name = "upstream laya-serve"

    def __init__(self, checkpoint: str, port: int, device: str, log_path: str, ready_timeout: float = 900.0):
        super().__init__(log_path)
        self.url = "http://127.0.0.1:%d" % port
        env = dict(os.environ, LAYA_HOST="127.0.0.1", LAYA_PORT=str(port),
                   LAYA_EXTRA_MODELS=json.dumps({UPSTREAM_MODEL: os.path.abspath(checkpoint)}),
                   LAYA_MODELS=UPSTREAM_MODEL, LAYA_PRELOAD="1", LAYA_LOG_LEVEL="warning",
                   # queue rather than refuse: its default admission cap (16) would turn load into 503s
                   LAYA_MAX_CONCURRENT="4096")
        env.pop("LAYA_API_KEY", None)
        if device != "auto":
            env["LAYA_DEVICE"] = device
        self._spawn([os.path.join(BIN, "laya-serve")], env)
        try:
            self.ready_s = self.wait_ready("/health", ready_timeout)
        except BaseException:
            self.stop()
            raise


def fleet_config(checkpoint: str, backend: str, device: str, port: int, replicas: int, ingress_replicas: int,
                 max_batch_tokens: int | None, gpus: int) -> dict:
    """configs/local.yaml pointed at `checkpoint`, with one GPU per scorer replica when `gpus` > 0."""
    with open(os.path.join(REPO, "configs", "local.yaml"), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    args = app["args"]
    args.update(checkpoint=os.path.abspath(checkpoint), backend=backend, device=device)
    args.pop("checkpoints", None)  # one checkpoint: its Scorer alone
    app["deployments"] = [d for d in app["deployments"] if not d["name"].startswith("Scorer-")]
    if gpus:
        args["scorer"] = {"num_gpus": 1, "num_cpus": 2}
        args["ingress"] = {"num_cpus": 1, "cpu_threads": 2}
    for d in app["deployments"]:
        if d["name"] == "Scorer":
            d["num_replicas"] = replicas
            d["user_config"]["max_batch_tokens"] = max_batch_tokens or (None if gpus else 8192)
        if d["name"] == "Ingress":
            d["num_replicas"] = ingress_replicas
    cfg.setdefault("logging_config", {})["log_level"] = "WARNING"
    return cfg


def shipped_config(path: str, checkpoint: str, backend: str, device: str, port: int, scratch: str,
                   replicas_per_gpu: int | None = None) -> tuple[dict, dict]:
    """A config file as shipped (configs/prod.yaml), with only what must change on this machine: the checkpoint
    of every served name, backend and device, a free loopback port, the cache dirs under `scratch` (the node-local
    one from $LAYA_FLEET_LOCAL_CACHE_DIR when set: a precompiled kernel cache), and a random bearer key in the
    variable its `api_key_env` names. `replicas_per_gpu` makes a variant that is not the file as shipped: a fused
    config's replica count per GPU (num_gpus 1/K, replica bounds K per GPU). Returns (config, extra env for
    `serve run`)."""
    import secrets

    with open(path, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    cfg.setdefault("http_options", {}).update(host="127.0.0.1", port=port)
    env: dict[str, str] = {}
    for app in cfg["applications"]:
        args = app.setdefault("args", {})
        args.update(checkpoint=os.path.abspath(checkpoint), backend=backend, device=device)
        # every other served name (scaled to zero as shipped) on the one checkpoint this machine has
        args["checkpoints"] = {name: os.path.abspath(checkpoint) for name in args.get("checkpoints") or {}}
        vars_ = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
        for k in ("LAYA_FLEET_CACHE_DIR", "LAYA_FLEET_LOCAL_CACHE_DIR"):
            if k in vars_:
                vars_[k] = os.environ.get(k) or os.path.join(scratch, k.lower())
        if replicas_per_gpu:
            sc = args.setdefault("scorer", {})
            old = max(1, round(1 / float(sc.get("num_gpus", 1) or 1)))
            sc["num_gpus"] = round(1.0 / replicas_per_gpu - 5e-5, 4)
            for d in app.get("deployments", []):
                auto = d.get("autoscaling_config")
                if isinstance(auto, dict):
                    for key in ("min_replicas", "max_replicas", "initial_replicas"):
                        if isinstance(auto.get(key), int):
                            auto[key] = auto[key] // old * replicas_per_gpu
        if args.get("api_key_env"):
            env[args["api_key_env"]] = secrets.token_hex(16)
    return cfg, env


def floor_config(port: int, ingress_replicas: int) -> dict:
    """The same topology and deployment options doing no work (bench/serve_floor_app.py)."""
    with open(os.path.join(REPO, "configs", "local.yaml"), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    cfg["http_options"]["port"] = port
    app = cfg["applications"][0]
    app["import_path"] = "bench.serve_floor_app:build_floor"
    app.pop("args", None)
    for d in app["deployments"]:
        d.pop("user_config", None)
        d["num_replicas"] = ingress_replicas if d["name"] == "Ingress" else 1
    cfg.setdefault("logging_config", {})["log_level"] = "WARNING"
    return cfg


# -- load ---------------------------------------------------------------------------------------------

async def _clients(url: str | list[str], bodies: list[bytes], clients: int, t_measure: float, t_end: float,
                   headers: dict | None, timeout: float) -> list[tuple[float, int | str, float, float]]:
    """`clients` closed loops until `t_end`; (done time, status, latency s, scorer-call s or nan) of requests started
    after `t_measure`; a 429 / 503 without Retry-After has status "503-no-Retry-After" (NO_RETRY_AFTER).

    A list of URLs (direct-ingress replicas) is spread over the clients, client k on URL k mod n."""
    import aiohttp

    urls = url if isinstance(url, list) else [url]
    records: list[tuple[float, int | str, float, float]] = []
    counter = iter(range(10 ** 12))
    hdrs = dict(headers or {}, **{"Content-Type": "application/json"})

    async def client(session, k):
        i = k * 7919
        url = urls[k % len(urls)]
        while time.monotonic() < t_end:
            body = bodies[(next(counter) + i) % len(bodies)]
            t = time.monotonic()
            infer = float("nan")
            retry_after = 0.0
            try:
                async with session.post(url, data=body, headers=hdrs) as r:
                    await r.read()
                    status = r.status
                    if "X-Inference-Time-Ms" in r.headers:  # laya-fleet: the ingress's wait for its scorer call
                        infer = float(r.headers["X-Inference-Time-Ms"]) / 1000.0
                    cap = retry_after_cap()
                    if status in (429, 503) and "Retry-After" not in r.headers:
                        status = "%d%s" % (status, NO_RETRY_AFTER)
                    elif status in (429, 503) and cap > 0:
                        try:
                            retry_after = min(float(r.headers.get("Retry-After", 0)), cap)
                        except ValueError:
                            retry_after = 0.0
            except (TimeoutError, aiohttp.ClientError):
                status = -1
            done = time.monotonic()
            if t >= t_measure:
                records.append((done, status, done - t, infer))
            if retry_after > 0:  # a well-behaved client waits as told before its next request
                await asyncio.sleep(retry_after)

    conn = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(client(session, k) for k in range(clients)))
    return records


def _client_proc(job: tuple) -> list[tuple[float, int | str, float, float]]:
    """One client process of a multi-process level: waits for the shared start time, then runs its loops."""
    url, bodies, clients, t_start, warmup, duration, headers, timeout = job
    time.sleep(max(0.0, t_start - time.monotonic()))
    return asyncio.run(_clients(url, bodies, clients, t_start + warmup, t_start + warmup + duration, headers, timeout))


async def run_level(url: str | list[str], payloads: list[dict], clients: int, duration: float, warmup: float,
                    headers: dict | None = None, timeout: float = 120.0) -> dict:
    """One closed-loop level in this process: `clients` loops for `warmup` + `duration` s."""
    bodies = [json.dumps(p).encode() for p in payloads]
    t_measure = time.monotonic() + warmup
    records = await _clients(url, bodies, clients, t_measure, t_measure + duration, headers, timeout)
    span = max(1e-9, max((r[0] for r in records), default=t_measure + duration) - t_measure)
    return summarize(records, span, clients)


def load_level(url: str | list[str], payloads: list[dict], clients: int, duration: float, warmup: float,
               headers: dict | None = None, procs: int = 1, timeout: float = 120.0) -> dict:
    """One level, its clients spread over `procs` processes (so the client side is not what limits a level)."""
    procs = max(1, min(procs, clients))
    if procs == 1:
        return asyncio.run(run_level(url, payloads, clients, duration, warmup, headers, timeout))
    import multiprocessing

    bodies = [json.dumps(p).encode() for p in payloads]
    t_start = time.monotonic() + 3.0  # every process is up and connected-ready by then
    share = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    def rotated(i):  # each process starts its clients on a different URL
        return url[i % len(url):] + url[:i % len(url)] if isinstance(url, list) else url

    jobs = [(rotated(i), bodies, n, t_start, warmup, duration, headers, timeout) for i, n in enumerate(share)]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        parts = pool.map(_client_proc, jobs)
    records = [r for part in parts for r in part]
    t_measure = t_start + warmup
    span = max(1e-9, max((r[0] for r in records), default=t_measure + duration) - t_measure)
    return summarize(records, span, clients)


# -- where the CPU goes -------------------------------------------------------------------------------

class GpuBusy:
    """Mean GPU utilisation (%, nvidia-smi's, every GPU averaged) while the `with` block runs; None without one."""

    def __enter__(self):
        import shutil

        self.busy_pct, self._proc = None, None
        if shutil.which("nvidia-smi"):
            self._proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                           "-lms", "250"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        vals = [float(v) for v in out.split() if v.replace(".", "", 1).isdigit()]
        if vals:
            self.busy_pct = round(sum(vals) / len(vals), 1)


SERVE_PROCS = {"proxy": "ray::ProxyActor", "ingress": "ray::ServeReplica:laya:Ingress",
               "scorer": "ray::ServeReplica:laya:Scorer"}


def serve_pids() -> dict[str, list[int]]:
    """PIDs of the Serve proxy, ingress replicas and scorer replicas on this machine (from /proc)."""
    out: dict[str, list[int]] = {k: [] for k in SERVE_PROCS}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as fh:
                cmd = fh.read().split(b"\0")[0].decode("utf-8", "replace")
        except OSError:
            continue
        for k, prefix in SERVE_PROCS.items():
            if cmd.startswith(prefix):
                out[k].append(int(pid))
        if os.path.basename(cmd) == "haproxy":
            out.setdefault("haproxy", []).append(int(pid))
    return out


def replica_changes(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, dict[str, list[int]]]:
    """Replica pids (ingress, scorer) that ended or began between two `serve_pids` readings, per kind."""
    out = {}
    for k in ("ingress", "scorer"):
        b, a = set(before.get(k, [])), set(after.get(k, []))
        if a != b:
            out[k] = {"gone": sorted(b - a), "new": sorted(a - b)}
    return out


def cpu_seconds(pids: dict[str, list[int]]) -> dict[int, float]:
    """User + system CPU seconds so far of each pid."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for group in pids.values():
        for pid in group:
            try:
                with open("/proc/%d/stat" % pid) as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                out[pid] = (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                pass
    return out


def cpu_share(pids: dict[str, list[int]], before: dict[int, float], after: dict[int, float],
              seconds: float) -> dict[str, float]:
    """Cores busy per process kind over `seconds` (ingress: the busiest replica and the sum)."""
    def busy(pid):
        return (after[pid] - before[pid]) / max(seconds, 1e-9)

    out = {}
    for k, group in pids.items():  # a process that ended or began during the level (HAProxy's reloads) is left out
        vals = [busy(p) for p in group if p in before and p in after]
        if vals:
            out[k] = round(max(vals), 2)
            if len(vals) > 1:
                out[k + "_sum"] = round(sum(vals), 2)
    return out


def summarize(records: list[tuple], span_s: float, clients: int) -> dict:
    """Request count, errors by status, requests/s and latency percentiles (ms) of successful requests."""
    ok = [r[2] for r in records if r[1] == 200]
    errors: dict[str, int] = {}
    for r in records:
        if r[1] != 200:
            errors[str(r[1])] = errors.get(str(r[1]), 0) + 1
    lat = np.array(ok) * 1000.0 if ok else np.zeros(1)
    out = {"clients": clients, "requests": len(records), "ok": len(ok), "errors": errors,
           "rps": round(len(ok) / span_s, 2), "p50_ms": round(float(np.percentile(lat, 50)), 2),
           "p90_ms": round(float(np.percentile(lat, 90)), 2), "p99_ms": round(float(np.percentile(lat, 99)), 2),
           "mean_ms": round(float(lat.mean()), 2), "seconds": round(span_s, 2)}
    # where a request's time went (laya-fleet only): inside the ingress's scorer call (coalescing wait, the
    # handle round trip, the scorer's queue and forward) against everything outside it (client, HTTP, ingress)
    split = np.array([(r[3], r[2] - r[3]) for r in records if r[1] == 200 and len(r) > 3 and r[3] == r[3]])
    if len(split):
        out["scorer_call_ms"] = {"mean": round(1000.0 * float(split[:, 0].mean()), 2),
                                 "p50": round(1000.0 * float(np.percentile(split[:, 0], 50)), 2)}
        out["outside_call_ms"] = {"mean": round(1000.0 * float(split[:, 1].mean()), 2),
                                  "p50": round(1000.0 * float(np.percentile(split[:, 1], 50)), 2)}
    return out


def sample_answers(url: str, payloads: list[dict], headers: dict | None = None) -> list[dict]:
    """Answers to the first payloads, one at a time (for a parity check between servers)."""
    import urllib.request

    out = []
    for p in payloads:
        req = urllib.request.Request(url, data=json.dumps(p).encode(), method="POST",
                                     headers=dict(headers or {}, **{"Content-Type": "application/json"}))
        with urllib.request.urlopen(req, timeout=120) as r:
            out.append(json.loads(r.read()))
    return out


def agreement(a: list[dict], b: list[dict]) -> dict:
    """Argmax agreement and max |dp| between two servers' answers to the same requests."""
    same = total = 0
    max_dp = 0.0
    for ra, rb in zip(a, b):
        for qid, x in ra["answers"].items():
            y = rb["answers"][qid]
            total += 1
            if x["type"] == "noul":
                same += int((x["noul"] >= 0.5) == (y["noul"] >= 0.5))
                max_dp = max(max_dp, abs(x["noul"] - y["noul"]))
                continue
            px, py = x["probabilities"], y["probabilities"]
            same += int(max(px, key=px.get) == max(py, key=py.get))
            max_dp = max([max_dp] + [abs(px[k] - py[k]) for k in px])
    return {"answers": total, "argmax_agree": same, "max_abs_dp": round(max_dp, 6)}


def scorer_stats(base: str, headers: dict | None) -> dict | None:
    """laya-fleet's `GET /stats` (one scorer replica's counters), or None where the server has none."""
    import urllib.request

    try:
        req = urllib.request.Request(base + "/stats", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


def fused_stats(urls: list[str], headers: dict | None) -> dict | None:
    """The sum of every fused replica's own scorer counters (`/stats` on each direct-ingress URL answers for
    the scorer inside that replica); None when any replica does not answer."""
    parts = [scorer_stats(u, headers) for u in urls]
    if not parts or any(p is None for p in parts):
        return None
    out = {k: sum(p.get(k, 0) for p in parts) for k in ("batches", "requests", "forward_s", "engine_s")}
    out["mean_queue_wait_ms"] = (sum(p.get("mean_queue_wait_ms", 0.0) * p["requests"] for p in parts)
                                 / max(1, out["requests"]))
    out["replicas"] = len(parts)
    locks = [p["gpu_lock"] for p in parts if p.get("gpu_lock")]  # replicas sharing a GPU take turns on it
    if locks:
        out["gpu_lock"] = {k: sum(lk[k] for lk in locks) for k in ("acquisitions", "waits", "wait_s", "held_s")}
    gcs = [p["gc"] for p in parts if "gc" in p]  # each replica's process (the fused scorer's own)
    if len(gcs) == len(parts):
        out["gc"] = {"collections": [sum(g["collections"][i] for g in gcs) for i in range(3)],
                     "seconds": [sum(g["seconds"][i] for g in gcs) for i in range(3)]}
    return out


def batching_delta(before: dict | None, after: dict | None, seconds: float) -> dict | None:
    """What the scorer did between two /stats snapshots: batches, requests per batch, forward time."""
    if not before or not after:
        return None
    batches = after["batches"] - before["batches"]
    reqs = after["requests"] - before["requests"]
    fwd = after.get("forward_s", 0.0) - before.get("forward_s", 0.0)
    eng = after.get("engine_s", 0.0) - before.get("engine_s", 0.0)
    waited = (after.get("mean_queue_wait_ms", 0.0) * after["requests"]
              - before.get("mean_queue_wait_ms", 0.0) * before["requests"])
    extra = {}
    if before.get("gpu_lock") and after.get("gpu_lock"):  # the GPU lock's holds during the level, all replicas
        b, a = before["gpu_lock"], after["gpu_lock"]
        holds = a["acquisitions"] - b["acquisitions"]
        extra = {"lock_held": round((a["held_s"] - b["held_s"]) / max(seconds, 1e-9), 3),
                 "lock_ms_per_hold": round(1000.0 * (a["held_s"] - b["held_s"]) / max(1, holds), 3),
                 "lock_wait_ms_per_hold": round(1000.0 * (a["wait_s"] - b["wait_s"]) / max(1, holds), 3)}
    if "gc" in before and "gc" in after:  # Python's collections in the replicas during the level (gc_pauses.py)
        b, a = before["gc"], after["gc"]
        extra.update(gc_collections=[a["collections"][i] - b["collections"][i] for i in range(3)],
                     gc_ms=[round(1000.0 * (a["seconds"][i] - b["seconds"][i]), 2) for i in range(3)])
    return {**extra, "batches": batches, "requests": reqs, "requests_per_batch": round(reqs / max(1, batches), 2),
            "replicas": after.get("replicas", 1),
            "forward_ms_per_batch": round(1000.0 * fwd / max(1, batches), 3),
            "forward_busy": round(fwd / max(seconds, 1e-9), 3),
            "engine_ms_per_batch": round(1000.0 * eng / max(1, batches), 3),
            "queue_wait_ms": round(waited / max(1, reqs), 3)}


def run_server(server: Server, payloads: list[dict], levels: list[int], duration: float, warmup: float,
               headers: dict | None, client_procs: int = 1, cpu: bool = False, fused: bool = False) -> list[dict]:
    """All levels against one server; prints each row as it completes (with Serve processes' CPU when `cpu`,
    and the scorer's batches and forward time where the server has `/stats`: summed over every replica's
    own scorer when `fused` with direct ingress, else whichever scorer replica answers)."""
    urls = getattr(server, "urls", None)
    if fused and urls:
        def stats(_base, hdr):
            return fused_stats(urls, hdr)
    else:
        stats = scorer_stats
    balanced = getattr(server, "balanced", False)
    url = [u + "/v1/systemone" for u in urls] if urls and not balanced else server.url + "/v1/systemone"
    rows = []
    for n in levels:
        pids = serve_pids() if cpu else {}  # per level: HAProxy's pid changes when Ray reloads its config
        procs = 1 if n < 32 else client_procs
        s0 = stats(server.url, headers)
        t0, c0 = time.monotonic(), cpu_seconds(pids)
        with GpuBusy() as gpu:
            row = load_level(url, payloads, n, duration, warmup, headers, procs)
        took = time.monotonic() - t0
        if gpu.busy_pct is not None:
            row["gpu_busy_pct"] = gpu.busy_pct
        if pids:
            row["cpu_cores"] = cpu_share(pids, c0, cpu_seconds(pids), took)
            changed = replica_changes(pids, serve_pids())
            if changed:  # a replica died or was added: the per-replica figures above miss the new ones
                row["replicas_changed"] = changed
                print("!! %d clients: replica processes changed during the level: %s" % (n, changed), flush=True)
        scorer = batching_delta(s0, stats(server.url, headers), took)
        if scorer:
            row["scorer"] = scorer
        row["client_procs"] = procs
        rows.append(row)
        print_row(server.name, row)
    return rows


def print_row(name: str, r: dict) -> None:
    """One table row on stdout."""
    err = ",".join("%s:%d" % kv for kv in sorted(r["errors"].items())) or "-"
    cpu = " ".join("%s=%.2f" % kv for kv in r.get("cpu_cores", {}).items())
    if "gpu_busy_pct" in r:
        cpu += "  gpu %.0f%%" % r["gpu_busy_pct"]
    sc = r.get("scorer")
    if sc:
        cpu += "  batch: %.1f req, forward %.2f ms (model %.2f), busy %.0f%%%s, queue %.1f ms" % (
            sc["requests_per_batch"], sc["forward_ms_per_batch"], sc["engine_ms_per_batch"],
            100 * sc["forward_busy"], " (sum of %d)" % sc["replicas"] if sc.get("replicas", 1) > 1 else "",
            sc["queue_wait_ms"])
        if "lock_held" in sc:
            cpu += ", GPU lock held %.0f%% (%.2f ms a hold, %.2f ms waited)" % (
                100 * sc["lock_held"], sc["lock_ms_per_hold"], sc["lock_wait_ms_per_hold"])
        if "gc_collections" in sc:
            cpu += ", gc2 %d (%.0f ms)" % (sc["gc_collections"][2], sc["gc_ms"][2])
    if "scorer_call_ms" in r:
        cpu += "  call/outside p50 %.1f/%.1f ms" % (r["scorer_call_ms"]["p50"], r["outside_call_ms"]["p50"])
    print("%-20s %7d %8d %9.1f %9.1f %9.1f %9.1f  %s  %s" % (name, r["clients"], r["requests"], r["rps"], r["p50_ms"],
                                                              r["p90_ms"], r["p99_ms"], err, cpu), flush=True)


def plot(results: dict[str, list[dict]], path: str, title: str) -> None:
    """Requests/s and p50/p99 latency against client count, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in results.items():
        x = [r["clients"] for r in rows]
        a1.plot(x, [r["rps"] for r in rows], "o-", label=name)
        a2.plot(x, [r["p50_ms"] for r in rows], "o-", label="%s p50" % name)
        a2.plot(x, [r["p99_ms"] for r in rows], "s--", label="%s p99" % name)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent clients (closed loop)")
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylabel("requests / s")
    a2.set_ylabel("latency (ms)")
    a2.set_yscale("log")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(checkpoint: str | None, backend: str) -> dict:
    """What ran: host, cores, torch / ray versions, GPU name, checkpoint, backend."""
    import platform

    import ray
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__,
            "gpu": gpu, "gpus": torch.cuda.device_count(), "checkpoint": checkpoint, "backend": backend,
            "request": "1 state x 3 questions (configs/example_questions.json)", "time": time.strftime("%FT%T%z"),
            # LAYA_FLEET_COMMIT first: the GPU machine's copy of the checkout can carry stale git metadata
            "commit": os.environ.get("LAYA_FLEET_COMMIT") or subprocess.run(
                ["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()}


def built_runs(args, payloads: list[dict], levels: list[int], logs: str, ingress: int, procs: int, gpus: int,
               results: dict, startup: dict, answers: dict) -> None:
    """configs/local.yaml pointed at the checkpoint (Serve's proxy): the floor, the forward skipped, then the
    service itself, as the flags ask; fills `results`, `startup` and `answers`."""
    def fleet(port: int) -> dict:
        cfg = fleet_config(args.checkpoint, args.backend, args.device, port, args.replicas, ingress,
                           args.max_batch_tokens, gpus)
        cfg["proxy_location"] = "EveryNode"
        return cfg

    runs = []
    if args.floor:
        cfg = floor_config(free_port(), ingress)
        cfg["proxy_location"] = "EveryNode"
        runs.append(("serve floor (no work)", "floor", cfg))
    if args.skip_forward:
        cfg = fleet(free_port())
        cfg["applications"][0]["args"]["backend_wrapper"] = "bench.serve_floor_app:SkipForward"
        runs.append(("laya-fleet, forward skipped", "skip", cfg))
    if not args.upstream_only:
        runs.append(("laya-fleet", "fleet", fleet(free_port())))
    for name, tag, cfg in runs:
        with FleetServer(cfg, logs + ".%s.log" % tag) as srv:
            srv.name = name
            if tag == "fleet":
                startup[name] = round(srv.ready_s, 1)
                answers[name] = sample_answers(srv.url + "/v1/systemone", payloads[:16])
            results[name] = run_server(srv, payloads, levels, args.duration, args.warmup, None, procs, cpu=True)


def config_variants(replicas_per_gpu: str | None, env_variants: list[str], rounds: int = 1,
                    deployment_variants: list[str] = ()) -> list[tuple[int | None, dict, dict, str]]:
    """The servers `config_runs` starts, in order: (replicas per GPU or None, extra cluster environment, deployment
    overrides {(deployment, field): value}, label suffix). The file as shipped, each `--config-replicas-per-gpu`
    count, each `--env-variant NAME=VALUE`, each `--deployment-variant DEPLOYMENT.FIELD=VALUE`, the whole sequence
    `rounds` times (alternated, so a host's drift falls on every variant alike)."""
    one = [(None, {}, {}, "")] + [(int(k), {}, {}, "") for k in (replicas_per_gpu or "").split(",") if k.strip()]
    for kv in env_variants:
        name, sep, value = kv.partition("=")
        if not sep or not name:
            raise SystemExit("--env-variant wants NAME=VALUE, got %r" % kv)
        one.append((None, {name: value}, {}, ", %s=%s (not as shipped)" % (name, value)))
    for kv in deployment_variants:
        key, sep, value = kv.partition("=")
        dep, dot, field = key.partition(".")
        if not sep or not dot or not dep or not field or not value:
            raise SystemExit("--deployment-variant wants DEPLOYMENT.FIELD=VALUE, got %r" % kv)
        one.append((None, {}, {(dep, field): yaml.safe_load(value)}, ", %s=%s (not as shipped)" % (key, value)))
    return [(rpg, env, over, label + (" #%d" % (r + 1) if rounds > 1 else ""))
            for r in range(rounds) for rpg, env, over, label in one]


def override_deployments(cfg: dict, overrides: dict) -> dict:
    """`cfg` with each {(deployment, field): value} set in the first application's deployments; a deployment the
    file does not name, or a field its entry does not set, stops the bench (a typo must not run the file as
    shipped under a variant's label)."""
    deps = {d.get("name"): d for d in cfg["applications"][0].get("deployments", [])}
    for (dep, field), value in overrides.items():
        if dep not in deps:
            raise SystemExit("--deployment-variant: no deployment %r in the file (it has %s)" % (dep, sorted(deps)))
        if field not in deps[dep]:
            raise SystemExit("--deployment-variant: deployment %r sets no %r (it sets %s)"
                             % (dep, field, sorted(deps[dep])))
        deps[dep][field] = value
    return cfg


def config_runs(args, payloads: list[dict], levels: list[int], logs: str, procs: int, cluster_env: dict,
                results: dict, startup: dict, answers: dict) -> None:
    """`--config` as shipped, then each `--config-replicas-per-gpu`, `--env-variant` and `--deployment-variant`
    variant, `--rounds` times; behind HAProxy, also one client on one replica's own port (what the HAProxy hop
    costs); fills `results`, `startup` and `answers`."""
    for i, (rpg, variant_env, over, label) in enumerate(config_variants(
            args.config_replicas_per_gpu, args.env_variant, args.rounds, args.deployment_variant)):
        cfg, key_env = shipped_config(args.config, args.checkpoint, args.backend, args.device, free_port(),
                                      os.path.dirname(logs), rpg)
        override_deployments(cfg, over)
        app_args = cfg["applications"][0].get("args", {})
        haproxy = {"auto": bool(app_args.get("haproxy")), "on": True, "off": False}[args.haproxy]
        direct = haproxy or any(
            (a.get("runtime_env") or {}).get("env_vars", {}).get("RAY_SERVE_ENABLE_DIRECT_INGRESS") == "1"
            for a in cfg["applications"])
        fused = app_args.get("topology") == "fused"
        hdr = {"Authorization": "Bearer " + next(iter(key_env.values()))} if key_env else None
        tag = "" if i == 0 else str(i)   # the first server's files keep the names they always had
        with FleetServer(cfg, logs + ".config%s.log" % tag, direct=direct, haproxy=haproxy,
                         extra_env=dict(key_env, **cluster_env, **variant_env),
                         keep_logs=os.path.splitext(args.out)[0] + ".serve-logs%s.tar.gz" % tag) as srv:
            srv.name = "laya-fleet (%s%s%s%s%s)" % (
                os.path.basename(args.config), ", HAProxy" if haproxy else ", direct ingress" if direct else "",
                ", %d per GPU (not as shipped)" % rpg if rpg else "",
                "".join(", %s=%s" % kv for kv in cluster_env.items()), label)
            startup[srv.name] = round(srv.ready_s, 1)
            answers[srv.name] = sample_answers(srv.url + "/v1/systemone", payloads[:16], hdr)
            results[srv.name] = run_server(srv, payloads, levels, args.duration, args.warmup, hdr, procs,
                                           cpu=True, fused=fused)
            if haproxy and srv.urls and 1 in levels:
                own = Server("")
                own.name, own.url = srv.name + " [one replica's own port]", srv.urls[0]
                results[own.name] = run_server(own, payloads, [1], args.duration, args.warmup, hdr)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (1 if any request failed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running laya-fleet base URL (skips starting one)")
    p.add_argument("--checkpoint", default=os.path.join(REPO, "checkpoints", "tiny"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--config", default=None,
                   help="run this Serve config file as shipped (e.g. configs/prod.yaml): only checkpoint, backend, "
                        "device, port, cache dirs and the bearer key are set for this machine")
    p.add_argument("--haproxy", default="auto", choices=("auto", "on", "off"),
                   help="with --config: start Ray with HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1 and the "
                        "laya-fleet-haproxy launcher) and send the load to its port; auto = when the config's args "
                        "say `haproxy: true`")
    p.add_argument("--config-replicas-per-gpu", default=None,
                   help="with --config: also run variants of the file with K fused replicas per GPU (a list; "
                        "labelled 'not as shipped'), after the file as shipped")
    p.add_argument("--env-variant", action="append", default=[], metavar="NAME=VALUE",
                   help="with --config: after the file as shipped, the same file with this variable also set in "
                        "the cluster environment (one server per variant, in the same run)")
    p.add_argument("--deployment-variant", action="append", default=[], metavar="DEPLOYMENT.FIELD=VALUE",
                   help="with --config: after the file as shipped, the same file with one field of one deployment "
                        "changed (e.g. Ingress.max_queued_requests=48; the field must be one the file sets)")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --config: start the shipped file and its variants this many times, alternated")
    p.add_argument("--cluster-env", action="append", default=[], metavar="NAME=VALUE",
                   help="with --config: a variable for the cluster's environment (`serve run`'s, so Ray's processes "
                        "and HAProxy see it), e.g. RAY_SERVE_HAPROXY_NBTHREAD=1; repeatable; named in the row")
    p.add_argument("--replicas", type=int, default=1,
                   help="without --config: scorer replicas (one GPU each when CUDA is visible)")
    p.add_argument("--ingress-replicas", type=int, default=None,
                   help="without --config: ingress replicas (default: 1 below 8 cores, else cores / 4)")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="without --config: the scorer's budget (default: 8192 on CPU, measured on GPU)")
    p.add_argument("--floor", action="store_true",
                   help="without --config: first run the same topology doing no work (bench/serve_floor_app.py)")
    p.add_argument("--skip-forward", action="store_true",
                   help="without --config: also run laya-fleet with the forward replaced by zeros "
                        "(bench/serve_floor_app.SkipForward): the request path without the model")
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes for levels of 32+ clients (default: 1 below 8 cores, else 4)")
    p.add_argument("--no-retry-after", action="store_true",
                   help="clients retry a 503 at once instead of waiting its Retry-After (capped at %gs)"
                        % RETRY_AFTER_CAP_S)
    p.add_argument("--compare-upstream", action="store_true", help="also run upstream laya-serve (after ours)")
    p.add_argument("--upstream-levels", default=None,
                   help="upstream's levels (default: --levels; its one process answers ~25 req/s, so 512 clients "
                        "there means minutes of queue per level)")
    p.add_argument("--upstream-only", action="store_true", help="run only upstream laya-serve")
    p.add_argument("--levels", default="1,2,4,8,16,32,64,128,256,512")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each level")
    p.add_argument("--api-key-env", default=None, help="env var holding a bearer key for --url")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "serve_cpu.json"))
    args = p.parse_args(argv)
    # `timeout` / a job runner sends SIGTERM: unwind so every server started here is stopped (their process
    # groups outlive this one otherwise, holding the GPU and ports)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1, got %d" % args.rounds)
    if not args.config and (args.env_variant or args.rounds > 1 or args.config_replicas_per_gpu
                            or args.deployment_variant):
        raise SystemExit("--env-variant, --deployment-variant, --rounds and --config-replicas-per-gpu vary a "
                         "--config file: give one")
    # a bad variant stops it here, before any server starts
    for _rpg, _env, over, _label in config_variants(args.config_replicas_per_gpu, args.env_variant, args.rounds,
                                                    args.deployment_variant):
        if over:
            with open(args.config, encoding="utf-8") as fh:
                override_deployments(yaml.safe_load(fh), over)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    upstream_levels = [int(x) for x in (args.upstream_levels or args.levels).split(",") if x.strip()]
    cluster_env = dict(kv.split("=", 1) for kv in args.cluster_env)
    if args.no_retry_after:  # the spawned client processes read it from the environment
        os.environ["LAYA_FLEET_BENCH_RETRY_AFTER_CAP_S"] = "0"
    payloads = make_payloads()
    headers = {"Authorization": "Bearer " + os.environ[args.api_key_env]} if args.api_key_env else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = os.path.splitext(args.out)[0]
    logs = os.path.join(tempfile.gettempdir(), "laya-fleet-bench", os.path.basename(base))
    os.makedirs(os.path.dirname(logs), exist_ok=True)
    import torch

    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    cores = os.cpu_count() or 2
    ingress = args.ingress_replicas or (1 if cores < 8 else cores // 4)
    procs = args.client_procs or (1 if cores < 8 else 4)
    results: dict[str, list[dict]] = {}
    startup: dict[str, float] = {}
    answers: dict[str, list[dict]] = {}
    print("%-20s %7s %8s %9s %9s %9s %9s  %s" % ("server", "clients", "requests", "req/s", "p50 ms", "p90 ms",
                                                   "p99 ms", "errors"))
    if args.config and not (args.url or args.upstream_only):
        config_runs(args, payloads, levels, logs, procs, cluster_env, results, startup, answers)
    elif not (args.url or args.config):
        built_runs(args, payloads, levels, logs, ingress, procs, gpus, results, startup, answers)
    if args.url and not args.upstream_only:
        srv = Server("")
        srv.name, srv.url = "laya-fleet", args.url.rstrip("/")
        answers[srv.name] = sample_answers(srv.url + "/v1/systemone", payloads[:16], headers)
        results[srv.name] = run_server(srv, payloads, levels, args.duration, args.warmup, headers, procs)
    if args.compare_upstream or args.upstream_only:
        with UpstreamServer(args.checkpoint, free_port(), args.device, logs + ".upstream.log") as srv:
            startup[srv.name] = round(srv.ready_s, 1)
            answers[srv.name] = sample_answers(srv.url + "/v1/systemone", payloads[:16])
            results[srv.name] = run_server(srv, payloads, upstream_levels, args.duration, args.warmup, None, procs)
    out: dict[str, Any] = {"env": environment(args.checkpoint, args.backend),
                           "settings": {"levels": levels, "duration_s": args.duration, "warmup_s": args.warmup,
                                        "replicas": args.replicas, "ingress_replicas": ingress,
                                        "client_procs": procs, "max_batch_tokens": args.max_batch_tokens,
                                        "url": args.url, "config": args.config, "upstream_levels": upstream_levels,
                                        "retry_after_cap_s": retry_after_cap()},
                           "startup_s": startup, "results": results}
    names = list(answers)
    if len(names) >= 2:  # ours (the first) against upstream (the last)
        names = [names[0], names[-1]]
        out["agreement"] = agreement(answers[names[0]], answers[names[1]])
        print("agreement %s vs %s: %s" % (names[0], names[1], out["agreement"]))
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    title = "%s, %s, %s" % (os.path.basename(os.path.abspath(args.checkpoint)),
                            out["env"]["gpu"] or "CPU x%d" % (os.cpu_count() or 0), args.backend)
    plot(results, base + ".png", title)
    print("wrote %s and %s" % (args.out, base + ".png"))
    failed = sum(sum(r["errors"].values()) for rows in results.values() for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
