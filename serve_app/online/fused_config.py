"""Serve configs turned to the fused topology: `python -m serve_app.app fused CONFIG [options]` prints one.

`fused_config` rewrites a split config (CPU ingress replicas calling GPU scorer replicas) so that one
deployment, `Ingress`, holds the scorer in each replica and takes the scorer's user_config, limits and
replica count; `main` is the command line that prints the result with a header saying where it came from.
"""


def fused_config(config: dict, app_name: str | None = None, replicas_per_gpu: int = 1,
                 gil_switch_interval_s: float | None = None, direct_ingress: bool = False) -> dict:
    """A Serve config (as `serve run` reads it) turned to `topology: fused`, in place: the app's args get
    `topology: fused`, its `Scorer` deployment entry (the default checkpoint's) goes, and that entry's
    `user_config`, request limits, health check period and replica count (`num_replicas` or
    `autoscaling_config`, replacing the ingress's own) move to the `Ingress` entry (one replica per GPU), with
    its health check timeout and graceful shutdown (a replica now drains a batcher); the other checkpoints'
    `Scorer-<name>` entries stay. Returns `config`; ValueError for anything that is not a Serve config with an
    applications list.

    `replicas_per_gpu` > 1 shares each GPU between that many replicas: the scorer's `num_gpus` and `num_cpus`
    are divided by it and every deployment's replica counts multiplied (one process's HTTP handling and
    batching is what limits a fused replica: BENCHMARKS.md, "HTTP serving"). `gil_switch_interval_s` sets the
    scorer's `gil_switch_interval_s` (a fused replica's event loop is always busy, and the forward thread waits
    for the GIL after every device wait); `direct_ingress` sets RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in the app's
    runtime_env (the fused replicas then serve HTTP themselves, which is where its latency comes from)."""
    apps = config.get("applications") if isinstance(config, dict) else None
    if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
        raise ValueError("fused_config needs a Serve config with an 'applications' list (as `serve run` reads it)")
    k = int(replicas_per_gpu)
    if k < 1 or k != replicas_per_gpu:
        raise ValueError("replicas_per_gpu must be a whole number >= 1, got %r" % (replicas_per_gpu,))
    for app in apps:
        if app_name is not None and app.get("name") != app_name:
            continue
        args = app.setdefault("args", {})
        args["topology"] = "fused"
        deps = app.setdefault("deployments", [])
        scorer = next((d for d in deps if d.get("name") == "Scorer"), {})
        ingress = next((d for d in deps if d.get("name") == "Ingress"), None)
        if ingress is None:
            ingress = {"name": "Ingress"}
            deps.append(ingress)
        if "num_replicas" in scorer or "autoscaling_config" in scorer:
            for key in ("num_replicas", "autoscaling_config"):  # the replica count is the scorer's (one per GPU)
                ingress.pop(key, None)
        for key in ("user_config", "max_ongoing_requests", "max_queued_requests", "autoscaling_config",
                    "num_replicas", "health_check_period_s", "health_check_timeout_s",
                    "graceful_shutdown_wait_loop_s", "graceful_shutdown_timeout_s"):
            if key in scorer:
                ingress[key] = scorer[key]
        app["deployments"] = [d for d in deps if d.get("name") != "Scorer"]
        sc = args.setdefault("scorer", {})
        if k > 1:
            sc["num_gpus"] = sc.get("num_gpus", 0) / k
            sc["num_cpus"] = sc.get("num_cpus", 1) / k
            for d in app["deployments"]:  # the Ingress and the other checkpoints' scorers share the resources
                _multiply_replicas(d, k)
        if gil_switch_interval_s is not None:
            sc["gil_switch_interval_s"] = gil_switch_interval_s
        if direct_ingress:
            app.setdefault("runtime_env", {}).setdefault("env_vars", {})["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
    return config


def _multiply_replicas(d: dict, k: int) -> None:
    """A deployment entry's replica counts (fixed or autoscaled), times `k`, in place."""
    if isinstance(d.get("num_replicas"), int):
        d["num_replicas"] *= k
    auto = d.get("autoscaling_config")
    if isinstance(auto, dict):
        d["autoscaling_config"] = auto = dict(auto)
        for key in ("min_replicas", "max_replicas", "initial_replicas"):
            if isinstance(auto.get(key), int):
                auto[key] *= k


def fused_header(src: str, command: str, replicas_per_gpu: int, direct_ingress: bool) -> str:
    """The comment block on top of a generated fused config: where it came from and what it is."""
    lines = ["Generated from %s by `%s`." % (src, command),
             "`topology: fused`: one deployment whose replicas serve HTTP and hold a scorer (no process hop)%s."
             % (", %d replicas sharing each GPU" % replicas_per_gpu if replicas_per_gpu > 1 else "")]
    if direct_ingress:
        lines.append("Direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1): each replica serves HTTP on a port of its "
                     "own; put a balancer over them (docs/serving.md).")
    lines.append("Edit %s, then regenerate; the comments there explain each field." % src)
    return "".join("# %s\n" % line for line in lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m serve_app.app fused CONFIG [--replicas-per-gpu K] [--gil-switch-interval S] [--direct-ingress]`:
    print CONFIG turned to the fused topology (fused_config) as YAML."""
    import argparse

    import yaml

    ap = argparse.ArgumentParser(prog="python -m serve_app.app")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fused", help="print a Serve config turned to topology: fused")
    f.add_argument("config")
    f.add_argument("--replicas-per-gpu", type=int, default=1)
    f.add_argument("--gil-switch-interval", type=float, default=None)
    f.add_argument("--direct-ingress", action="store_true")
    a = ap.parse_args(argv)
    try:
        with open(a.config, encoding="utf-8") as fh:
            cfg = yaml.safe_load(fh)
        fused_config(cfg, replicas_per_gpu=a.replicas_per_gpu, gil_switch_interval_s=a.gil_switch_interval,
                     direct_ingress=a.direct_ingress)
    except OSError as e:
        ap.error("cannot read %s: %s" % (a.config, e.strerror or e))
    except yaml.YAMLError as e:
        ap.error("%s is not YAML: %s" % (a.config, str(e).splitlines()[0]))
    except ValueError as e:
        ap.error("%s: %s" % (a.config, e))
    command = "python -m serve_app.app fused %s%s%s%s" % (
        a.config, " --replicas-per-gpu %d" % a.replicas_per_gpu if a.replicas_per_gpu != 1 else "",
        "" if a.gil_switch_interval is None else " --gil-switch-interval %g" % a.gil_switch_interval,
        " --direct-ingress" if a.direct_ingress else "")
    print(fused_header(a.config, command, a.replicas_per_gpu, a.direct_ingress)
          + yaml.safe_dump(cfg, sort_keys=False, width=110), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
