"""Does an Ingress replica behind HAProxy refuse requests below its declared admission? On any machine (CPU).

    python bench/ingress_admission.py --checkpoint checkpoints/tiny --out bench/results/ingress_admission_cpu.json

configs/prod.yaml admits 48 running + 16 queued requests per Ingress replica. This runs configs/local.yaml (CPU
scorer, one Ingress replica behind Ray's HAProxy ingress) with prod.yaml's Ingress bounds, then the same with
`max_queued_requests` raised to `--queued-variant`, through `bench/serve_load.py` (closed-loop clients, each with
at most one request outstanding, so N clients never hold more than N requests). A 503 at a level of at most 48
clients is a request refused while fewer than `max_ongoing_requests` were outstanding. serve_load prints the table
and writes the JSON and PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROD_INGRESS = {"max_ongoing_requests": 48, "max_queued_requests": 16}   # configs/prod.yaml's, checked below


def ingress_bounds(path: str) -> dict:
    """The Ingress deployment's admission fields in the config file at `path`."""
    with open(path, encoding="utf-8") as fh:
        deps = {d["name"]: d for d in yaml.safe_load(fh)["applications"][0]["deployments"]}
    return {k: deps["Ingress"][k] for k in PROD_INGRESS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--levels", default="16,48,64")
    p.add_argument("--duration", type=float, default=8)
    p.add_argument("--queued-variant", type=int, default=48)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.queued_variant < 1 or args.rounds < 1:
        raise SystemExit("--queued-variant and --rounds must be at least 1, got %d and %d"
                         % (args.queued_variant, args.rounds))
    started = time.time()
    shipped = ingress_bounds(os.path.join(ROOT, "configs", "prod.yaml"))
    if shipped != PROD_INGRESS:   # the experiment is about prod.yaml's bounds: follow them if they change
        raise SystemExit("configs/prod.yaml's Ingress bounds are now %s; update PROD_INGRESS" % shipped)
    with open(os.path.join(ROOT, "configs", "local.yaml"), encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    for d in cfg["applications"][0]["deployments"]:
        if d["name"] == "Ingress":
            d.update(PROD_INGRESS)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "local-with-prod-ingress-bounds.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(cfg, fh, sort_keys=False)
        cmd = [sys.executable, os.path.join(ROOT, "bench", "serve_load.py"), "--checkpoint", args.checkpoint,
               "--backend", "eager", "--device", "cpu", "--config", path, "--levels", args.levels,
               "--duration", str(args.duration), "--warmup", "2", "--rounds", str(args.rounds),
               "--deployment-variant", "Ingress.max_queued_requests=%d" % args.queued_variant, "--out", args.out]
        rc = subprocess.call(cmd)
    if rc != 1 or not os.path.exists(args.out) or os.path.getmtime(args.out) < started:
        raise SystemExit(rc)
    # serve_load exits 1 when any request failed: 503s with Retry-After are what is measured here, anything else
    # (a 500, a 503 without the header, a refused connection) is a failed run
    other = other_errors(args.out)
    if other:
        raise SystemExit("errors other than 503 + Retry-After: %s" % other)


def other_errors(path: str) -> dict:
    """Errors in serve_load's result at `path` other than the replicas' 503 + Retry-After, summed by kind."""
    with open(path, encoding="utf-8") as fh:
        res = json.load(fh)
    out: dict[str, int] = {}
    for rows in res["results"].values():
        for r in rows:
            for kind, n in r["errors"].items():
                if kind != "503":
                    out[kind] = out.get(kind, 0) + n
    return out


if __name__ == "__main__":
    main()
