"""configs/local.yaml and configs/prod.yaml parse as Serve configs and as our builder's typed args; fused_config."""

from __future__ import annotations

import os

import pytest
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import AppArgs, build_app
from serve_app.online.haproxy_launcher import GPU_NODE_ENV
from serve_app.online.scorer_deployment import BatchingPolicy

from .serve_helpers import REPO, deployment, load_config


def _check_common(cfg: dict) -> tuple[dict, AppArgs]:
    ServeDeploySchema.model_validate(cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    args = AppArgs.model_validate(app["args"])
    for d in app["deployments"]:
        assert "ray_actor_options" not in d  # resources come from args (Serve would replace them whole)
    # Serve's request path (user code and router on the replica's loop, gRPC handle calls; docs/serving.md), so
    # the suite, which deploys local.yaml, exercises what prod runs
    env = app["runtime_env"]["env_vars"]
    assert {k: env.get(k) for k in ("RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
                                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")} == {
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    # HAProxy belongs to the cluster's environment: in an app's runtime_env it would reach the replicas only
    assert not any(k.startswith("RAY_SERVE_ENABLE_HA_PROXY") or k.startswith("RAY_SERVE_HAPROXY") for k in env)
    return app, args


def test_local_yaml_is_the_split_laptop_default():
    app, args = _check_common(load_config("local.yaml"))
    cfg = load_config("local.yaml")
    scorer, ingress = deployment(app, "Scorer"), deployment(app, "Ingress")
    BatchingPolicy.model_validate(scorer["user_config"])
    for d in (scorer, ingress):
        assert 0 < d["max_queued_requests"] and d["max_ongoing_requests"] >= 256
    assert ingress["backpressure_config"]["retry_after_s"] >= 1
    assert cfg["http_options"]["host"] == "127.0.0.1" and args.checkpoint == "checkpoints/tiny"
    # two tiny checkpoints, so routing runs on a laptop; the second scales to zero when idle
    assert args.served() == {"english": "checkpoints/tiny", "multilingual": "checkpoints/tiny-multilingual"}
    ml = deployment(app, "Scorer-multilingual")
    BatchingPolicy.model_validate(ml["user_config"])
    assert ml["autoscaling_config"]["min_replicas"] == 0 and ml["autoscaling_config"]["initial_replicas"] == 1
    assert args.topology == "split" and not args.haproxy
    assert args.scorer.num_gpus == 0 and args.device == "cpu" and args.api_key_env is None
    assert 2 * args.scorer.num_cpus + args.ingress.num_cpus <= 2  # schedules on a 2-core laptop


def test_prod_yaml_is_fused_three_per_gpu_behind_haproxy_with_bounded_admission():
    cfg = load_config("prod.yaml")
    app, args = _check_common(cfg)
    ingress, *scorers = app["deployments"]
    assert ingress["name"] == "Ingress" and args.topology == "fused" and args.haproxy
    # upstream's three checkpoints: the default warm in the fused replicas, the other two scaled to zero when idle
    assert list(args.served()) == ["english", "multilingual", "typed-decisions"]
    assert [d["name"] for d in scorers] == ["Scorer-multilingual", "Scorer-typed-decisions"]
    for d in scorers:
        BatchingPolicy.model_validate(d["user_config"])
        assert d["autoscaling_config"]["min_replicas"] == 0 < d["autoscaling_config"]["max_replicas"]
        assert d["autoscaling_config"]["policy"] == ingress["autoscaling_config"]["policy"]
    BatchingPolicy.model_validate(ingress["user_config"])
    per_gpu = round(1 / args.scorer.num_gpus)
    assert per_gpu == 3 and per_gpu * args.scorer.num_gpus <= 1.0  # three replicas fit on each GPU
    assert args.scorer.gil_switch_interval_s and args.device == "auto" and args.backend == "auto"
    assert args.api_key_env == "LAYA_FLEET_API_KEY" and not args.docs
    # admission: a replica takes a bounded number of requests and refuses the rest at once with Retry-After
    admitted = ingress["max_ongoing_requests"] + ingress["max_queued_requests"]
    assert 16 <= ingress["max_ongoing_requests"] and admitted <= 128
    assert ingress["backpressure_config"] == {"status_code": 503, "retry_after_s": 1}
    auto = ingress["autoscaling_config"]
    assert auto["min_replicas"] == per_gpu and auto["max_replicas"] % per_gpu == 0
    # the autoscaling target is reachable under the admission bound (a target above it would never scale up)
    assert 0 < auto["target_ongoing_requests"] < ingress["max_ongoing_requests"]
    assert auto["policy"]["policy_function"] == "serve_app.autoscale:pending_requests_policy"
    assert auto["upscale_delay_s"] > 0 and auto["downscale_delay_s"] > auto["upscale_delay_s"]
    assert cfg["http_options"]["port"] == 8000 and cfg["proxy_location"] == "EveryNode"
    assert app["runtime_env"]["env_vars"]["LAYA_FLEET_CACHE_DIR"] and args.cache_dir is None
    # the header says how to start the cluster: the variables and the launcher pyproject installs
    with open(os.path.join(REPO, "configs", "prod.yaml"), encoding="utf-8") as fh:
        header = fh.read().split("proxy_location")[0]
    assert "RAY_SERVE_ENABLE_HA_PROXY=1" in header and "RAY_SERVE_HAPROXY_BINARY_PATH" in header
    assert all("%s=%s" % kv in header for kv in GPU_NODE_ENV.items())  # the environment the benchmarks ran
    with open(os.path.join(REPO, "pyproject.toml"), encoding="utf-8") as fh:
        assert 'laya-fleet-haproxy = "serve_app.haproxy:main"' in fh.read()


def test_builder_warns_once_when_the_app_expects_haproxy_and_the_cluster_lacks_it(monkeypatch, caplog):
    import logging

    monkeypatch.delenv("RAY_SERVE_ENABLE_HA_PROXY", raising=False)
    with caplog.at_level(logging.WARNING, logger="serve_app.online.app"):
        build_app({"checkpoint": "/nonexistent/ckpt", "haproxy": True, "topology": "fused"})
    warned = [r for r in caplog.records if "HAProxy" in r.getMessage()]
    assert len(warned) == 1 and "RAY_SERVE_ENABLE_HA_PROXY=1" in warned[0].getMessage()
    caplog.clear()
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "1")
    with caplog.at_level(logging.WARNING, logger="serve_app.online.app"):
        build_app({"checkpoint": "/nonexistent/ckpt", "haproxy": True, "topology": "fused"})
        build_app({"checkpoint": "/nonexistent/ckpt"})
    assert not [r for r in caplog.records if "HAProxy" in r.getMessage()]


def test_builder_rejects_unknown_or_invalid_args():
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"checkpoint": "x", "scorer": {"num_gpu": 1}})
    with pytest.raises(ValidationError):
        BatchingPolicy.model_validate({"max_batch_tokens": 8})
    with pytest.raises(ValidationError):
        BatchingPolicy.model_validate({"batch_wait_s": 0.1})
    for bad in ({"scorer": {"gil_switch_interval_s": 0}}, {"scorer": {"gil_switch_interval_s": 1.0}},
                {"ingress": {"max_inflight_calls": 0}}, {"ingress": {"max_call_tokens": 0}}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(dict(bad, checkpoint="x"))
    ok = AppArgs.model_validate({"checkpoint": "x", "scorer": {"gil_switch_interval_s": 0.0005}})
    assert ok.scorer.gil_switch_interval_s == 0.0005 and ok.ingress.max_inflight_calls == 4


def test_builder_binds_the_ingress_to_a_scorer_or_fuses_them_with_the_args_resources():
    from ray.serve import Application

    from serve_app.online.fused_ingress import FusedIngress
    from serve_app.online.ingress import Ingress
    from serve_app.online.scorer_deployment import ScorerDeployment

    policy = {"max_batch_tokens": 4096, "max_batch_rows": None, "batch_wait_timeout_s": 0.0}
    args = {"checkpoint": "/nonexistent/ckpt", "scorer": {"num_gpus": 1, "num_cpus": 2}, "batching": policy,
            "ingress": {"num_cpus": 0.25, "max_call_tokens": 1000}, "api_key_env": "KEY"}
    # split: the ingress (its own CPUs) gets a handle to the scorer (the GPU, the batching policy as user_config)
    ingress = build_app(args)._bound_deployment
    assert ingress.name == "Ingress" and ingress.func_or_class is Ingress.func_or_class
    assert ingress.ray_actor_options == {"num_cpus": 0.25}
    handle, checkpoint = ingress.init_args
    assert checkpoint == "/nonexistent/ckpt" and isinstance(handle, Application)
    assert ingress.init_kwargs["api_key_env"] == "KEY" and ingress.init_kwargs["max_call_tokens"] == 1000
    scorer = handle._bound_deployment
    assert scorer.name == "Scorer" and scorer.func_or_class is ScorerDeployment.func_or_class
    assert scorer.ray_actor_options == {"num_cpus": 2, "num_gpus": 1} and scorer.user_config == policy
    assert scorer.init_kwargs["checkpoint"] == "/nonexistent/ckpt" and scorer.init_kwargs["batching"] == policy
    # fused: one deployment holding the scorer, with the scorer's GPU and both CPU shares
    fused = build_app(dict(args, topology="fused"))._bound_deployment
    assert fused.name == "Ingress" and fused.func_or_class is FusedIngress.func_or_class
    assert fused.ray_actor_options == {"num_cpus": 2.25, "num_gpus": 1} and fused.user_config == policy
    scorer_kwargs, checkpoint = fused.init_args
    assert scorer_kwargs == scorer.init_kwargs and checkpoint == "/nonexistent/ckpt"
    assert fused.init_kwargs == ingress.init_kwargs


def _split_gpu_config() -> dict:
    """local.yaml made a GPU fleet's split config: one scorer replica per GPU, autoscaled 1..8."""
    cfg = load_config("local.yaml")
    app = cfg["applications"][0]
    app["args"]["scorer"] = {"num_gpus": 1, "num_cpus": 4}
    scorer = deployment(app, "Scorer")
    scorer.pop("num_replicas")
    scorer["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 128}
    return cfg


@pytest.mark.parametrize("name", ["local.yaml", "split-gpu"])
def test_fused_config_keeps_the_scorer_settings_on_the_one_deployment(name):
    from serve_app.app import fused_config

    def load():
        return load_config(name) if name.endswith(".yaml") else _split_gpu_config()

    cfg = load()
    scorer = dict(deployment(cfg["applications"][0], "Scorer"))
    fused = fused_config(load())
    ServeDeploySchema.model_validate(fused)
    (app,) = fused["applications"]
    assert AppArgs.model_validate(app["args"]).topology == "fused"
    only, *others = app["deployments"]  # the other checkpoints' scorers stay as they were
    assert only["name"] == "Ingress"
    assert others == [d for d in load()["applications"][0]["deployments"] if d["name"].startswith("Scorer-")]
    for key in ("user_config", "max_ongoing_requests", "max_queued_requests", "autoscaling_config",
                "health_check_timeout_s", "graceful_shutdown_timeout_s"):
        assert only.get(key) == scorer.get(key), key
    assert not ("autoscaling_config" in only and "num_replicas" in only)
    # a fixed scorer count replaces an autoscaled ingress (one replica per GPU either way)
    cfg = _split_gpu_config()
    app = cfg["applications"][0]
    deployment(app, "Ingress")["autoscaling_config"] = {"min_replicas": 1, "max_replicas": 4}
    deployment(app, "Ingress").pop("num_replicas", None)
    deployment(app, "Scorer").pop("autoscaling_config")
    deployment(app, "Scorer")["num_replicas"] = 2
    only = fused_config(cfg)["applications"][0]["deployments"][0]
    assert only["num_replicas"] == 2 and "autoscaling_config" not in only


def test_fused_config_refuses_what_is_not_a_serve_config():
    from serve_app.app import fused_config

    for bad in ({}, {"applications": "laya"}, {"applications": [1]}, []):
        with pytest.raises(ValueError, match="applications"):
            fused_config(bad)


def test_fused_config_shares_each_gpu_between_replicas():
    from serve_app.app import fused_config

    cfg = fused_config(_split_gpu_config(), replicas_per_gpu=2, gil_switch_interval_s=0.0001,
                       direct_ingress=True)
    ServeDeploySchema.model_validate(cfg)
    (app,) = cfg["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.scorer.num_gpus == 0.5 and args.scorer.num_cpus == 2 and args.scorer.gil_switch_interval_s == 0.0001
    only = app["deployments"][0]
    scorer_auto = deployment(_split_gpu_config()["applications"][0], "Scorer")["autoscaling_config"]
    assert only["autoscaling_config"]["min_replicas"] == 2 * scorer_auto["min_replicas"]
    assert only["autoscaling_config"]["max_replicas"] == 2 * scorer_auto["max_replicas"]
    assert app["runtime_env"]["env_vars"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    local = load_config("local.yaml")
    deployment(local["applications"][0], "Scorer")["num_replicas"] = 1
    only, ml = fused_config(local, replicas_per_gpu=3)["applications"][0]["deployments"]
    assert only["num_replicas"] == 3 and ml["autoscaling_config"]["max_replicas"] == 3
    for bad in (0, 1.5, -1):
        with pytest.raises(ValueError, match="replicas_per_gpu"):
            fused_config(_split_gpu_config(), replicas_per_gpu=bad)


@pytest.mark.parametrize("content, fragment", [(None, "cannot read"), ("a: [b", "is not YAML"),
                                               ("applications: laya", "applications")])
def test_fused_command_answers_bad_input_with_a_clear_error(tmp_path, capsys, content, fragment):
    from serve_app.app import main

    path = tmp_path / "cfg.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as e:
        main(["fused", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_fused_command_refuses_zero_replicas_per_gpu(capsys):
    import os

    from serve_app.app import main

    local = os.path.join(REPO, "configs", "local.yaml")
    with pytest.raises(SystemExit) as e:
        main(["fused", local, "--replicas-per-gpu", "0"])
    assert e.value.code == 2 and "replicas_per_gpu must be a whole number" in capsys.readouterr().err


def test_args_name_several_checkpoints_and_the_single_form_keeps_its_meaning():
    single = AppArgs.model_validate({"checkpoint": "ckpt/a"})
    assert single.served() == {"english": "ckpt/a"}
    named = AppArgs.model_validate({"checkpoint": "ckpt/a", "default_checkpoint": "Typed-Decisions",
                                    "checkpoints": {"multilingual": "ckpt/b", "Papers": "ckpt/c"}})
    assert named.served() == {"typed-decisions": "ckpt/a", "multilingual": "ckpt/b", "papers": "ckpt/c"}
    # the default may be named among the others instead of by `checkpoint`
    only = AppArgs.model_validate({"checkpoints": {"english": "ckpt/a", "multilingual": "ckpt/b"}})
    assert list(only.served()) == ["english", "multilingual"]
    for bad in ({"checkpoints": {"multilingual": "ckpt/b"}},  # no directory for the default
                {"checkpoint": "ckpt/a", "checkpoints": {"english": "ckpt/z"}},  # two for the default
                {"checkpoint": "ckpt/a", "checkpoints": {"a/b": "ckpt/b"}},  # a path is not a name
                {"checkpoint": "ckpt/a", "checkpoints": {"Papers": "ckpt/b", "papers": "ckpt/c"}},
                {"checkpoint": "ckpt/a", "checkpoints": {"papers": ""}}):
        with pytest.raises(ValidationError):
            AppArgs.model_validate(bad)


def test_builder_gives_each_checkpoint_a_scorer_deployment_and_fused_replicas_hold_the_default():
    from serve_app.online.checkpoints import deployment_name

    assert deployment_name("english", "english") == "Scorer"
    assert deployment_name("typed-decisions", "english") == "Scorer-typed-decisions"
    args = {"checkpoint": "/nonexistent/en", "checkpoints": {"multilingual": "/nonexistent/ml"},
            "scorer": {"num_gpus": 0.5}}
    for topology in ("split", "fused"):
        ingress = build_app(dict(args, topology=topology))._bound_deployment
        kw = ingress.init_kwargs
        assert kw["default"] == "english" and list(kw["others"]) == ["multilingual"]
        assert kw["others"]["multilingual"]["checkpoint"] == "/nonexistent/ml" and kw["device_preference"] == "cuda"
        ml = kw["others"]["multilingual"]["scorer"]._bound_deployment
        assert ml.name == "Scorer-multilingual" and ml.init_kwargs["checkpoint"] == "/nonexistent/ml"
        assert ml.ray_actor_options["num_gpus"] == 0.5
    assert ingress.init_args[1] == "/nonexistent/en"  # the fused replica's own scorer: the default's
    assert build_app(args)._bound_deployment.init_args[0]._bound_deployment.name == "Scorer"


def test_laya_api_key_requires_a_bearer_unless_api_key_env_names_another_variable(monkeypatch):
    from starlette.requests import Request

    from serve_app.online.auth import BearerAuth

    def req(value: str | None) -> Request:
        headers = [] if value is None else [(b"authorization", value.encode("utf-8"))]
        return Request({"type": "http", "headers": headers})

    monkeypatch.delenv("LAYA_API_KEY", raising=False)
    assert not BearerAuth(None) and BearerAuth(None).authorized(req(None))
    monkeypatch.setenv("LAYA_API_KEY", "")  # empty: upstream reads it as unset
    assert not BearerAuth(None)
    monkeypatch.setenv("LAYA_API_KEY", "up-key")
    auth = BearerAuth(None)
    assert auth.source == "LAYA_API_KEY" and auth.authorized(req("Bearer up-key"))
    assert not auth.authorized(req(None)) and not auth.authorized(req("Bearer other"))
    monkeypatch.setenv("OUR_KEY", "our-key")  # api_key_env wins over LAYA_API_KEY
    ours = BearerAuth("OUR_KEY")
    assert ours.source == "OUR_KEY" and ours.authorized(req("Bearer our-key")) and not ours.authorized(
        req("Bearer up-key"))
    with pytest.raises(RuntimeError, match="MISSING_KEY"):
        BearerAuth("MISSING_KEY")
    # a non-ASCII key: as UTF-8 bytes, or as upstream's client (urllib) writes it, latin-1
    monkeypatch.setenv("LAYA_API_KEY", "k\u00e9y")
    auth = BearerAuth(None)
    for raw in ("Bearer k\u00e9y".encode("utf-8"), "Bearer k\u00e9y".encode("latin-1")):
        assert auth.authorized(Request({"type": "http", "headers": [(b"authorization", raw)]}))
    assert not auth.authorized(Request({"type": "http", "headers": [(b"authorization", b"Bearer key")]}))
