"""configs/local.yaml and configs/prod.yaml parse as Serve configs and as our builder's typed args."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from serve_app.app import AppArgs, build_app
from serve_app.scorer_deployment import BatchingPolicy

from .serve_helpers import deployment, load_config


@pytest.mark.parametrize("name", ["local.yaml", "prod.yaml"])
def test_config_parses_as_serve_schema_and_typed_args(name):
    cfg = load_config(name)
    ServeDeploySchema.model_validate(cfg)
    (app,) = cfg["applications"]
    assert app["import_path"] == "serve_app.app:build_app"
    args = AppArgs.model_validate(app["args"])
    scorer, ingress = deployment(app, "Scorer"), deployment(app, "Ingress")
    BatchingPolicy.model_validate(scorer["user_config"])
    for d in (scorer, ingress):
        assert "ray_actor_options" not in d  # resources come from args (Serve would replace them whole)
        assert 0 < d["max_queued_requests"] and d["max_ongoing_requests"] >= 256
    assert ingress["backpressure_config"]["retry_after_s"] >= 1
    # both run Serve's faster request path (gRPC between deployments, no thread hops; docs/serving.md), so the
    # suite, which deploys local.yaml, exercises what prod runs
    env = app["runtime_env"]["env_vars"]
    assert {k: env.get(k) for k in ("RAY_SERVE_USE_GRPC_BY_DEFAULT", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
                                    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP")} == {
        "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
    if name == "local.yaml":
        assert cfg["http_options"]["host"] == "127.0.0.1" and args.checkpoint == "checkpoints/tiny"
        assert args.scorer.num_gpus == 0 and args.device == "cpu" and args.api_key_env is None
        assert args.scorer.num_cpus + args.ingress.num_cpus <= 2  # schedules on a 2-core laptop
    else:
        assert args.scorer.num_gpus == 1 and args.device == "auto" and args.api_key_env == "LAYA_FLEET_API_KEY"
        auto = scorer["autoscaling_config"]
        assert auto["min_replicas"] == 1 and auto["max_replicas"] >= 1 and auto["target_ongoing_requests"] > 0
        assert auto["upscale_delay_s"] > 0 and auto["downscale_delay_s"] > auto["upscale_delay_s"]
        assert "autoscaling_config" in ingress and "num_replicas" not in scorer
        assert app["runtime_env"]["env_vars"]["LAYA_FLEET_CACHE_DIR"] and args.cache_dir is None


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
    app = build_app({"checkpoint": "/nonexistent/ckpt", "scorer": {"num_gpus": 1}})
    assert type(app).__name__ == "Application"


@pytest.mark.parametrize("name", ["local.yaml", "prod.yaml"])
def test_fused_config_keeps_the_scorer_settings_on_the_one_deployment(name):
    from serve_app.app import fused_config

    cfg = load_config(name)
    scorer = dict(deployment(cfg["applications"][0], "Scorer"))
    fused = fused_config(load_config(name))
    ServeDeploySchema.model_validate(fused)
    (app,) = fused["applications"]
    assert AppArgs.model_validate(app["args"]).topology == "fused"
    (only,) = app["deployments"]
    assert only["name"] == "Ingress"
    for key in ("user_config", "max_ongoing_requests", "max_queued_requests", "autoscaling_config",
                "health_check_timeout_s", "graceful_shutdown_timeout_s"):
        assert only.get(key) == scorer.get(key), key
    assert not ("autoscaling_config" in only and "num_replicas" in only)
    # a fixed scorer count replaces an autoscaled ingress (one replica per GPU either way)
    cfg = load_config("prod.yaml")
    app = cfg["applications"][0]
    deployment(app, "Scorer").pop("autoscaling_config")
    deployment(app, "Scorer")["num_replicas"] = 2
    (only,) = fused_config(cfg)["applications"][0]["deployments"]
    assert only["num_replicas"] == 2 and "autoscaling_config" not in only


def test_fused_config_refuses_what_is_not_a_serve_config():
    from serve_app.app import fused_config

    for bad in ({}, {"applications": "laya"}, {"applications": [1]}, []):
        with pytest.raises(ValueError, match="applications"):
            fused_config(bad)


def test_fused_config_shares_each_gpu_between_replicas():
    from serve_app.app import fused_config

    cfg = fused_config(load_config("prod.yaml"), replicas_per_gpu=2, gil_switch_interval_s=0.0001,
                       direct_ingress=True)
    ServeDeploySchema.model_validate(cfg)
    (app,) = cfg["applications"]
    args = AppArgs.model_validate(app["args"])
    assert args.scorer.num_gpus == 0.5 and args.scorer.num_cpus == 2 and args.scorer.gil_switch_interval_s == 0.0001
    (only,) = app["deployments"]
    scorer_auto = deployment(load_config("prod.yaml")["applications"][0], "Scorer")["autoscaling_config"]
    assert only["autoscaling_config"]["min_replicas"] == 2 * scorer_auto["min_replicas"]
    assert only["autoscaling_config"]["max_replicas"] == 2 * scorer_auto["max_replicas"]
    assert app["runtime_env"]["env_vars"]["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    local = load_config("local.yaml")
    deployment(local["applications"][0], "Scorer")["num_replicas"] = 1
    (only,) = fused_config(local, replicas_per_gpu=3)["applications"][0]["deployments"]
    assert only["num_replicas"] == 3
    for bad in (0, 1.5, -1):
        with pytest.raises(ValueError, match="replicas_per_gpu"):
            fused_config(load_config("prod.yaml"), replicas_per_gpu=bad)


def test_prod_fused_yaml_is_what_the_generator_makes_of_prod_yaml(monkeypatch, capsys):
    """configs/prod-fused.yaml is generated (its header says how): it must not drift from prod.yaml."""
    import os

    from serve_app.app import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    with open(os.path.join(root, "configs", "prod-fused.yaml"), encoding="utf-8") as fh:
        committed = fh.read()
    cmd = committed.split("`")[1].split()  # the command in the header's first line
    assert cmd[:3] == ["python", "-m", "serve_app.app"]
    assert main(cmd[3:]) == 0
    assert capsys.readouterr().out == committed, "regenerate configs/prod-fused.yaml: " + " ".join(cmd)
    cfg = load_config("prod-fused.yaml")
    ServeDeploySchema.model_validate(cfg)
    args = AppArgs.model_validate(cfg["applications"][0]["args"])
    assert args.topology == "fused" and args.scorer.num_gpus == 0.5 and args.api_key_env == "LAYA_FLEET_API_KEY"


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

    prod = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "prod.yaml")
    with pytest.raises(SystemExit) as e:
        main(["fused", prod, "--replicas-per-gpu", "0"])
    assert e.value.code == 2 and "replicas_per_gpu must be a whole number" in capsys.readouterr().err
