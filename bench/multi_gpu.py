"""The fleet on N GPUs of one host: Serve replicas, autoscaling and the offline job.

One script, three parts, one Ray cluster started here (`ray start --head`, all GPUs, or `--logical-gpus N`
on a CPU machine to rehearse the orchestration):

1. Serve, one replica: `serve run` of configs/local.yaml pointed at the checkpoint with one GPU per scorer,
   a shared compile-cache dir (empty), throughput at `--clients`. This replica compiles and publishes.
2. Serve, autoscaled 1..N (same shared cache, now populated): a load ramp until N replicas run, throughput
   at N, then no load until it is back at 1. Every replica's CUDA_VISIBLE_DEVICES / Ray GPU id, pid and
   warm-up seconds are printed side by side with `nvidia-smi`'s processes. Checks: no failed request,
   N distinct GPUs, throughput(N) >= 0.9 x N x throughput(1).
3. Offline: the same Parquet set with 1 actor, then N actors (tokens/s >= 0.9 x N x one GPU), then N
   actors again with one scorer actor killed mid-run: rows out == rows in, each row exactly once.

NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are set here and so in
every process Ray starts. Prints a table, writes JSON next to --out.

    python bench/multi_gpu.py --checkpoint /ck/large --out bench/results/multi_gpu_h200x2.json
    python bench/multi_gpu.py --checkpoint checkpoints/tiny --logical-gpus 2 --clients 8 --duration 5 --rows 400
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

NV_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NV_ENV)
# a private single-host cluster: token auth (on whenever ~/.ray/auth_token exists) only gets in the way
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path[:0] = [HERE, REPO]

from offline import make_data  # noqa: E402
from serve_load import FleetServer, fleet_config, free_port, make_payloads, run_level, stop_group  # noqa: E402

QUESTIONS = os.path.join(REPO, "configs", "example_questions.json")


def log(msg: str) -> None:
    """A timestamped progress line on stdout."""
    print("[%s] %s" % (time.strftime("%H:%M:%S"), msg), flush=True)


def start_cluster(logical_gpus: int | None, tmp: str) -> tuple[subprocess.Popen, str, int]:
    """`ray start --head --block` on free ports in its own process group; returns (proc, address, GPUs)."""
    port = free_port()
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--head", "--block",
           "--port", str(port), "--dashboard-port", str(free_port()), "--include-dashboard", "false",
           "--temp-dir", os.path.join(tmp, "ray")]
    if logical_gpus is not None:
        cmd += ["--num-gpus", str(logical_gpus), "--num-cpus", str(max(8, 4 * logical_gpus))]
    proc = subprocess.Popen(cmd, stdout=open(os.path.join(tmp, "ray.log"), "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    address = "127.0.0.1:%d" % port
    import ray

    for _ in range(120):
        try:
            ray.init(address=address, log_to_driver=False)
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)
    gpus = int(ray.cluster_resources().get("GPU", 0))
    return proc, address, gpus


def join_cpu_node(address: str, tmp: str, i: int) -> subprocess.Popen:
    """`ray start --address` a CPU-only node on this host (another Serve proxy on the same port)."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block", "--address", address,
           "--num-gpus", "0", "--num-cpus", "4", "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, stdout=open(os.path.join(tmp, "ray-node%d.log" % i), "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    time.sleep(5.0)
    return proc


def serve_config(checkpoint: str, backend: str, port: int, gpus: int, autoscale_max: int | None,
                 cache_dir: str, local_dir: str) -> dict:
    """configs/local.yaml for the bench: one GPU per scorer, shared cache, fixed 1 or autoscaled 1..max.

    `local_dir` is the replicas' node-local compile dir: a fresh one per part, so the first part's replica
    compiles (empty shared cache) and the second part's replicas can only get kernels from the shared cache.
    """
    cfg = fleet_config(checkpoint, backend, "auto", port, 1, 2, None, gpus)
    app = cfg["applications"][0]
    app.setdefault("runtime_env", {}).setdefault("env_vars", {}).update(
        dict(NV_ENV, LAYA_FLEET_CACHE_DIR=cache_dir, LAYA_FLEET_LOCAL_CACHE_DIR=local_dir))
    app["args"]["cache_dir"] = cache_dir
    for d in app["deployments"]:
        if d["name"] == "Scorer" and autoscale_max:
            d.pop("num_replicas", None)
            d["autoscaling_config"] = {"min_replicas": 1, "max_replicas": autoscale_max,
                                       "target_ongoing_requests": 2, "upscale_delay_s": 3,
                                       "downscale_delay_s": 15, "look_back_period_s": 3,
                                       "policy": {"policy_function": "serve_app.autoscale:pending_requests_policy"}}
    return cfg


def reset_serve_client() -> None:
    """Forget the cached Serve client: each `serve run` brings its own controller."""
    from ray.serve import context

    context._set_global_client(None)


def replicas() -> dict:
    """Scorer replica states of the running app, e.g. {"RUNNING": 2}."""
    from ray import serve

    st = serve.status().applications.get("laya")
    if st is None or "Scorer" not in st.deployments:
        return {}
    return {str(k): v for k, v in st.deployments["Scorer"].replica_states.items()}


def replica_infos(n: int) -> list[dict]:
    """`info()` of every scorer replica reachable (many handle calls, deduplicated by pid)."""
    from ray import serve

    h = serve.get_deployment_handle("Scorer", app_name="laya")
    seen: dict[int, dict] = {}
    for _ in range(16 * max(1, n)):
        i = h.info.remote().result(timeout_s=60)
        seen[i["pid"]] = {k: i.get(k) for k in ("pid", "gpu_ids", "cuda_visible_devices", "device", "backend",
                                                "ready_s", "load_s")}
        seen[i["pid"]]["warmup_s"] = i["stats"]["warmup_s"]
        cache = i.get("cache") or {}
        seen[i["pid"]]["cache"] = {"seeded": {k: v.get("state") for k, v in (cache.get("seeded") or {}).items()},
                                   "published": cache.get("published")}
        if len(seen) >= n:
            break
    return sorted(seen.values(), key=lambda r: r["pid"])


def nvidia_smi() -> str:
    """`nvidia-smi` compute processes (pid, GPU, memory), or why not."""
    try:
        return subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return "nvidia-smi: %s" % e


def heavy_payloads(states: int, n: int = 128, seed: int = 0) -> list[dict]:
    """`n` bodies for /v1/systemone/batch: `states` long customer messages (150..400 words) x 3 questions.

    One request is ~`states` x 3 rows of ~250-600 tokens, so a replica's GPU, not the single HTTP proxy, bounds
    the throughput being scaled."""
    rng = random.Random(seed)
    small = make_payloads(n * states, seed)
    out = []
    for i in range(n):
        sts = []
        for j in range(states):
            words = [small[(i * states + j + k) % len(small)]["state"] for k in range(rng.randint(8, 22))]
            sts.append(" ".join(words))
        out.append({"states": sts, "questions": small[0]["questions"], "model": small[0]["model"]})
    return out


def load(url: str, clients: int, seconds: float, states: int) -> dict:
    """One closed-loop level: /v1/systemone (1 state) or, with `states` > 1, /v1/systemone/batch."""
    if states > 1:
        return asyncio.run(run_level(url + "/v1/systemone/batch", heavy_payloads(states), clients, seconds, 1.0))
    return asyncio.run(run_level(url + "/v1/systemone", make_payloads(), clients, seconds, 1.0))


def part_serve(args, n: int, tmp: str) -> dict:
    """Parts 1 and 2: one replica, then autoscaling 1..n under a ramp and back."""
    cache = os.path.join(tmp, "shared-cache")
    res: dict = {}
    port = free_port()
    log("serve: 1 replica, empty shared cache")
    with FleetServer(serve_config(args.checkpoint, args.backend, port, n, None, cache,
                                  os.path.join(tmp, "local-1")), os.path.join(tmp, "serve1.log")) as s:
        res["one"] = {"ready_s": s.ready_s, "replicas": replica_infos(1),
                      "load": load(s.url, args.clients, args.duration, args.states)}
    log("serve: 1 replica %.1f req/s" % res["one"]["load"]["rps"])
    reset_serve_client()
    port = free_port()
    log("serve: autoscaled 1..%d, populated cache" % n)
    with FleetServer(serve_config(args.checkpoint, args.backend, port, n, n, cache,
                                  os.path.join(tmp, "local-n")), os.path.join(tmp, "serveN.log")) as s:
        ramp, t0 = [], time.monotonic()
        while replicas().get("RUNNING", 0) < n and time.monotonic() - t0 < args.scale_timeout:
            ramp.append(dict(load(s.url, args.clients * n, 5.0, args.states), replicas=replicas()))
        res["scale_up_s"] = round(time.monotonic() - t0, 1)
        res["ramp"] = ramp
        res["n"] = {"replicas": replica_infos(n), "load": load(s.url, args.clients * n, args.duration, args.states),
                    "nvidia_smi": nvidia_smi()}
        t0 = time.monotonic()
        while replicas().get("RUNNING", 0) > 1 and time.monotonic() - t0 < args.scale_timeout:
            time.sleep(1)
        res["scale_down_s"] = round(time.monotonic() - t0, 1)
        res["after"] = replicas()
    failed = sum(r["requests"] - r["ok"] for r in [res["one"]["load"], res["n"]["load"], *ramp])
    gpus_seen = {tuple(r["gpu_ids"] or []) for r in res["n"]["replicas"]}
    res["checks"] = {
        "failed_requests": failed,
        "distinct_gpus": len(gpus_seen) == n and len(res["n"]["replicas"]) == n,
        "scaled_up": res["scale_up_s"] < args.scale_timeout,
        "scaled_down": res["after"].get("RUNNING", 0) == 1,
        "throughput_ratio": round(res["n"]["load"]["rps"] / max(1e-9, n * res["one"]["load"]["rps"]), 3),
    }
    return res


def part_offline(args, n: int, tmp: str) -> dict:
    """Part 3: the same Parquet set with 1 and n actors, then n with one actor killed mid-run."""
    import pyarrow.parquet as pq
    import ray

    from serve_app.offline import OfflineConfig, run

    data = os.path.join(tmp, "data")
    make_data(data, args.rows, max(4, 2 * n))
    base = dict(input=[data], questions=QUESTIONS, state_column="text", id_column="id",
                checkpoint=args.checkpoint, backend=args.backend, address="auto")
    res = {}
    for name, gpus in (("one", 1), ("n", n)):
        out = os.path.join(tmp, "out-%s" % name)
        res[name] = run(OfflineConfig(output=out, num_gpus=gpus, **base))
        log("offline %s: %s tokens/s after ready" % (name, res[name].get("tokens_per_s_after_ready")))
    killed = []

    def kill_one(snap):
        if killed or not snap["actors"] or snap["rows"] >= snap["rows_total"]:
            return
        info = next(iter(snap["actors"].values()))
        handle = ray._private.worker.global_worker.core_worker.get_actor_handle(ray.ActorID.from_hex(info["actor"]))
        ray.kill(handle, no_restart=False)
        killed.append(info)

    out_k = os.path.join(tmp, "out-killed")
    # smaller batches here so progress arrives (and the kill lands) while rows are still left
    small = dict(base, batch_size=max(16, min(1024, args.rows // 20)))
    res["killed"] = run(OfflineConfig(output=out_k, num_gpus=n, **small), on_progress=kill_one)
    ids_clean = sorted(pq.read_table(os.path.join(tmp, "out-n"), columns=["id"]).column("id").to_pylist())
    ids_kill = sorted(pq.read_table(out_k, columns=["id"]).column("id").to_pylist())
    t1 = res["one"].get("tokens_per_s_after_ready") or 0
    tn = res["n"].get("tokens_per_s_after_ready") or 0
    res["checks"] = {"actor_killed": bool(killed), "rows_in": args.rows, "rows_out_killed": len(ids_kill),
                     "same_ids_as_clean": ids_kill == ids_clean, "no_duplicates": len(set(ids_kill)) == len(ids_kill),
                     "throughput_ratio": round(tn / max(1e-9, n * t1), 3)}
    return res


def main(argv: list[str] | None = None) -> int:
    """Run the three parts and print the checks; exit 1 if any check failed."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--backend", default="auto")
    p.add_argument("--logical-gpus", type=int, default=None, help="rehearse on a CPU machine with N logical GPUs")
    p.add_argument("--clients", type=int, default=16, help="clients per replica")
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--scale-timeout", type=float, default=180.0)
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--states", type=int, default=8,
                   help="states per request (/v1/systemone/batch, long states); 1 = /v1/systemone, one short state")
    p.add_argument("--proxies", type=int, default=1,
                   help="Serve HTTP proxies: one per Ray node; >1 adds CPU-only nodes on this host (SO_REUSEPORT)")
    p.add_argument("--parts", default="serve,offline")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "multi_gpu.json"))
    args = p.parse_args(argv)
    # `timeout` / a job runner sends SIGTERM: unwind so every server and cluster started here is stopped
    # (their process groups outlive this one otherwise, holding the GPU and ports)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.checkpoint = os.path.abspath(args.checkpoint)
    tmp = tempfile.mkdtemp(prefix="multi-gpu-")
    proc, address, n = start_cluster(args.logical_gpus, tmp)
    procs = [proc] + [join_cpu_node(address, tmp, i) for i in range(1, args.proxies)]
    os.environ["RAY_ADDRESS"] = address
    res: dict = {"gpus": n, "address": address, "env": NV_ENV, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "states_per_request": args.states, "proxies": args.proxies, "clients_per_replica": args.clients}
    try:
        if n < 1:
            log("no GPU in the cluster: nothing to do")
            return 2
        if "serve" in args.parts:
            res["serve"] = part_serve(args, n, tmp)
        if "offline" in args.parts:
            res["offline"] = part_offline(args, n, tmp)
    finally:
        import ray

        ray.shutdown()
        for pr in reversed(procs):
            stop_group(pr, ((signal.SIGTERM, 60), (signal.SIGKILL, 10)))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(res, fh, indent=1, default=str)
    ok = True
    for part in ("serve", "offline"):
        if part in res:
            for k, v in res[part]["checks"].items():
                if isinstance(v, bool):
                    good = v
                elif k == "failed_requests":
                    good = v == 0
                elif k == "throughput_ratio":
                    good = v >= 0.9
                else:
                    good = v == args.rows
                ok &= bool(good)
                print("%-8s %-20s %-10s %s" % (part, k, v, "ok" if good else "MISSED"))
    if "serve" in res:
        for r in res["serve"]["one"]["replicas"] + res["serve"]["n"]["replicas"]:
            c = r.get("cache") or {}
            print("replica pid %-8s gpu %-6s CUDA_VISIBLE_DEVICES %-6s device %-6s load %.1fs warm-up %.1fs "
                  "ready %.1fs seeded %s published %s" % (
                      r["pid"], ",".join(r["gpu_ids"] or []) or "-", r["cuda_visible_devices"], r["device"],
                      r.get("load_s") or 0, r["warmup_s"], r["ready_s"] or 0,
                      ",".join("%s:%s" % kv for kv in (c.get("seeded") or {}).items()) or "-",
                      ",".join("%s:%s" % kv for kv in (c.get("published") or {}).items()) or "-"))
    print("wrote %s" % args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
