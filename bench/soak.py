"""Soak: `serve run configs/local.yaml` under 256 closed-loop clients for 10 minutes.

Passes when no request fails and every Serve process's memory (RSS) stays flat: after the first
`--settle` seconds, growth to the end is under max(`--rss-tol-mib`, 5 %). Every `--sample` seconds it
records requests/s, p50/p99 latency, failures and the RSS of each replica process (found by Ray's
process titles, e.g. `ray::ServeReplica:laya:Scorer`). Prints a table, writes JSON and a PNG.

    python bench/soak.py                       # 600 s, 256 clients, configs/local.yaml
    python bench/soak.py --duration 60 --clients 32 --out bench/results/soak_short.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from serve_load import REPO, FleetServer, environment, make_payloads, summarize  # noqa: E402

ROLES = {"Proxy": "ProxyActor", "Controller": "ServeController", "HAProxyManager": "HAProxyManager"}
# one in every MULTILINGUAL_EVERY requests is non-English, so the multilingual checkpoint's scorer serves too
MULTILINGUAL_EVERY = 8
MULTILINGUAL_STATES = ["Meine Bestellung ist kaputt angekommen, ich möchte mein Geld zurück.",
                       "Мой заказ пришёл сломанным, верните деньги.",
                       "注文した商品が壊れて届きました。返金してください。",
                       "Mi pedido llegó roto y quiero que me devuelvan el dinero hoy.",
                       "طلبي وصل مكسورا وأريد استرداد أموالي."]


def serve_processes(app: str, root_pid: int) -> dict[str, list[int]]:
    """PIDs of the Serve processes under `root_pid` (our `serve run`) by role, from Ray's process titles: each
    replica under its deployment's name (`Scorer`, `Scorer-multilingual`, `Ingress`), then ROLES."""
    import psutil

    out: dict[str, list[int]] = {}
    replica = "ray::ServeReplica:%s:" % app
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if cmd.startswith(replica):
            out.setdefault(cmd[len(replica):].split()[0], []).append(p.pid)
        for role, title in ROLES.items():
            if cmd.startswith("ray::" + title):
                out.setdefault(role, []).append(p.pid)
    return out


def restarted(start: dict[str, list[int]], end: dict[str, list[int]]) -> dict[str, list[int]]:
    """{role: pids at the end that were not there at the start}: a replica replaced (a crash, a failed health
    check) or added; a role whose processes all left (scaled to zero as configured) is not in it."""
    return {role: new for role, ps in end.items() if (new := sorted(set(ps) - set(start.get(role, ()))))}


def soak_payloads(n: int, seed: int) -> list[dict]:
    """serve_load's customer messages, every MULTILINGUAL_EVERY-th one a non-English state instead."""
    out = make_payloads(n, seed=seed)
    for i in range(0, n, MULTILINGUAL_EVERY):
        out[i] = dict(out[i], state=MULTILINGUAL_STATES[(i // MULTILINGUAL_EVERY) % len(MULTILINGUAL_STATES)])
    return out


def rss_mib(pids: dict[str, list[int]]) -> dict[str, float]:
    """RSS in MiB per role (summed over that role's processes; 0 for a process that is gone)."""
    import psutil

    out = {}
    for role, ps in pids.items():
        total = 0
        for pid in ps:
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        out[role] = round(total / 2 ** 20, 1)
    return out


async def soak(url: str, payloads: list[dict], clients: int, duration: float, sample_s: float, app: str,
               on_sample) -> list[tuple[float, int, float]]:
    """Run the clients for `duration` s; call `on_sample(t, window records)` every `sample_s`; all records."""
    import aiohttp

    records: list[tuple[float, int, float]] = []
    bodies = [json.dumps(p).encode() for p in payloads]
    t0 = time.monotonic()
    t_end = t0 + duration
    counter = iter(range(10 ** 12))

    async def client(session):
        while time.monotonic() < t_end:
            t = time.monotonic()
            try:
                async with session.post(url, data=bodies[next(counter) % len(bodies)],
                                        headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    status = r.status
            except (TimeoutError, aiohttp.ClientError):
                status = -1
            records.append((time.monotonic(), status, time.monotonic() - t))

    async def sampler():
        seen = 0
        next_t = t0 + sample_s
        while next_t <= t_end + 1e-6:
            await asyncio.sleep(max(0.0, next_t - time.monotonic()))
            window = records[seen:]
            seen = len(records)
            on_sample(next_t - t0, window)
            next_t += sample_s

    conn = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(sampler(), *(client(session) for _ in range(clients)))
    return records


def flatness(samples: list[dict], settle_s: float, tol_mib: float) -> dict[str, dict]:
    """Per role: RSS after settling vs at the end, slope (MiB/min) and whether growth is within tolerance."""
    out = {}
    steady = [s for s in samples if s["t"] >= settle_s] or samples
    for role in samples[0]["rss_mib"]:
        ys = np.array([s["rss_mib"][role] for s in steady])
        ts = np.array([s["t"] for s in steady])
        if not ys.any():
            continue
        slope = float(np.polyfit(ts, ys, 1)[0] * 60.0) if len(ys) > 2 else 0.0
        growth = float(ys[-1] - ys[0])
        limit = max(tol_mib, 0.05 * float(ys[0]))
        out[role] = {"start_mib": float(ys[0]), "end_mib": float(ys[-1]), "max_mib": float(ys.max()),
                     "growth_mib": round(growth, 1), "slope_mib_per_min": round(slope, 2),
                     "limit_mib": round(limit, 1), "flat": growth <= limit}
    return out


def plot(samples: list[dict], path: str, title: str) -> None:
    """Requests/s, p50/p99 latency and RSS per role over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60.0 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    axes[0].plot(t, [s["rps"] for s in samples], "o-")
    axes[0].set_ylabel("requests / s")
    axes[1].plot(t, [s["p50_ms"] for s in samples], "o-", label="p50")
    axes[1].plot(t, [s["p99_ms"] for s in samples], "s--", label="p99")
    axes[1].set_ylabel("latency (ms)")
    axes[1].legend()
    for role in samples[0]["rss_mib"]:
        axes[2].plot(t, [s["rss_mib"][role] for s in samples], "o-", label=role)
    axes[2].set_ylabel("RSS (MiB)")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    for a in axes:
        a.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns 0 when the soak passes (no failures, flat RSS), else 1."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "local.yaml"))
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--sample", type=float, default=15.0, help="seconds per table row")
    p.add_argument("--settle", type=float, default=60.0, help="seconds before RSS is expected to be flat")
    p.add_argument("--rss-tol-mib", type=float, default=48.0)
    p.add_argument("--path", choices=("haproxy", "proxy"), default="haproxy",
                   help="haproxy: Ray's HAProxy ingress on the HTTP port (as `make serve` and configs/prod.yaml run); "
                        "proxy: Serve's Python proxy")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "soak_cpu.json"))
    args = p.parse_args(argv)

    with open(args.config, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    app = cfg["applications"][0]
    ckpt = app["args"]["checkpoint"]
    if not os.path.isabs(ckpt) and not os.path.isdir(os.path.join(REPO, ckpt)):
        from model.make_checkpoint import make_checkpoint

        make_checkpoint(os.path.join(REPO, ckpt), "tiny", seed=0)
    base = os.path.splitext(args.out)[0]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    payloads = soak_payloads(1024, seed=1)
    samples: list[dict] = []
    log_path = os.path.join(tempfile.gettempdir(), "laya-fleet-bench", os.path.basename(base) + ".serve.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    # the local Ray as `make serve` starts it: node address 127.0.0.1, every port on loopback
    with FleetServer(args.config, log_path, haproxy=args.path == "haproxy",
                     extra_env={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}) as srv:
        pids = serve_processes(app["name"], srv.proc.pid)
        print("serve run %s ready in %.1fs at %s; processes %s" % (args.config, srv.ready_s, srv.url, pids))
        print("%7s %8s %8s %9s %9s %7s  %s" % ("t (s)", "requests", "req/s", "p50 ms", "p99 ms", "failed", "RSS MiB"))

        def on_sample(t: float, window: list) -> None:
            row = summarize(window, args.sample, args.clients)
            row.update(t=round(t, 1), failed=row["requests"] - row["ok"], rss_mib=rss_mib(pids))
            samples.append(row)
            print("%7.0f %8d %8.1f %9.1f %9.1f %7d  %s" % (t, row["requests"], row["rps"], row["p50_ms"],
                                                            row["p99_ms"], row["failed"], row["rss_mib"]), flush=True)

        t0 = time.monotonic()
        records = asyncio.run(soak(srv.url + "/v1/systemone", payloads, args.clients, args.duration, args.sample,
                                   app["name"], on_sample))
        total = summarize(records, time.monotonic() - t0, args.clients)
        pids_end = serve_processes(app["name"], srv.proc.pid)
    flat = flatness(samples, args.settle, args.rss_tol_mib)
    failed = total["requests"] - total["ok"]
    new_pids = restarted(pids, pids_end)
    passed = failed == 0 and all(v["flat"] for v in flat.values()) and not new_pids
    out = {"env": environment(ckpt, app["args"].get("backend", "auto")), "config": args.config, "path": args.path,
           "clients": args.clients, "duration_s": args.duration, "startup_s": round(srv.ready_s, 1),
           "total": total, "failed": failed, "rss": flat, "replicas_restarted": new_pids,
           "processes": {"start": pids, "end": pids_end}, "passed": passed, "samples": samples}
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    plot(samples, base + ".png", "soak: %s, %d clients, %.0f s" % (os.path.basename(args.config), args.clients,
                                                                      args.duration))
    print("total: %d requests, %d failed, %.1f req/s, p50 %.1f ms, p99 %.1f ms" % (
        total["requests"], failed, total["rps"], total["p50_ms"], total["p99_ms"]))
    for role, v in flat.items():
        print("RSS %-10s %7.1f -> %7.1f MiB (growth %+.1f, limit %.1f, %+.2f MiB/min) %s" % (
            role, v["start_mib"], v["end_mib"], v["growth_mib"], v["limit_mib"], v["slope_mib_per_min"],
            "flat" if v["flat"] else "GROWING"))
    print("%s; wrote %s and %s" % ("PASS" if passed else "FAIL", args.out, base + ".png"))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
