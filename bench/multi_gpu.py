"""The shipped fleet on N GPUs of one host: configs/prod.yaml behind HAProxy, its autoscaling, and the offline job.

One Ray cluster started here (`ray start --head`, all GPUs, or `--logical-gpus N` on a CPU machine to rehearse),
with the cluster environment configs/prod.yaml's header asks for: RAY_SERVE_ENABLE_HA_PROXY=1,
RAY_SERVE_HAPROXY_BINARY_PATH=laya-fleet-haproxy, one polling HAProxy thread (LAYA_FLEET_HAPROXY_BUSY_POLLING=1,
RAY_SERVE_HAPROXY_NBTHREAD=1: a busy core, also in a CPU rehearsal), the bearer key, and ports of this run's own
(HAProxy's stats and metrics, Serve's fallback proxy, the direct-ingress ranges) so nothing collides with another
Serve on the host.
Ray's own ports are on loopback (--node-ip-address 127.0.0.1, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0).

1. Serve: `serve run --address <cluster> <prod.yaml>` as shipped except what must change on this machine
   (bench/serve_load.py `shipped_config`: checkpoint paths, backend/device, port, cache dirs, bearer key), with an
   empty shared compile cache (LAYA_FLEET_CACHE_DIR) and a fresh node-local one. The first replicas (min_replicas)
   compile and publish; the ones the ramp adds seed from the shared cache. Every replica's pid, Ray GPU id,
   CUDA_VISIBLE_DEVICES, load / warm-up / ready seconds and cache report (seeded / published), beside
   `nvidia-smi --query-compute-apps` on a GPU host.
2. Autoscaling min -> max -> min under closed-loop clients that rise and fall: one GPU's replicas (min_replicas)
   at `--clients` per replica, a rise at `--ramp-clients` per replica until max_replicas run, all of them at
   `--clients` per replica, then a fall until min_replicas again. The Ingress's upscale/downscale delays and
   look-back are shortened for the benchmark (and Ray's autoscaling metric push interval with them); max_replicas
   becomes replicas-per-GPU x N as its comment says; everything else as shipped. The output says which.
   Checks: replicas spread per_gpu to each of the N GPUs, requests/s at max >= 0.9 x N x at min, p99 <= 100 ms at
   both, no failed request (503 + Retry-After from admission counted apart) during the scale-down or anywhere.
3. Offline: `python -m serve_app.offline` (as the README runs it, against this cluster) with 1 GPU actor, then N
   (tokens/s after start-up >= 0.9 x N x one), then N with one scorer actor's process SIGKILLed mid-run: every row
   back exactly once, the same ids as the clean run.

Prints a table, writes JSON to --out and a PNG beside it. Throughput and latency checks are judged only on real
GPUs; with --logical-gpus they are printed, not judged. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set in every process Ray starts.

Rehearsal on the 2-core CPU machine (tiny checkpoint, CPU forward; 6 to 9 minutes there):

    .venv/bin/python bench/multi_gpu.py --checkpoint checkpoints/tiny --logical-gpus 2 --clients 4 --duration 8 \\
        --rows 600 --out /tmp/multi_gpu_rehearsal.json

On an N-GPU host, after `. bench/gpu_env.sh`, two calls (each fits 10 minutes):

    python3 -m model.cli make-checkpoint --shape modernbert-large --out /tmp/ck_large
    python3 bench/multi_gpu.py --checkpoint /tmp/ck_large --parts serve --out $OUT/multi_gpu_h200x2_serve.json
    python3 bench/multi_gpu.py --checkpoint /tmp/ck_large --parts offline --rows 20000 \\
        --local-cache "$LAYA_FLEET_LOCAL_CACHE_DIR" --out $OUT/multi_gpu_h200x2_offline.json

The serve part's node-local compile dir is a fresh one by default, so its first replicas really compile; the
offline part may take the precompiled kernels gpu_env.sh unpacks (its start-up is reported apart from tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

NV_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NV_ENV)
# a private single-host cluster: token auth (on whenever ~/.ray/auth_token exists) only gets in the way
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# loopback for Ray's addresses in this process and its children too (as the Makefile's LOCAL_RAY_ENV), so they
# reach the cluster started on 127.0.0.1 rather than the host's own address
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# no Ray started behind this process's back: a Serve handle's metrics thread outliving ray.shutdown() would
# otherwise auto-start a local instance
os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
sys.path[:0] = [HERE, REPO]

from offline import make_data  # noqa: E402
from serve_load import GpuBusy, Server, free_port, make_payloads, shipped_config, stop_group  # noqa: E402

from serve_app.online.haproxy_launcher import GPU_NODE_ENV  # noqa: E402

QUESTIONS = os.path.join(REPO, "configs", "example_questions.json")
PROD = os.path.join(REPO, "configs", "prod.yaml")
APP, INGRESS = "laya", "Ingress"
# Ray's default autoscaling metric push interval is 10 s, right for prod.yaml's 30 s look-back; the
# benchmark's shorter look-back needs fresher metrics
METRIC_PUSH_S = "1"
RETRY_AFTER_CAP_S = 2.0  # a refused client waits Retry-After (capped) before its next request, as serve_load's do


def log(msg: str) -> None:
    """A timestamped progress line on stdout."""
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


# -- the cluster ------------------------------------------------------------------------------------

def port_block(n: int) -> int:
    """The first of `n` consecutive ports free now, in 20000..29000 (below Linux's ephemeral range and above
    Ray's worker ports, so nothing random lands there)."""
    import socket

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    starts = range(20000, 29000 - n, n)
    for first in random.Random().sample(starts, min(100, len(starts))):
        if all(free(p) for p in range(first, first + n)):
            return first
    raise RuntimeError("no %d free consecutive ports in 20000..29000" % n)


def cluster_env(key_env: dict[str, str], direct: int) -> tuple[dict[str, str], dict[str, int]]:
    """The cluster's environment (prod.yaml's header) with ports of this run's own; returns (env, ports)."""
    lo = port_block(2 * direct)
    ports = {k: free_port() for k in ("haproxy_stats", "haproxy_metrics", "fallback_http", "fallback_grpc")}
    ports.update(direct_http_lo=lo, direct_http_hi=lo + direct - 1)
    env = dict(NV_ENV, **key_env, **GPU_NODE_ENV,
               RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_HAPROXY_BINARY_PATH=os.path.join(BIN, "laya-fleet-haproxy"),
               RAY_SERVE_HAPROXY_STATS_PORT=str(ports["haproxy_stats"]),
               RAY_SERVE_HAPROXY_METRICS_PORT=str(ports["haproxy_metrics"]),
               RAY_SERVE_FALLBACK_PROXY_HTTP_PORT=str(ports["fallback_http"]),
               RAY_SERVE_FALLBACK_PROXY_GRPC_PORT=str(ports["fallback_grpc"]),
               RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(lo),
               RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(lo + direct - 1),
               RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=str(lo + direct),
               RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=str(lo + 2 * direct - 1),
               RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S=METRIC_PUSH_S,
               RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S=METRIC_PUSH_S,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    return env, ports


def start_cluster(args, env: dict, tmp: str) -> tuple[subprocess.Popen, str, int]:
    """`ray start --head --block` on loopback and free ports, in its own process group, with `env`;
    returns (proc, address, GPUs)."""
    port = free_port()
    cmd = [os.path.join(BIN, "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(port), "--include-dashboard", "false", "--dashboard-port", str(free_port()),
           "--disable-usage-stats",
           "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port()),
           "--dashboard-agent-grpc-port", str(free_port()), "--metrics-export-port", str(free_port()),
           "--runtime-env-agent-port", str(free_port()), "--temp-dir", os.path.join(tmp, "ray")]
    if args.logical_gpus is not None:
        # 3 Ingress replicas per GPU asking 3 CPUs each (scorer 2 + ingress 1, as shipped), and a few more CPUs
        # for the offline job's stages
        cmd += ["--num-gpus", str(args.logical_gpus), "--num-cpus", str(9 * args.logical_gpus + 6),
                "--object-store-memory", str(1 << 30)]
    proc = subprocess.Popen(cmd, stdout=open(os.path.join(tmp, "ray.log"), "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, **env), start_new_session=True)
    address = "127.0.0.1:%d" % port
    import ray

    for _ in range(120):
        if proc.poll() is not None:
            raise RuntimeError("ray start exited with %s; see %s" % (proc.returncode, os.path.join(tmp, "ray.log")))
        try:
            ray.init(address=address, log_to_driver=False)
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    else:
        raise RuntimeError("could not connect to the cluster at %s; see %s" % (address, os.path.join(tmp, "ray.log")))
    import logging
    import warnings

    import ray.serve  # noqa: F401 - its import configures Serve's logger, quieted next

    # this process only reads replica info through a handle: its router's per-call warnings are noise here
    logging.getLogger("ray.serve").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*look_back_period_s.*metrics_interval_s", category=FutureWarning)
    return proc, address, int(ray.cluster_resources().get("GPU", 0))


def reap(marker: str) -> int:
    """SIGKILL what is left of this run's cluster (Ray workers start their own process groups): the processes
    whose environment holds `marker`, this run's own shared-cache variable; returns how many."""
    env = marker.encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/%s/environ" % pid, "rb") as fh:
                if env in fh.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            continue
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return len(pids)


# -- Serve ------------------------------------------------------------------------------------------

def bench_config(args, n: int, port: int, tmp: str) -> tuple[dict, list[str], dict]:
    """prod.yaml as shipped (serve_load's `shipped_config`; the bearer key it draws is replaced by the one in the
    cluster's environment) with this run's cache dirs, the Ingress's max at per_gpu x n and its timing shortened;
    returns (config, what differs from the file, the Ingress's bounds)."""
    cfg, _ = shipped_config(PROD, args.checkpoint, args.backend, args.device, port, tmp)
    app = cfg["applications"][0]
    app["runtime_env"]["env_vars"].update(LAYA_FLEET_CACHE_DIR=args.shared_cache,
                                          LAYA_FLEET_LOCAL_CACHE_DIR=args.local_cache)
    per_gpu = max(1, round(1.0 / float(app["args"]["scorer"]["num_gpus"])))
    ing = next(d for d in app["deployments"] if d["name"] == INGRESS)
    auto = ing["autoscaling_config"]
    notes = ["checkpoint, backend %s, device %s, port, cache dirs, bearer key: set for this machine" % (
        args.backend, args.device)]
    notes.append("max_replicas %s -> %d (= %d per GPU x %d GPUs, as its comment says)" % (
        auto["max_replicas"], per_gpu * n, per_gpu, n))
    auto["max_replicas"] = per_gpu * n
    timing = {"upscale_delay_s": args.upscale_delay, "downscale_delay_s": args.downscale_delay,
              "look_back_period_s": args.look_back}
    notes.append("benchmark timing, not as shipped: %s; Ray's autoscaling metric push interval 10 s -> %s s" % (
        ", ".join("%s %s -> %g" % (k, auto.get(k), v) for k, v in timing.items()), METRIC_PUSH_S))
    auto.update(timing)
    return cfg, notes, {"min": auto["min_replicas"], "max": auto["max_replicas"], "per_gpu": per_gpu,
                        "target_ongoing_requests": auto["target_ongoing_requests"]}


class ClusterServe(Server):
    """`serve run --address <cluster> <config>`: the app deployed on the cluster started here (Ctrl-C, here
    SIGINT, makes `serve run` shut Serve down; the cluster stays)."""

    name = "serve run"

    def __init__(self, config: dict, address: str, env: dict, log_path: str, ready_timeout: float):
        import yaml

        super().__init__(log_path)
        fd, self._path = tempfile.mkstemp(prefix="laya-fleet-multi-gpu-", suffix=".yaml")
        with os.fdopen(fd, "w") as fh:
            yaml.safe_dump(config, fh, sort_keys=False)
        self.url = "http://127.0.0.1:%d" % config["http_options"]["port"]
        t0 = time.monotonic()
        self._spawn([os.path.join(BIN, "serve"), "run", "--address", address, self._path], dict(os.environ, **env))
        try:
            self.wait_ready("/ready", ready_timeout)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0

    def stop(self) -> None:
        super().stop()
        if os.path.exists(self._path):
            os.unlink(self._path)


def replica_states() -> dict[str, int]:
    """The Ingress's replica states, e.g. {"RUNNING": 3, "STARTING": 1}; {} when Serve does not answer."""
    from ray import serve

    try:
        st = serve.status().applications.get(APP)
    except Exception:  # noqa: BLE001 - controller busy or restarting
        return {}
    dep = st.deployments.get(INGRESS) if st else None
    return {str(getattr(k, "value", k)): v for k, v in dep.replica_states.items()} if dep else {}


def replica_infos(h, expect: int, t0_wall: float) -> list[dict]:
    """`info()` of every Ingress replica through handle `h` (rounds of concurrent calls, so the router spreads
    them, fewer than the handle queues before refusing; by pid), with its actor's start in seconds after `t0_wall`."""
    import ray._private.state as ray_state

    seen: dict[int, dict] = {}
    for _ in range(10 + 3 * expect):
        for r in [h.info.remote() for _ in range(min(8, 2 * expect))]:
            try:
                i = r.result(timeout_s=60)
            except Exception:  # noqa: BLE001 - a replica refusing (saturated) or stopping
                continue
            cache = i.get("cache") or {}
            seen[i["pid"]] = {
                "pid": i["pid"], "gpu_ids": i.get("gpu_ids") or [],
                "cuda_visible_devices": i.get("cuda_visible_devices"),
                "device": i.get("device"), "backend": i.get("backend"), "load_s": i.get("load_s"),
                "warmup_s": (i.get("startup") or {}).get("warmup_s"), "ready_s": i.get("ready_s"),
                "requests": (i.get("batching") or {}).get("requests"),
                "seeded": {k: v.get("state") for k, v in (cache.get("seeded") or {}).items()},
                "published": dict(cache.get("published") or {})}
        if len(seen) >= expect:
            break
    started = {a["Pid"]: a["StartTime"] / 1000.0 for a in ray_state.actors().values() if a.get("StartTime")}
    for r in seen.values():
        r["started_s"] = round(started[r["pid"]] - t0_wall, 1) if r["pid"] in started else None
    return sorted(seen.values(), key=lambda r: (r["gpu_ids"], r["pid"]))


def gpu_processes() -> dict | None:
    """`nvidia-smi`'s GPUs (index -> uuid) and compute processes (pid, GPU index, MiB); None without nvidia-smi."""
    if not shutil.which("nvidia-smi"):
        return None

    def query(what: str) -> list[list[str]]:
        out = subprocess.run(["nvidia-smi", "--query-%s" % what, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]

    try:
        index = {uuid: idx for idx, uuid in query("gpu=index,uuid")}
        apps = [{"pid": int(pid), "gpu": index.get(uuid, uuid), "used_mib": mem}
                for pid, uuid, mem in query("compute-apps=pid,gpu_uuid,used_memory")]
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    return {"gpus": {v: k for k, v in index.items()}, "apps": apps}


def haproxy_up(stats_port: int) -> int | None:
    """Replica servers HAProxy has UP in the app's backend (its stats page as CSV), or None if it does not answer."""
    import csv
    import io
    import urllib.request

    try:
        with urllib.request.urlopen("http://127.0.0.1:%d/stats;csv" % stats_port, timeout=5) as r:
            rows = csv.DictReader(io.StringIO(r.read().decode().lstrip("# ")))
            return sum(1 for x in rows if x["pxname"] == "http-" + APP and x["svname"] not in ("FRONTEND", "BACKEND")
                       and x.get("bck") != "1" and x["status"] == "UP")
    except (OSError, ValueError, KeyError):
        return None


# -- load -------------------------------------------------------------------------------------------

def _load_worker(i: int, procs: int, url: str, bodies: list[bytes], headers: dict, slots: int, total, out) -> None:
    """One client process: `slots` closed-loop clients, of which this process's share of `total.value` run
    (a negative value stops them); puts its records (sent, done, status, Retry-After given) on `out`."""
    import aiohttp
    import numpy as np

    recs: list[tuple[float, float, int, int]] = []

    def share() -> int:
        n = total.value
        return -1 if n < 0 else n // procs + (1 if i < n % procs else 0)

    async def client(session, k: int) -> None:
        j = k * 7919 + i
        while (s := share()) >= 0:
            if k >= s:  # an idle slot: a quarter of a second to notice a rise (cheap for hundreds of slots)
                await asyncio.sleep(0.25)
                continue
            j += 1
            t, status, wait = time.monotonic(), -1, None
            try:
                async with session.post(url, data=bodies[j % len(bodies)], headers=headers) as r:
                    await r.read()
                    status, wait = r.status, r.headers.get("Retry-After")
            except (TimeoutError, aiohttp.ClientError):
                pass
            recs.append((t, time.monotonic(), status, int(wait is not None)))
            if status in (429, 503) and wait:
                try:
                    await asyncio.sleep(min(float(wait), RETRY_AFTER_CAP_S))
                except ValueError:
                    pass

    async def run() -> None:
        conn = aiohttp.TCPConnector(limit=slots, limit_per_host=slots)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
            await asyncio.gather(*(client(session, k) for k in range(slots)))

    asyncio.run(run())
    out.put((i, np.array(recs, dtype=np.float64).reshape(-1, 4)))


class Load:
    """Closed-loop clients over `procs` processes whose total count can be changed while they run (`set`);
    `timeline` samples (time, clients, the Ingress's replica states) about once a second."""

    def __init__(self, url: str, bodies: list[bytes], headers: dict, procs: int, most: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.total = ctx.Value("i", 0, lock=False)
        self.out = ctx.Queue()
        self.procs = [ctx.Process(target=_load_worker, daemon=True,
                                  args=(i, procs, url, bodies, headers, -(-most // procs), self.total, self.out))
                      for i in range(procs)]
        for p in self.procs:
            p.start()
        self.clients = 0
        self.timeline: list[tuple[float, int, dict]] = []

    def set(self, clients: int) -> None:
        self.clients = self.total.value = clients

    def sample(self) -> dict[str, int]:
        st = replica_states()
        self.timeline.append((time.monotonic(), self.clients, st))
        return st

    def hold(self, seconds: float, until=None) -> bool:
        """Sample for `seconds`, or (with `until`) until `until(states)` holds (True) or `seconds` pass (False)."""
        end = time.monotonic() + seconds
        while True:
            st = self.sample()
            if until is not None and until(st):
                return True
            if time.monotonic() >= end:
                return until is None
            time.sleep(min(1.0, max(0.0, end - time.monotonic())))

    def stop(self):
        """Stop every client (those in flight finish); returns all records as one array."""
        import numpy as np

        self.total.value = -1
        parts = [self.out.get(timeout=300)[1] for _ in self.procs]
        for p in self.procs:
            p.join(30)
        return np.concatenate(parts) if parts else np.zeros((0, 4))


def window(rec, a: float, b: float, clients: int | None = None) -> dict:
    """Requests answered in [a, b]: requests/s of the 200s, their p50/p99, 503s with Retry-After (admission),
    failures (anything else: other statuses, transport errors) by status."""
    import numpy as np

    r = rec[(rec[:, 1] >= a) & (rec[:, 1] <= b)]
    ok = r[r[:, 2] == 200]
    refused = (np.isin(r[:, 2], (429, 503))) & (r[:, 3] == 1)
    bad = r[(r[:, 2] != 200) & ~refused]
    lat = 1000.0 * (ok[:, 1] - ok[:, 0]) if len(ok) else np.zeros(1)
    fails: dict[str, int] = {}
    for s in bad[:, 2].astype(int):
        fails[str(s)] = fails.get(str(s), 0) + 1
    return {"clients": clients, "seconds": round(b - a, 1), "requests": int(len(r)), "ok": int(len(ok)),
            "rps": round(len(ok) / max(1e-9, b - a), 1), "p50_ms": round(float(np.percentile(lat, 50)), 1),
            "p99_ms": round(float(np.percentile(lat, 99)), 1), "refused_503": int(refused.sum()),
            "failed": int(len(bad)), "failures": fails}


def per_second(rec, t0: float, timeline: list) -> list[dict]:
    """The run second by second from `t0`: clients and running replicas (the last sample in that second), 200s,
    503s + Retry-After and failures answered in it, p99 of its 200s."""
    import bisect

    import numpy as np

    if not len(rec):
        return []
    times = [x[0] for x in timeline]
    out = []
    for s in range(int(rec[:, 1].max() - t0) + 1):
        a = t0 + s
        i = bisect.bisect_right(times, a + 1) - 1
        clients, st = (timeline[i][1], timeline[i][2]) if i >= 0 else (0, {})
        r = rec[(rec[:, 1] >= a) & (rec[:, 1] < a + 1)]
        lat = 1000.0 * (r[r[:, 2] == 200, 1] - r[r[:, 2] == 200, 0])
        refused = np.isin(r[:, 2], (429, 503)) & (r[:, 3] == 1)
        out.append({"t": s, "clients": clients, "running": st.get("RUNNING", 0), "ok": int(len(lat)),
                    "refused": int(refused.sum()), "failed": int(((r[:, 2] != 200) & ~refused).sum()),
                    "p99_ms": round(float(np.percentile(lat, 99)), 1) if len(lat) else None})
    return out


def payloads(states: int) -> list[dict]:
    """Request bodies: 1 state x 3 questions (serve_load's, /v1/systemone), or `states` of them per request."""
    small = make_payloads(512)
    if states <= 1:
        return small
    return [{"states": [small[(i * states + j) % len(small)]["state"] for j in range(states)],
             "questions": small[0]["questions"], "model": small[0]["model"]} for i in range(128)]


def part_serve(args, n: int, address: str, env: dict, ports: dict, key: str, tmp: str) -> dict:
    """Parts 1 and 2: the shipped config served, its replicas and caches, the ramp min -> max -> min."""
    cfg, notes, b = bench_config(args, n, free_port(), tmp)
    lo, hi, per_gpu = b["min"], b["max"], b["per_gpu"]
    res: dict = {"notes": notes, "bounds": b}
    for line in notes:
        log("config: " + line)
    t_start, t_wall = time.monotonic(), time.time()
    log("serve run %s (%d..%d Ingress replicas, %d per GPU), empty shared cache" % (PROD, lo, hi, per_gpu))
    with ClusterServe(cfg, address, env, os.path.join(tmp, "serve.log"), args.ready_timeout) as srv:
        from ray import serve

        res["ready_s"] = round(srv.ready_s, 1)
        handle = serve.get_deployment_handle(INGRESS, app_name=APP)
        load = Load(srv.url + ("/v1/systemone" if args.states <= 1 else "/v1/systemone/batch"),
                    [json.dumps(p).encode() for p in payloads(args.states)],
                    {"Authorization": "Bearer " + key, "Content-Type": "application/json"}, args.client_procs,
                    max(args.clients, args.ramp_clients) * hi)
        try:
            ok = load.hold(args.ready_timeout, lambda st: st.get("RUNNING", 0) >= lo and len(st) == 1)
            res["min_running_s"] = round(time.monotonic() - t_start, 1)
            log("%d replicas running after %.1f s (/ready after %.1f s)" % (lo, res["min_running_s"], res["ready_s"]))
            first = replica_infos(handle, lo, t_wall) if ok else []
            phases: list[dict] = []

            def measure(name: str, clients: int) -> None:
                load.set(clients)
                load.hold(args.warmup)
                with GpuBusy() as gpu:
                    a, st0 = time.monotonic(), load.sample()
                    load.hold(args.duration)
                    b_, st1 = time.monotonic(), load.sample()
                phases.append({"phase": name, "a": a, "b": b_, "clients": clients, "gpu_busy_pct": gpu.busy_pct,
                               "running": [st0.get("RUNNING", 0), st1.get("RUNNING", 0)]})
                log("%s: %d clients, %s -> %s replicas" % (name, clients, st0, st1))

            measure("one GPU (min replicas)", args.clients * lo)
            t_rise = time.monotonic()
            k = 1
            while k < n:  # the load rises: the replicas double each step (the autoscaler's reach from a step)
                k = min(n, 2 * k)
                clients = args.ramp_clients * per_gpu * k
                load.set(clients)
                a, st0 = time.monotonic(), load.timeline[-1][2]
                load.hold(args.scale_timeout, lambda st, want=min(hi, per_gpu * k): st.get("RUNNING", 0) >= want
                          and not st.get("STARTING"))
                phases.append({"phase": "rise to %d GPUs" % k, "a": a, "b": time.monotonic(), "clients": clients,
                               "running": [st0.get("RUNNING", 0), load.timeline[-1][2].get("RUNNING", 0)]})
                log("rise: %d clients, %s after %.1f s" % (clients, load.timeline[-1][2], time.monotonic() - a))
            res["scale_up_s"] = round(time.monotonic() - t_rise, 1)
            load.set(args.clients * hi)
            res["replicas"] = replica_infos(handle, hi, t_wall)
            res["nvidia_smi"] = gpu_processes()
            up = None  # HAProxy adds a replica once its health check passes: a few seconds after RUNNING
            for _ in range(30):
                if (up := haproxy_up(ports["haproxy_stats"])) == hi:
                    break
                load.hold(1.0)
            res["haproxy_servers_up"] = up
            measure("%d GPUs (max replicas)" % n, args.clients * hi)
            after = {r["pid"]: r["requests"] for r in replica_infos(handle, hi, t_wall)}
            for r in res["replicas"]:  # requests each replica scored while all of them ran (HAProxy's spread)
                r["requests_at_max"] = after[r["pid"]] - (r["requests"] or 0) if after.get(r["pid"]) else None
            t_fall, st0 = time.monotonic(), load.timeline[-1][2]
            while k > 1:  # the load falls: half the GPUs' worth each step, the last held until min_replicas
                k //= 2
                load.set(args.clients * per_gpu * k)
                if k > 1:
                    load.hold(args.downscale_delay + 15)
            load.set(args.clients * lo)
            res["scaled_down"] = load.hold(args.scale_timeout, lambda st: st.get("RUNNING", 0) == lo and len(st) == 1)
            load.hold(3)
            phases.append({"phase": "fall to min (scale-down)", "a": t_fall, "b": time.monotonic(),
                           "clients": args.clients * lo,
                           "running": [st0.get("RUNNING", 0), load.timeline[-1][2].get("RUNNING", 0)]})
            res["scale_down_s"] = round(time.monotonic() - t_fall, 1)
            res["final_states"] = load.timeline[-1][2]
            log("fall: %s after %.1f s" % (load.timeline[-1][2], res["scale_down_s"]))
        finally:
            load.set(0)
            rec = load.stop()
            handle.shutdown()  # its router's metrics thread would outlive ray.shutdown() otherwise
    initial = {r["pid"] for r in first}
    for r in first + res.get("replicas", []):
        r["wave"] = "first (empty shared cache)" if r["pid"] in initial else "added by the ramp"
    res["first_replicas"] = first
    for p in phases:
        p.update(window(rec, p.pop("a"), p.pop("b"), p["clients"]))
    res["phases"] = phases
    res["whole_run"] = window(rec, float(rec[:, 1].min()), float(rec[:, 1].max())) if len(rec) else window(rec, 0, 1)
    res["timeline"] = per_second(rec, t_start, load.timeline)
    res["checks"] = serve_checks(res, n, per_gpu, lo, hi)
    return res


def serve_checks(res: dict, n: int, per_gpu: int, lo: int, hi: int) -> dict:
    """{check: (value, passed or None when only reported, judged only on real GPUs)}."""
    one, top, fall = res["phases"][0], res["phases"][-2], res["phases"][-1]
    per: dict[str, int] = {}
    for r in res.get("replicas", []):
        g = ",".join(r["gpu_ids"]) or "-"
        per[g] = per.get(g, 0) + 1
    out = {"replicas at max": (len(res.get("replicas", [])), len(res.get("replicas", [])) == hi, False),
           "replicas per GPU id": (per, len(per) == n and all(v == per_gpu for v in per.values()), False),
           "HAProxy servers UP at max": (res.get("haproxy_servers_up"), res.get("haproxy_servers_up") == hi, False),
           "max held while measured": (top["running"], top["running"] == [hi, hi], False),
           "back at min replicas": (res.get("final_states"), bool(res.get("scaled_down")), False),
           "failed during scale-down": (fall["failed"], fall["failed"] == 0, False),
           "failed, whole run": (res["whole_run"]["failed"], res["whole_run"]["failed"] == 0, False),
           "503 + Retry-After, whole run": (res["whole_run"]["refused_503"], None, False)}
    smi = res.get("nvidia_smi")
    if smi and "apps" in smi:
        pids = {r["pid"] for r in res.get("replicas", [])}
        on = {}
        for a in smi["apps"]:
            if a["pid"] in pids or not pids & {x["pid"] for x in smi["apps"]}:  # container pids may differ
                on[a["gpu"]] = on.get(a["gpu"], 0) + 1
        out["nvidia-smi processes per GPU"] = (on, len(on) == n and all(v >= per_gpu for v in on.values()), False)
    # the kinds the first replicas compiled and put in the shared cache; each added replica must seed them (hit)
    kinds = sorted({k for r in res.get("first_replicas", []) for k, v in r["published"].items()
                    if v in ("published", "exists", "replaced")})
    added = [r for r in res.get("replicas", []) if r["wave"] == "added by the ramp"]
    if any(r["seeded"] for r in res.get("first_replicas", [])):
        hits = [r["seeded"].get(k) for r in added for k in kinds]
        out["added replicas seed what the first published"] = (
            "%s: %s" % (",".join(kinds) or "none", ",".join(sorted(set(hits))) or "-"),
            bool(kinds) and bool(added) and all(h == "hit" for h in hits), False)
    ratio = round(top["rps"] / max(1e-9, n * one["rps"]), 3)
    out["requests/s ratio at max vs N x min"] = (ratio, ratio >= 0.9, True)
    out["p99 ms, min replicas"] = (one["p99_ms"], one["p99_ms"] <= 100.0, True)
    out["p99 ms, max replicas"] = (top["p99_ms"], top["p99_ms"] <= 100.0, True)
    return out


# -- offline ----------------------------------------------------------------------------------------

PROGRESS = re.compile(r"progress: files \d+/\d+, rows (\d+)/(\d+)")


def offline_job(args, address: str, data: str, out: str, gpus: int, tmp: str, name: str, kill: bool = False) -> dict:
    """`python -m serve_app.offline` on the cluster with `gpus` GPU actors; with `kill`, one scorer actor's process
    is SIGKILLed once rows have come back and rows remain. Returns its summary (and what was killed)."""
    import ray._private.state as ray_state

    summary = os.path.join(tmp, "summary-%s.json" % name)
    cmd = [sys.executable, "-m", "serve_app.offline", "--input", data, "--output", out, "--questions", QUESTIONS,
           "--state-column", "text", "--id-column", "id", "--checkpoint", args.checkpoint, "--backend", args.backend,
           "--num-gpus", str(gpus), "--address", address, "--no-ray-progress", "--summary-json", summary]
    if kill:  # smaller batches and a progress line for each, so the kill lands while rows are still left
        cmd += ["--batch-size", str(max(16, min(1024, args.rows // 20))), "--progress-interval", "0"]
    log_path = os.path.join(tmp, "offline-%s.log" % name)
    t0, killed = time.monotonic(), {}
    with open(log_path, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, RAY_ADDRESS=address, PYTHONUNBUFFERED="1"))
    try:
        with open(log_path, encoding="utf-8", errors="replace") as rd:
            while proc.poll() is None:
                if time.monotonic() - t0 > args.offline_timeout:
                    raise RuntimeError("offline %s: still running after %.0f s; %s" % (name, args.offline_timeout,
                                                                                         log_path))
                for line in rd.readlines():
                    m = PROGRESS.search(line)
                    if kill and not killed and m and 0 < int(m.group(1)) < int(m.group(2)):
                        alive = [a for a in ray_state.actors().values() if a["State"] == "ALIVE"
                                 and "ScoreStage" in a["ActorClassName"] and a["Pid"]]
                        if alive:
                            victim = alive[0]
                            os.kill(victim["Pid"], signal.SIGKILL)
                            killed = {"pid": victim["Pid"], "actor": victim["ActorID"], "rows_at_kill": int(m.group(1)),
                                      "rows_total": int(m.group(2)), "after_s": round(time.monotonic() - t0, 1)}
                            log("offline %s: SIGKILLed scorer actor pid %d at %s/%s rows" % (
                                name, victim["Pid"], m.group(1), m.group(2)))
                time.sleep(0.2)
    finally:
        stop_group(proc, ((signal.SIGTERM, 30), (signal.SIGKILL, 10)))
    if proc.returncode != 0 or not os.path.exists(summary):
        with open(log_path, encoding="utf-8", errors="replace") as fh:
            tail = "".join(fh.readlines()[-30:])
        raise RuntimeError("offline %s exited with %s; %s:\n%s" % (name, proc.returncode, log_path, tail))
    with open(summary, encoding="utf-8") as fh:
        s = json.load(fh)
    s.pop("timeline", None)
    s["wall_s"] = round(time.monotonic() - t0, 1)
    s["command"] = " ".join(cmd)
    if kill:
        s["killed"] = killed
    return s


def part_offline(args, n: int, address: str, tmp: str) -> dict:
    """Part 3: the same Parquet set with 1 GPU actor and with n, then n with one actor killed mid-run."""
    import pyarrow.parquet as pq

    data = os.path.join(tmp, "data")
    make_data(data, args.rows, max(4, 2 * n))
    res = {}
    for name, gpus, kill in (("one GPU", 1, False), ("%d GPUs" % n, n, False),
                             ("%d GPUs, one actor killed" % n, n, True)):
        out = os.path.join(tmp, "out-%d-%s" % (gpus, "killed" if kill else "clean"))
        log("offline %s: %d rows" % (name, args.rows))
        res[name] = offline_job(args, address, data, out, gpus, tmp, name.split(",")[0].replace(" ", "-") +
                                ("-killed" if kill else ""), kill)
        res[name]["ids"] = sorted(pq.read_table(out, columns=["id"]).column("id").to_pylist())
        log("offline %s: %s tokens/s after start-up, start-up %s s, %d rows" % (
            name, res[name].get("tokens_per_s_after_ready"), (res[name].get("startup") or {}).get("total_s"),
            res[name]["rows"]))
    one, clean, killed = res.values()
    ids_k, ids_c = killed.pop("ids"), clean.pop("ids")
    one.pop("ids")
    k = killed.get("killed") or {}
    ratio = round((clean.get("tokens_per_s_after_ready") or 0) / max(1e-9, n * (one.get("tokens_per_s_after_ready")
                                                                                 or 0)), 3)
    res["checks"] = {
        "actor killed mid-run": ("%s/%s rows" % (k.get("rows_at_kill"), k.get("rows_total")) if k else None,
                                 bool(k) and k["rows_at_kill"] < k["rows_total"], False),
        "rows out, killed run": (len(ids_k), len(ids_k) == args.rows, False),
        "same ids as the clean run": (ids_k == ids_c, ids_k == ids_c, False),
        "no duplicate": (len(set(ids_k)) == len(ids_k), len(set(ids_k)) == len(ids_k), False),
        "scorer actor restarts": (killed.get("actor_restarts"), None, False),
        "tokens/s ratio N vs N x one": (ratio, ratio >= 0.9, True)}
    return res


# -- report -----------------------------------------------------------------------------------------

def print_report(res: dict, logical: bool) -> bool:
    """The tables; returns whether every judged check passed."""
    ok = True
    sv = res.get("serve")
    if sv:
        print("\nServe: configs/prod.yaml behind HAProxy")
        for line in sv["notes"]:
            print("  " + line)
        print("serve run: /ready after %.1f s, %d replicas running after %.1f s; scale-up %.1f s, scale-down %.1f s"
              % (sv["ready_s"], sv["bounds"]["min"], sv["min_running_s"], sv.get("scale_up_s", 0),
                 sv.get("scale_down_s", 0)))
        print("%-27s %-8s %4s %7s %6s %7s %7s %9s %7s %8s  %s" % (
            "replica", "pid", "GPU", "CUDA_VD", "device", "start@s", "load s", "warm-up s", "ready s", "reqs@max",
            "cache seeded / published"))
        smi = {a["pid"]: a for a in (sv.get("nvidia_smi") or {}).get("apps", [])}
        first = {r["pid"] for r in sv["first_replicas"]}
        rows = sv["first_replicas"] + [r for r in sv.get("replicas", []) if r["pid"] not in first]
        at_max = {r["pid"]: r for r in sv.get("replicas", [])}
        for r in rows:
            c = ",".join("%s:%s" % kv for kv in r["seeded"].items()) or "-"
            p = ",".join("%s:%s" % kv for kv in r["published"].items()) or "-"
            g = smi.get(r["pid"])
            print("%-27s %-8s %4s %7s %6s %7s %7s %9s %7s %8s  %s / %s%s" % (
                r["wave"], r["pid"], ",".join(r["gpu_ids"]) or "-", r["cuda_visible_devices"], r["device"],
                _f(r.get("started_s")), _f(r["load_s"]), _f(r["warmup_s"]), _f(r["ready_s"]),
                at_max.get(r["pid"], {}).get("requests_at_max", "-"), c, p,
                "  nvidia-smi: GPU %s, %s MiB" % (g["gpu"], g["used_mib"]) if g else ""))
        if sv.get("nvidia_smi"):
            print("nvidia-smi compute apps: %s" % sv["nvidia_smi"])
        print("%-28s %7s %8s %8s %8s %8s %6s %6s %10s  %s" % ("phase", "clients", "requests", "req/s", "p50 ms",
                                                               "p99 ms", "503+RA", "failed", "replicas", "GPU busy"))
        for p in sv["phases"]:
            print("%-28s %7s %8d %8.1f %8.1f %8.1f %6d %6d %10s  %s" % (
                p["phase"], p["clients"], p["requests"], p["rps"], p["p50_ms"], p["p99_ms"], p["refused_503"],
                p["failed"], "->".join(map(str, p["running"])),
                "-" if p.get("gpu_busy_pct") is None else "%s%%" % p["gpu_busy_pct"]))
    off = res.get("offline")
    if off:
        print("\nOffline: python -m serve_app.offline on the cluster")
        from serve_app.offline.summary import PIECES

        print("%-26s %6s %8s %7s %11s %8s %7s  %s" % ("run", "actors", "restarts", "rows", "tokens/s*", "start s",
                                                       "wall s", "start-up pieces, s (serve_app/offline/summary.py)"))
        for name, s in off.items():
            if name == "checks":
                continue
            su = s.get("startup") or {}
            pieces = ", ".join("%s %.1f" % (label, su[k]) for k, label in PIECES if (su.get(k) or 0) >= 0.05)
            print("%-26s %6s %8s %7s %11s %8s %7s  %s" % (name, s.get("actors"), s.get("actor_restarts"), s["rows"],
                                                           s.get("tokens_per_s_after_ready"), su.get("total_s"),
                                                           s["wall_s"], pieces))
        print("* tokens/s after start-up (from the first scorer actor ready)")
    print("\n%-8s %-52s %-28s %s" % ("part", "check", "value", "result"))
    for part in ("serve", "offline"):
        for name, (value, good, perf) in (res.get(part) or {}).get("checks", {}).items():
            if good is None:
                verdict = "reported"
            elif perf and logical:
                verdict = "not judged (logical GPUs)"
            else:
                verdict = "ok" if good else "MISSED"
                ok &= bool(good)
            print("%-8s %-52s %-28s %s" % (part, name, json.dumps(value, default=str)[:28], verdict))
    return ok


def _f(v) -> str:
    return "-" if v is None else "%.1f" % v


def plot(res: dict, path: str, title: str) -> None:
    """The ramp second by second (clients, replicas, answers/s, refusals, p99) and the offline tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = (res.get("serve") or {}).get("timeline") or []
    off = {k: v for k, v in (res.get("offline") or {}).items() if k != "checks"}
    fig, axes = plt.subplots(1, 3 if tl and off else 2 if tl else 1, figsize=(16 if tl and off else 11, 4.5),
                             squeeze=False)
    axes = list(axes[0])
    if tl:
        t = [x["t"] for x in tl]
        a, b = axes.pop(0), axes.pop(0)
        a.step(t, [x["running"] for x in tl], where="post", label="Ingress replicas RUNNING", color="k")
        a2 = a.twinx()
        a2.step(t, [x["clients"] for x in tl], where="post", label="clients", color="tab:blue", alpha=0.5)
        a.set_xlabel("s")
        a.set_ylabel("replicas")
        a2.set_ylabel("clients")
        a.legend(loc="upper left", fontsize=8)
        a2.legend(loc="upper right", fontsize=8)
        b.plot(t, [x["ok"] for x in tl], label="200/s")
        b.plot(t, [x["refused"] for x in tl], label="503/s (Retry-After)")
        b.plot(t, [x["failed"] for x in tl], label="failed/s", color="r")
        b2 = b.twinx()
        b2.plot(t, [x["p99_ms"] for x in tl], ":", color="tab:gray", label="p99 ms")
        b2.set_yscale("log")
        b.set_xlabel("s")
        b.legend(loc="upper left", fontsize=8)
        b2.legend(loc="upper right", fontsize=8)
    if off:
        c = axes.pop(0)
        names = list(off)
        c.bar(range(len(names)), [off[k].get("tokens_per_s_after_ready") or 0 for k in names])
        c.set_xticks(range(len(names)), names, fontsize=8)
        c.set_ylabel("offline tokens/s after start-up")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the parts and print the tables; exit 1 if a judged check missed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--logical-gpus", type=int, default=None, help="rehearse on a CPU machine with N logical GPUs")
    p.add_argument("--clients", type=int, default=16, help="clients per replica when measuring at min and at max")
    p.add_argument("--ramp-clients", type=int, default=32,
                   help="clients per replica while the load rises (above target_ongoing_requests, 24 as shipped)")
    p.add_argument("--duration", type=float, default=15.0, help="measured seconds at min and at max")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each measurement")
    p.add_argument("--upscale-delay", type=float, default=5.0, help="benchmark timing (shipped: 30)")
    p.add_argument("--downscale-delay", type=float, default=None,
                   help="benchmark timing (shipped: 600); default duration + warmup + 12, so max holds while measured")
    p.add_argument("--look-back", type=float, default=5.0, help="benchmark timing (shipped: 30)")
    p.add_argument("--scale-timeout", type=float, default=300.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--client-procs", type=int, default=None,
                   help="client processes (default: 1 below 8 cores, else cores / 8, at most 16)")
    p.add_argument("--states", type=int, default=1,
                   help="states per request: 1 = /v1/systemone (1 state x 3 questions), more = /v1/systemone/batch")
    p.add_argument("--local-cache", default=None,
                   help="node-local compile dir (default: a fresh one, so the first replicas really compile)")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--offline-timeout", type=float, default=900.0)
    p.add_argument("--parts", default="serve,offline")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "multi_gpu.json"))
    args = p.parse_args(argv)
    # `timeout` / a job runner sends SIGTERM: unwind so every server and cluster started here is stopped
    # (their process groups outlive this one otherwise, holding the GPU and ports)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.checkpoint = os.path.abspath(args.checkpoint)
    args.downscale_delay = args.downscale_delay or args.duration + args.warmup + 12.0
    args.client_procs = args.client_procs or (1 if (os.cpu_count() or 2) < 8 else min(16, (os.cpu_count() or 8) // 8))
    tmp = tempfile.mkdtemp(prefix="multi-gpu-")
    args.shared_cache = os.path.join(tmp, "shared-cache")  # empty: the first replicas compile and publish
    args.local_cache = os.path.abspath(args.local_cache) if args.local_cache else os.path.join(tmp, "local-cache")
    import yaml

    with open(PROD, encoding="utf-8") as fh:
        key_name = yaml.safe_load(fh)["applications"][0]["args"].get("api_key_env")
    key = secrets.token_hex(16)
    env, ports = cluster_env({key_name: key} if key_name else {}, 100)
    env.update(LAYA_FLEET_CACHE_DIR=args.shared_cache, LAYA_FLEET_LOCAL_CACHE_DIR=args.local_cache)
    log("ray start --head (%s GPUs), logs in %s" % (args.logical_gpus or "all", tmp))
    proc, address, n = start_cluster(args, env, tmp)
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    res: dict = {"gpus": n, "logical_gpus": args.logical_gpus is not None, "address": address,
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host_cpus": os.cpu_count(),
                 "commit": os.environ.get("LAYA_FLEET_COMMIT") or commit.stdout.strip(),
                 "command": " ".join([os.path.basename(sys.executable), "bench/multi_gpu.py"] + (argv or sys.argv[1:])),
                 "cluster_env": {k: v for k, v in env.items() if k != key_name}, "settings": vars(args)}
    try:
        if n < 1:
            log("no GPU in the cluster: nothing to do")
            return 2
        if "serve" in args.parts:
            res["serve"] = part_serve(args, n, address, env, ports, key, tmp)
        if "offline" in args.parts:
            res["offline"] = part_offline(args, n, address, tmp)
    finally:
        import ray

        ray.shutdown()
        stop_group(proc, ((signal.SIGTERM, 60), (signal.SIGKILL, 10)))
        time.sleep(2.0)
        res["reaped_after_stop"] = reap("LAYA_FLEET_CACHE_DIR=" + args.shared_cache)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1, default=str)
    ok = print_report(res, args.logical_gpus is not None)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(res, png, "%s, %d %sGPUs, %s, commit %s" % (os.path.basename(args.checkpoint), n,
                                                     "logical " if args.logical_gpus else "", args.backend,
                                                     res["commit"]))
    print("wrote %s and %s (logs in %s)" % (args.out, png, tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
