"""Host CPU per request of configs/prod.yaml's Ingress replica, the model left out: the file as shipped against
variants of it, alternated in pairs on one machine (no GPU needed).

Each server is prod.yaml as `bench/serve_load.py --config` runs it (HAProxy ingress, the cluster environment
its header names, with HAProxy's busy polling off: on a small machine its polling core would take the load
generator's) with only what a CPU machine needs changed: no GPU or CPU reservations, one Ingress replica, and
the forward skipped (`bench.serve_floor_app:SkipForward`), so the replica's CPU is the request path's alone.
A variant is `NAME=PATH:VALUE`, a YAML path into the application's Ingress deployment set to VALUE (JSON), or
`NAME=PATH:-` to delete it; `logging_config:-` is the Ingress replicas at the app's INFO. Prints, per server,
the ingress replica's cores, requests/s and milliseconds of CPU per request over every pair, writes JSON and a
PNG.

    python bench/host_cpu.py --pairs 3 --variant "info=logging_config:-" --out bench/results/host_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))
import serve_load  # noqa: E402  (bench/serve_load.py, the load generator and server runner)


def cpu_config(base: dict, variant: tuple[str, str] | None) -> dict:
    """prod.yaml for a CPU machine (one Ingress replica, no reservations, the forward skipped), `variant`
    (path, JSON value or "-") applied to its Ingress deployment."""
    cfg = json.loads(json.dumps(base))
    app = cfg["applications"][0]
    args = app["args"]
    args.setdefault("scorer", {}).update(num_gpus=0, num_cpus=0)
    args.setdefault("ingress", {})["num_cpus"] = 0
    args["backend_wrapper"] = "bench.serve_floor_app:SkipForward"
    ing = next(d for d in app["deployments"] if d["name"] == "Ingress")
    ing["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    if variant:
        path, value = variant
        keys = path.split(".")
        node = ing
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value == "-":
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = json.loads(value)
    return cfg


def run_one(cfg: dict, name: str, args, scratch: str) -> dict:
    path = os.path.join(scratch, "%s.yaml" % name)
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(cfg, fh, sort_keys=False)
    out = os.path.join(scratch, "%s.json" % name)
    rc = serve_load.main(["--checkpoint", args.checkpoint, "--backend", "eager", "--device", "cpu", "--config", path,
                          "--levels", str(args.clients), "--duration", str(args.duration), "--warmup",
                          str(args.warmup), "--cluster-env", "LAYA_FLEET_HAPROXY_BUSY_POLLING=0", "--out", out])
    with open(out, encoding="utf-8") as fh:
        row = next(iter(json.load(fh)["results"].values()))[0]
    cores = row["cpu_cores"].get("ingress", 0.0)
    return {"failed_requests": rc != 0, "errors": row["errors"], "rps": row["rps"], "p50_ms": row["p50_ms"],
            "p99_ms": row["p99_ms"], "ingress_cores": cores,
            "cpu_ms_per_request": round(1000.0 * cores / max(row["rps"], 1e-9), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(REPO, "configs", "prod.yaml"))
    p.add_argument("--checkpoint", default=os.path.join(REPO, "checkpoints", "tiny"))
    p.add_argument("--variant", action="append", default=[], metavar="NAME=PATH:VALUE")
    p.add_argument("--pairs", type=int, default=3, help="rounds of (shipped, each variant), alternated")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=12.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results", "host_cpu.json"))
    args = p.parse_args(argv)
    with open(args.config, encoding="utf-8") as fh:
        base = yaml.safe_load(fh)
    servers: dict[str, tuple[str, str] | None] = {"shipped": None}
    for v in args.variant:
        name, _, spec = v.partition("=")
        path, _, value = spec.partition(":")
        if not name or not path or not value:
            p.error("--variant must look like NAME=PATH:VALUE, got %r" % v)
        if value != "-":
            try:
                json.loads(value)
            except ValueError as e:
                p.error("--variant %r: VALUE must be JSON or '-' (%s)" % (v, e))
        servers[name] = (path, value)
    runs: dict[str, list[dict]] = {n: [] for n in servers}
    with tempfile.TemporaryDirectory(prefix="laya-fleet-host-cpu-") as scratch:
        for i in range(args.pairs):
            for name, variant in servers.items():
                runs[name].append(run_one(cpu_config(base, variant), "%s%d" % (name, i), args, scratch))
    summary = {n: {"cpu_ms_per_request": round(statistics.mean(r["cpu_ms_per_request"] for r in rs), 4),
                   "rps": round(statistics.mean(r["rps"] for r in rs), 1),
                   "cpu_ms_spread": [min(r["cpu_ms_per_request"] for r in rs),
                                     max(r["cpu_ms_per_request"] for r in rs)]}
               for n, rs in runs.items()}
    print("%-12s %22s %12s  (each of %d runs: ms)" % ("server", "ingress CPU ms/request", "req/s", args.pairs))
    for n, s in summary.items():
        print("%-12s %22.3f %12.1f  %s" % (n, s["cpu_ms_per_request"], s["rps"],
                                           " ".join("%.3f" % r["cpu_ms_per_request"] for r in runs[n])))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump({"clients": args.clients, "duration_s": args.duration, "variants": {k: v for k, v in servers.items()},
                   "runs": runs, "summary": summary, "environment": serve_load.environment(args.checkpoint, "eager")},
                  fh, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (n, rs) in enumerate(runs.items()):
        ax.plot([i] * len(rs), [r["cpu_ms_per_request"] for r in rs], "o", alpha=0.6)
        ax.bar(i, summary[n]["cpu_ms_per_request"], alpha=0.3)
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_ylabel("ingress CPU ms per request (forward skipped)")
    ax.set_title("prod.yaml's Ingress replica, %d clients, CPU machine" % args.clients, fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=120)
    print("wrote %s" % args.out)
    failed = [n for n, rs in runs.items() if any(r["failed_requests"] for r in rs)]
    if failed:
        print("requests failed in: %s (see the JSON's errors)" % ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
