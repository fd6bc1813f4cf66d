"""Closed-loop HTTP load against the online service: p50/p99 latency and requests/s at 1..256 clients.

Each client sends a request (1 state x 3 questions, configs/example_questions.json), waits for the answer,
and sends the next; a level runs for `--duration` seconds after `--warmup`. Against an already running
server (`--url`), or it starts one itself with `serve run` of a config derived from configs/local.yaml
pointed at `--checkpoint` (one scorer replica per GPU when CUDA is visible, else CPU). With
`--compare-upstream` it then starts upstream's own server (`laya-serve` from laya 0.4.15, given the same
checkpoint through LAYA_EXTRA_MODELS) and runs the same requests at the same levels; the servers run one
after the other, never at once. Prints a table, writes JSON, draws a PNG next to it.

    python bench/serve_load.py --checkpoint DIR --backend auto --compare-upstream --out bench/results/serve_gpu.json
    python bench/serve_load.py --url http://127.0.0.1:8000 --levels 1,8,64 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
QUESTIONS = json.load(open(os.path.join(REPO, "configs", "example_questions.json"), encoding="utf-8"))
UPSTREAM_MODEL = "bench"
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


# -- servers ----------------------------------------------------------------------------------------

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
                raise RuntimeError("%s exited with %s; see %s" % (self.name, self.proc.returncode, self.log_path))
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1.0)
        raise RuntimeError("%s not ready after %.0fs; see %s" % (self.name, timeout, self.log_path))

    def stop(self) -> None:
        """SIGINT the process group (serve run shuts Serve and its local Ray down), then escalate."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 60), (signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


class FleetServer(Server):
    """`serve run <config>`: this project's Ray Serve application."""

    name = "laya-fleet"

    def __init__(self, config: dict | str, log_path: str, ready_timeout: float = 900.0):
        super().__init__(log_path)
        self._tmp = None
        if isinstance(config, str):  # a config file, run as is
            path = config
            with open(path, encoding="utf-8") as fh:
                config = yaml.safe_load(fh)
        else:
            fd, path = self._tmp = tempfile.mkstemp(prefix="laya-fleet-bench-", suffix=".yaml")
            with os.fdopen(fd, "w") as fh:
                yaml.safe_dump(config, fh, sort_keys=False)
        self.url = "http://127.0.0.1:%d" % config["http_options"]["port"]
        self._spawn([os.path.join(BIN, "serve"), "run", path])
        try:
            self.ready_s = self.wait_ready("/ready", ready_timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        super().stop()
        if self._tmp and os.path.exists(self._tmp[1]):
            os.unlink(self._tmp[1])


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


# -- load ---------------------------------------------------------------------------------------------

async def run_level(url: str, payloads: list[dict], clients: int, duration: float, warmup: float,
                    headers: dict | None = None, timeout: float = 120.0) -> dict:
    """One closed-loop level: `clients` loops for `warmup` + `duration` s; stats of the measured part."""
    import aiohttp

    records: list[tuple[float, int, float]] = []
    counter = iter(range(10 ** 12))
    bodies = [json.dumps(p).encode() for p in payloads]
    hdrs = dict(headers or {}, **{"Content-Type": "application/json"})
    t_start = time.monotonic()
    t_measure = t_start + warmup
    t_end = t_measure + duration

    async def client(session):
        while time.monotonic() < t_end:
            body = bodies[next(counter) % len(bodies)]
            t = time.monotonic()
            try:
                async with session.post(url, data=body, headers=hdrs) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = -1
            done = time.monotonic()
            if t >= t_measure:
                records.append((done, status, done - t))

    conn = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    span = max(1e-9, max((r[0] for r in records), default=t_end) - t_measure)
    return summarize(records, span, clients)


def summarize(records: list[tuple[float, int, float]], span_s: float, clients: int) -> dict:
    """Request count, errors by status, requests/s and latency percentiles (ms) of successful requests."""
    ok = [lat for _, s, lat in records if s == 200]
    errors: dict[str, int] = {}
    for _, s, _ in records:
        if s != 200:
            errors[str(s)] = errors.get(str(s), 0) + 1
    lat = np.array(ok) * 1000.0 if ok else np.zeros(1)
    return {"clients": clients, "requests": len(records), "ok": len(ok), "errors": errors,
            "rps": round(len(ok) / span_s, 2), "p50_ms": round(float(np.percentile(lat, 50)), 2),
            "p90_ms": round(float(np.percentile(lat, 90)), 2), "p99_ms": round(float(np.percentile(lat, 99)), 2),
            "mean_ms": round(float(lat.mean()), 2), "seconds": round(span_s, 2)}


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


def run_server(server: Server, payloads: list[dict], levels: list[int], duration: float, warmup: float,
               headers: dict | None) -> list[dict]:
    """All levels against one server; prints each row as it completes."""
    url = server.url + "/v1/systemone"
    rows = []
    for n in levels:
        row = asyncio.run(run_level(url, payloads, n, duration, warmup, headers))
        rows.append(row)
        print_row(server.name, row)
    return rows


def print_row(name: str, r: dict) -> None:
    """One table row on stdout."""
    err = ",".join("%s:%d" % kv for kv in sorted(r["errors"].items())) or "-"
    print("%-20s %7d %8d %9.1f %9.1f %9.1f %9.1f  %s" % (name, r["clients"], r["requests"], r["rps"], r["p50_ms"],
                                                          r["p90_ms"], r["p99_ms"], err), flush=True)


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
            "request": "1 state x 3 questions (configs/example_questions.json)", "time": time.strftime("%FT%T%z")}


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (1 if any request failed)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running laya-fleet base URL (skips starting one)")
    p.add_argument("--checkpoint", default=os.path.join(REPO, "checkpoints", "tiny"))
    p.add_argument("--backend", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--replicas", type=int, default=1, help="scorer replicas (one GPU each when CUDA is visible)")
    p.add_argument("--ingress-replicas", type=int, default=None, help="default: 1 below 8 cores, else 2")
    p.add_argument("--max-batch-tokens", type=int, default=None, help="default: 8192 on CPU, measured on GPU")
    p.add_argument("--compare-upstream", action="store_true", help="also run upstream laya-serve (after ours)")
    p.add_argument("--upstream-only", action="store_true", help="run only upstream laya-serve")
    p.add_argument("--levels", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=3.0, help="unmeasured seconds before each level")
    p.add_argument("--api-key-env", default=None, help="env var holding a bearer key for --url")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "serve_cpu.json"))
    args = p.parse_args(argv)

    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    payloads = make_payloads()
    headers = {"Authorization": "Bearer " + os.environ[args.api_key_env]} if args.api_key_env else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    base = os.path.splitext(args.out)[0]
    logs = os.path.join(tempfile.gettempdir(), "laya-fleet-bench", os.path.basename(base))
    os.makedirs(os.path.dirname(logs), exist_ok=True)
    import torch

    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    ingress = args.ingress_replicas or (1 if (os.cpu_count() or 2) < 8 else 2)
    results: dict[str, list[dict]] = {}
    startup: dict[str, float] = {}
    answers: dict[str, list[dict]] = {}
    print("%-20s %7s %8s %9s %9s %9s %9s  %s" % ("server", "clients", "requests", "req/s", "p50 ms", "p90 ms",
                                                   "p99 ms", "errors"))
    if not args.upstream_only:
        if args.url:
            srv = Server("")
            srv.name, srv.url = "laya-fleet", args.url.rstrip("/")
            answers[srv.name] = sample_answers(srv.url + "/v1/systemone", payloads[:16], headers)
            results[srv.name] = run_server(srv, payloads, levels, args.duration, args.warmup, headers)
        else:
            cfg = fleet_config(args.checkpoint, args.backend, args.device, free_port(), args.replicas, ingress,
                               args.max_batch_tokens, gpus)
            with FleetServer(cfg, logs + ".fleet.log") as srv:
                startup[srv.name] = round(srv.ready_s, 1)
                answers[srv.name] = sample_answers(srv.url + "/v1/systemone", payloads[:16])
                results[srv.name] = run_server(srv, payloads, levels, args.duration, args.warmup, None)
    if args.compare_upstream or args.upstream_only:
        with UpstreamServer(args.checkpoint, free_port(), args.device, logs + ".upstream.log") as srv:
            startup[srv.name] = round(srv.ready_s, 1)
            answers[srv.name] = sample_answers(srv.url + "/v1/systemone", payloads[:16])
            results[srv.name] = run_server(srv, payloads, levels, args.duration, args.warmup, None)
    out: dict[str, Any] = {"env": environment(args.checkpoint, args.backend),
                           "settings": {"levels": levels, "duration_s": args.duration, "warmup_s": args.warmup,
                                        "replicas": args.replicas, "ingress_replicas": ingress,
                                        "max_batch_tokens": args.max_batch_tokens, "url": args.url},
                           "startup_s": startup, "results": results}
    names = list(answers)
    if len(names) == 2:
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
