"""`GET /info` in both topologies, the typed OpenAPI document, and the guard around Ray's unstable APIs.

The HTTP tests run on a real local Ray over real HTTP with the `app` (split) fixture of tests/test_serve.py,
then the `fused` fixture of tests/test_serve_fused.py (which replaces the split app: keep the split tests
first). The guard tests need no cluster: they take attributes away from the installed Ray's real modules.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import sys
import tomllib
from importlib import metadata

import httpx
import pytest

pytest.register_assert_rewrite("tests.serve_helpers")

from . import test_serve, test_serve_fused  # noqa: E402
from .serve_helpers import AUTH, REPO, TEST_KEY, load_config  # noqa: E402

pytest_plugins = ["tests.serve_helpers"]
app = test_serve.app  # the split app fixture
fused = test_serve_fused.fused  # the fused app fixture

VERSIONED = ("laya-fleet", "torch", "ray", "tilelang")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _local_policy() -> dict:
    """The Scorer's user_config in configs/local.yaml (what both fixtures deploy)."""
    return next(d for d in load_config()["applications"][0]["deployments"] if d["name"] == "Scorer")["user_config"]


def _openapi() -> dict:
    """The ingress's OpenAPI document, as a replica without a bearer key serves it at /openapi.json (the test
    apps have a key, and a replica behind a key serves no docs: tests/test_serve.py checks the 404s)."""
    from serve_app.online.ingress import app as fastapi_app

    return json.loads(json.dumps(fastapi_app.openapi()))


def _assert_info(body: dict, checkpoint: str, topology: str) -> None:
    from model.bundle import checkpoint_hash, open_bundle
    from model.decode import empty_result
    from serve_app.online.schemas import Limits

    bundle = open_bundle(checkpoint)
    assert body["topology"] == topology
    assert body["checkpoints"] == [{"served_as": "english", "loaded": True, "name": os.path.basename(checkpoint),
                                    "hash": checkpoint_hash(checkpoint), "model": empty_result()["model"],
                                    "backend": "eager", "dtype": "float32", "device": "cpu",
                                    "max_len": bundle.max_len, "head_max_len": bundle.head_max_len}]
    assert body["limits"] == Limits().model_dump()  # the test configs set no limits: the defaults
    assert body["batching"] == dict(_local_policy(), budget=_local_policy()["max_batch_tokens"])
    assert body["versions"] == {n: _installed(n) for n in VERSIONED}
    assert body["versions"]["ray"] == metadata.version("ray") and body["versions"]["laya-fleet"] is not None


def _assert_info_needs_the_bearer(url: str) -> None:
    for headers in ({}, {"Authorization": ("Bearer " + TEST_KEY + "x").encode()}):
        r = httpx.get(url + "/info", headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.json() == {"detail": "invalid or missing bearer token"}
        assert r.headers["www-authenticate"] == "Bearer"


# -- split (Ingress -> Scorer handle) ------------------------------------------------------------

def test_info_split_reports_checkpoint_hash_backend_dtype_limits_batching_and_versions(app, tiny_checkpoint):
    r = httpx.get(app.url + "/info", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    _assert_info(r.json(), tiny_checkpoint, "split")


def test_info_split_without_or_with_a_wrong_bearer_is_401(app):
    _assert_info_needs_the_bearer(app.url)


def _schema(spec: dict, ref_or_name: str) -> dict:
    return spec["components"]["schemas"][ref_or_name.rsplit("/", 1)[-1]]


def _types(prop: dict) -> dict[str, dict]:
    """A property's alternatives by JSON type (`anyOf` members, or the property itself)."""
    return {p["type"]: p for p in prop.get("anyOf", [prop]) if "type" in p}


def test_openapi_has_typed_request_models_with_limits_and_examples():
    from serve_app.online.schemas import _BATCH_EXAMPLE, _EXAMPLE, Limits

    lim = Limits()
    spec = _openapi()
    assert {"/v1/systemone", "/v1/systemone/batch", "/health", "/ready", "/stats", "/info"} <= set(spec["paths"])

    body = spec["paths"]["/v1/systemone"]["post"]["requestBody"]["content"]["application/json"]
    assert body["example"] == _EXAMPLE  # the example the docs page shows, unchanged
    one = _schema(spec, body["schema"]["$ref"])
    assert one["examples"] == [_EXAMPLE]
    assert set(one["required"]) == {"state", "questions"}
    state = _types(one["properties"]["state"])
    assert state["string"]["maxLength"] == lim.max_state_chars and {"object", "array"} <= set(state)
    qs = one["properties"]["questions"]
    assert qs["type"] == "object" and qs["maxProperties"] == lim.max_questions
    assert {m["$ref"].rsplit("/", 1)[-1] for m in qs["additionalProperties"]["oneOf"]} == {
        "ChoiceQuestion", "ScoreQuestion", "NoulQuestion"}
    assert _types(one["properties"]["max_len"])["integer"]["minimum"] == 1
    assert set(_types(one["properties"]["model"])) == {"string", "null"}

    choice = _schema(spec, "ChoiceQuestion")
    assert choice["properties"]["type"]["const"] == "choice"
    assert choice["properties"]["instructions"]["type"] == "string"
    crit = _types(choice["properties"]["criteria"])
    assert crit["array"]["maxItems"] == crit["object"]["maxProperties"] == lim.max_choice_options
    assert str(lim.max_total_options) in choice["properties"]["criteria"]["description"]
    assert _schema(spec, "ScoreQuestion")["properties"]["criteria"]["maxItems"] == lim.max_score_levels

    batch_body = spec["paths"]["/v1/systemone/batch"]["post"]["requestBody"]["content"]["application/json"]
    assert batch_body["example"] == _BATCH_EXAMPLE
    batch = _schema(spec, batch_body["schema"]["$ref"])
    assert batch["examples"] == [_BATCH_EXAMPLE]
    states = batch["properties"]["states"]
    assert states["type"] == "array" and states["minItems"] == 1 and states["maxItems"] == lim.max_batch_states


def test_openapi_has_response_and_error_models_for_every_route():
    spec = _openapi()

    def ref(path: str, method: str, status: str) -> str:
        return spec["paths"][path][method]["responses"][status]["content"]["application/json"]["schema"]["$ref"]

    want = {("/v1/systemone", "post"): "SystemOneResponse", ("/v1/systemone/batch", "post"): "BatchResponse",
            ("/health", "get"): "HealthResponse", ("/ready", "get"): "ReadyResponse",
            ("/stats", "get"): "StatsResponse", ("/info", "get"): "InfoResponse"}
    for (path, method), name in want.items():
        assert ref(path, method, "200").endswith("/" + name), path
    for status in ("400", "401", "413", "422", "503"):
        assert ref("/v1/systemone", "post", status).endswith("/ErrorResponse")
        assert ref("/v1/systemone/batch", "post", status).endswith("/ErrorResponse")
    for path in ("/stats", "/info"):
        assert ref(path, "get", "401").endswith("/ErrorResponse") and ref(path, "get", "503").endswith("/ErrorResponse")
    answer = _schema(spec, "SystemOneResponse")
    assert set(answer["required"]) == {"model", "answers", "usage"}
    assert _schema(spec, "NoulAnswer")["properties"]["noul"]["type"] == "number"
    assert _schema(spec, "Usage")["properties"]["input_tokens"]["type"] == "integer"
    assert _schema(spec, "ErrorResponse")["properties"]["detail"]["type"] == "string"
    info = _schema(spec, "InfoResponse")
    assert {"topology", "checkpoints", "limits", "batching", "versions"} <= set(info["properties"])
    assert _schema(spec, "CheckpointInfo")["properties"]["hash"]["type"] == "string"


def test_bodies_the_schema_would_refuse_still_get_the_handlers_own_answers(app):
    """FastAPI validates no body: a question set over the documented limit is the handler's 413 text, and an
    unknown extra field is ignored as before (200)."""
    from model.decode import empty_result

    r = httpx.post(app.url + "/v1/systemone", headers=AUTH, timeout=30, json={
        "state": "x", "questions": {"q%d" % i: {"type": "noul", "instructions": "?"} for i in range(65)}})
    assert r.status_code == 413 and r.json() == {"detail": "too many questions (65 > 64)"}
    # (on /batch: tests/test_serve.py's metrics test reads the first 200 counter of /v1/systemone it finds, and
    # this replica's would still be exported when that module runs after this one)
    r = httpx.post(app.url + "/v1/systemone/batch", headers=AUTH, timeout=30,
                   json={"states": ["x"], "questions": {}, "extra": [1]})
    assert r.status_code == 200 and [{k: v for k, v in x.items() if k != "routing"}
                                     for x in r.json()["results"]] == [empty_result()]
    r = httpx.post(app.url + "/v1/systemone", headers=AUTH, timeout=30, json={"state": "x"})
    assert r.status_code == 400 and r.json() == {"detail": "request body must be an object with a 'questions' field"}


# -- fused (the scorer in the ingress replica); deploying it replaces the split app ---------------

def test_info_fused_reports_the_in_process_scorer(fused, tiny_checkpoint):
    r = httpx.get(fused.url + "/info", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    _assert_info(r.json(), tiny_checkpoint, "fused")


def test_info_fused_without_or_with_a_wrong_bearer_is_401(fused):
    _assert_info_needs_the_bearer(fused.url)


# -- the guard around Ray's private and alpha APIs (no cluster) -----------------------------------

def test_ray_guard_passes_on_the_installed_ray():
    import ray.serve._private.constants as constants

    from serve_app.online import ray_compat
    from serve_app.online.service_info import serve_request_path

    ray_compat.check()
    assert ray_compat.serve_constants() is constants
    assert set(serve_request_path()) == {"grpc_between_deployments", "user_code_on_replica_loop",
                                         "router_on_replica_loop", "direct_ingress"}
    from ray.serve.exceptions import BackPressureError

    assert ray_compat.errors().BackPressureError is BackPressureError


def _assert_names(exc: pytest.ExceptionInfo, what: str) -> None:
    import ray

    from serve_app.online.ray_compat import TESTED_RAY

    msg = str(exc.value)
    assert what in msg and ("Ray %s " % ray.__version__) in msg and ("ray==%s" % TESTED_RAY) in msg, msg


def test_ray_guard_raises_naming_a_missing_private_constant(monkeypatch):
    import ray.serve._private.constants as constants

    from serve_app.online import ray_compat
    from serve_app.online.service_info import serve_request_path

    monkeypatch.delattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS")
    for call in (ray_compat.check, serve_request_path):
        with pytest.raises(RuntimeError) as e:
            call()
        _assert_names(e, "ray.serve._private.constants.RAY_SERVE_ENABLE_DIRECT_INGRESS")


@pytest.mark.parametrize("cls,attr", [("AutoscalingContext", "aggregated_metrics"),
                                      ("AutoscalingConfig", "get_target_ongoing_requests")])
def test_ray_guard_raises_naming_a_missing_autoscaling_policy_attribute(monkeypatch, cls, attr):
    import ray.serve.config as config

    from serve_app.online import ray_compat

    monkeypatch.delattr(getattr(config, cls), attr)
    with pytest.raises(RuntimeError) as e:
        ray_compat.check()
    _assert_names(e, "ray.serve.config.%s.%s" % (cls, attr))


def test_ray_guard_raises_when_the_autoscaling_context_no_longer_takes_a_field(monkeypatch):
    import ray.serve.config as config

    from serve_app.online import ray_compat

    def init(self, deployment_id, target_num_replicas, config):  # no current_num_replicas
        pass

    monkeypatch.setattr(config.AutoscalingContext, "__init__", init)
    with pytest.raises(RuntimeError) as e:
        ray_compat.check()
    _assert_names(e, "ray.serve.config.AutoscalingContext (its constructor's 'current_num_replicas')")


def test_ray_guard_raises_naming_a_missing_module_and_a_missing_alpha_error(monkeypatch):
    import ray.serve.exceptions as exceptions

    from serve_app.online import ray_compat

    with monkeypatch.context() as m:
        m.setitem(sys.modules, "ray.serve._private.constants", None)  # the import fails
        with pytest.raises(RuntimeError) as e:
            ray_compat.check()
        _assert_names(e, "the module ray.serve._private.constants")
    monkeypatch.delattr(exceptions, "DeploymentUnavailableError")
    with pytest.raises(RuntimeError) as e:
        ray_compat.errors()
    _assert_names(e, "ray.serve.exceptions.DeploymentUnavailableError")


def test_app_build_and_ingress_construction_fail_at_start_when_ray_lacks_an_attribute(monkeypatch, tiny_checkpoint):
    import ray.serve._private.constants as constants

    from serve_app.app import build_app
    from serve_app.online.fused_ingress import FusedIngress
    from serve_app.online.ingress import Ingress

    monkeypatch.delattr(constants, "RAY_SERVE_USE_GRPC_BY_DEFAULT")
    what = "ray.serve._private.constants.RAY_SERVE_USE_GRPC_BY_DEFAULT"
    with pytest.raises(RuntimeError) as e:
        build_app({"checkpoint": tiny_checkpoint, "backend": "eager", "device": "cpu"})
    _assert_names(e, what)
    # a replica's constructor (async, as Serve's ingress wrapper makes it), before it loads anything; the fused
    # one before its in-process scorer loads and warms up
    for cls, args in ((Ingress.func_or_class, (None, tiny_checkpoint)),
                      (FusedIngress.func_or_class, ({"checkpoint": tiny_checkpoint}, tiny_checkpoint))):
        monkeypatch.setattr(cls, "__del__", lambda self: None)  # the half-built replica has nothing to stop
        obj = object.__new__(cls)
        with pytest.raises(RuntimeError) as e:
            asyncio.run(cls.__init__(obj, *args))
        _assert_names(e, what)
        del obj, e
        gc.collect()


def test_tested_ray_version_equals_the_pyproject_pin_and_the_installed_requirement():
    from serve_app.online.ray_compat import TESTED_RAY

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    pins = [m.group(1) for d in deps if (m := re.fullmatch(r"ray(?:\[[^\]]*\])?==([\w.]+)", d.replace(" ", "")))]
    assert pins == [TESTED_RAY]
    installed = [r for r in metadata.requires("laya-fleet") or [] if re.match(r"ray(\[|==)", r)]
    assert installed and all(r.endswith("==" + TESTED_RAY) for r in installed), installed
