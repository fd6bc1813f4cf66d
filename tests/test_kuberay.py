"""deploy/kuberay/: the committed manifests are the generator's output, and pass KubeRay's CRD schemas the way
an API server would check them (tests/data/kuberay/ holds the v1 openAPIV3Schemas)."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from serve_app.online import kuberay_manifests as kuberay
from serve_app.online.haproxy_launcher import GPU_NODE_ENV

DATA = Path(__file__).parent / "data" / "kuberay"
MANIFESTS = {"rayservice": ("rayservice.yaml", "rayservices-v1.schema.yaml"),
             "rayjob": ("rayjob-offline.yaml", "rayjobs-v1.schema.yaml")}


# -- an API server's structural-schema check, offline ---------------------------------------------------------
# OpenAPI v3.0 schemas are JSON Schema draft 4 plus `nullable` and Kubernetes' x-kubernetes-* keywords; the ones
# these CRDs use are checked below as Kubernetes defines them, or (x-kubernetes-map-type, which only sets merge
# semantics, and `format`, int32 / int64 / date-time) have nothing to check on one manifest.
def _type(validator, types, instance, schema):
    if instance is None and schema.get("nullable"):
        return
    yield from jsonschema.Draft4Validator.VALIDATORS["type"](validator, types, instance, schema)


def _int_or_string(validator, value, instance, schema):
    # int-or-string: an integer or a string, never a bool (a YAML `true` is not a port or a quantity)
    if value and (isinstance(instance, bool) or not isinstance(instance, int | str)):
        yield jsonschema.ValidationError("%r is neither an integer nor a string" % (instance,))


def _list_type(validator, value, instance, schema):
    if not isinstance(instance, list):
        return
    if value == "set" and len({repr(i) for i in instance}) != len(instance):
        yield jsonschema.ValidationError("duplicate items in a set list")
    if value == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(i.get(k) for k in keys) for i in instance if isinstance(i, dict)]
        if len(set(seen)) != len(seen):
            yield jsonschema.ValidationError("duplicate %s in a map list" % "/".join(keys))


_CEL_TOKENS = re.compile(r"\s+|self|in|and|or|not|\(|\)|\[|\]|,|'[^']*'|\"[^\"]*\"")


def cel(rule: str, value) -> bool:
    """The CEL `rule` of an x-kubernetes-validations entry evaluated on `value`, for the forms these CRDs use
    (`has(self.f)`, `!`, `&&`, `||`, `self in [...]`); any other construct raises rather than passing unchecked."""
    py = re.sub(r"has\(self\.(\w+)\)", r"('\1' in self)", rule)
    py = py.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    if _CEL_TOKENS.sub("", py):
        raise NotImplementedError("CEL rule not understood here: %s" % rule)
    return bool(eval(py, {"__builtins__": {}}, {"self": value}))


def _validations(validator, rules, instance, schema):
    for r in rules:
        if "oldSelf" in r["rule"]:
            continue  # transition rules: Kubernetes checks them on updates only, never on create
        if not cel(r["rule"], instance):
            yield jsonschema.ValidationError(r.get("message", r["rule"]))


KubeValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {
    "type": _type, "x-kubernetes-int-or-string": _int_or_string, "x-kubernetes-list-type": _list_type,
    "x-kubernetes-validations": _validations})


def _closed(schema):
    """`schema` with unknown fields refused wherever it lists `properties` (what `kubectl apply` does with strict
    field validation: a misspelt optional field fails instead of being pruned)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    return schema


_SCHEMAS: dict[str, dict] = {}


def crd_errors(kind: str, doc: dict) -> list[str]:
    """Every schema violation of manifest `doc` against the vendored CRD of `kind`, as 'path: message'."""
    if kind not in _SCHEMAS:
        with open(DATA / MANIFESTS[kind][1]) as f:
            _SCHEMAS[kind] = _closed(yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    v = KubeValidator(_SCHEMAS[kind])
    return ["%s: %s" % ("/".join(map(str, e.absolute_path)), e.message) for e in v.iter_errors(doc)]


def manifest(kind: str) -> dict:
    """The committed manifest of `kind`, parsed."""
    return yaml.safe_load((kuberay.OUT_DIR / MANIFESTS[kind][0]).read_text())


# -- the tests ------------------------------------------------------------------------------------------------
def test_committed_manifests_are_the_generators_output():
    rendered = kuberay.render()
    assert sorted(p.name for p in rendered) == sorted(m for m, _ in MANIFESTS.values())
    for path, text in rendered.items():
        assert path.read_text() == text, "%s is stale: run python -m serve_app.kuberay" % path.name
    assert kuberay.main(["--check"]) == 0


def test_check_fails_on_a_stale_manifest(tmp_path, monkeypatch):
    monkeypatch.setattr(kuberay, "OUT_DIR", tmp_path)
    assert kuberay.main([]) == 0 and kuberay.main(["--check"]) == 0
    p = tmp_path / "rayservice.yaml"
    p.write_text(p.read_text().replace("maxReplicas: 12", "maxReplicas: 13"))
    assert kuberay.main(["--check"]) == 1
    (tmp_path / "rayjob-offline.yaml").unlink()
    assert kuberay.main(["--check"]) == 1


@pytest.mark.parametrize("kind", sorted(MANIFESTS))
def test_manifest_validates_against_its_crd(kind):
    doc = manifest(kind)
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == {"rayservice": "RayService", "rayjob": "RayJob"}[kind]
    assert crd_errors(kind, doc) == []


def _head(doc):
    spec = doc["spec"]
    return (spec.get("rayClusterConfig") or spec["rayClusterSpec"])["headGroupSpec"]


def _worker(doc):
    spec = doc["spec"]
    return (spec.get("rayClusterConfig") or spec["rayClusterSpec"])["workerGroupSpecs"][0]


def _rename(d: dict, old: str, new: str) -> None:
    d[new] = d.pop(old)


BROKEN = {
    # misspelt required fields
    "headGroupSpec misspelt": ("rayservice", lambda d: _rename(d["spec"]["rayClusterConfig"], "headGroupSpec",
                                                               "headGroupSpecs")),
    "containers misspelt": ("rayjob", lambda d: _rename(_head(d)["template"]["spec"], "containers", "container")),
    "groupName missing": ("rayservice", lambda d: _worker(d).pop("groupName")),
    # wrong types and values
    "maxReplicas a string": ("rayservice", lambda d: _worker(d).update(maxReplicas="8")),
    "serveConfigV2 a mapping": ("rayservice", lambda d: d["spec"].update(serveConfigV2={"applications": []})),
    "rayStartParams value an int": ("rayjob", lambda d: _head(d)["rayStartParams"].update({"num-cpus": 0})),
    "gpu limit a bool": ("rayservice", lambda d: _worker(d)["template"]["spec"]["containers"][0]["resources"]
                         ["limits"].update({"nvidia.com/gpu": True})),
    "gpu limit not a quantity": ("rayservice", lambda d: _worker(d)["template"]["spec"]["containers"][0]
                                 ["resources"]["limits"].update({"nvidia.com/gpu": "one"})),
    "containerPort a string": ("rayservice", lambda d: _head(d)["template"]["spec"]["containers"][0]["ports"][3]
                               .update(containerPort="8000")),
    # an optional field misspelt (strict field validation), a duplicate map-list key, a CEL rule
    "unknown field": ("rayjob", lambda d: d["spec"].update(shutdownAfterJobFinish=True)),
    "duplicate env name": ("rayservice", lambda d: _head(d)["template"]["spec"]["containers"][0]["env"].append(
        {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "0"})),
    "managedBy outside its enum": ("rayservice", lambda d: d["spec"].update(managedBy="someone-else")),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_manifest_fails_the_crd_check(case):
    kind, breaks = BROKEN[case]
    doc = copy.deepcopy(manifest(kind))
    breaks(doc)
    assert crd_errors(kind, doc), case


def test_cel_subset_evaluates_and_refuses_what_it_does_not_know():
    rule = "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))"
    assert cel(rule, {"deletionRules": []}) and cel(rule, {"onSuccess": {}, "onFailure": {}})
    assert not cel(rule, {"onSuccess": {}})
    assert cel("self in ['a', 'b']", "a") and not cel("self in ['a', 'b']", "c")
    with pytest.raises(NotImplementedError):
        cel("size(self) > 0", "a")


def test_serve_config_is_prod_yaml():
    prod = (kuberay.ROOT / "configs" / "prod.yaml").read_text()
    assert yaml.safe_load(manifest("rayservice")["spec"]["serveConfigV2"]) == yaml.safe_load(prod)


def test_rayservice_pods_have_the_clusters_environment_gpus_and_mounts():
    doc = manifest("rayservice")
    prod_env = yaml.safe_load((kuberay.ROOT / "configs" / "prod.yaml").read_text())["applications"][0][
        "runtime_env"]["env_vars"]
    assert doc["spec"]["rayClusterConfig"]["rayVersion"] == kuberay.ray_version() == "2.60.0"
    for group in (_head(doc), _worker(doc)):
        pod = group["template"]["spec"]
        (c,) = pod["containers"]
        assert c["image"] == "laya-fleet:latest"
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_SERVE_ENABLE_HA_PROXY"]["value"] == "1"
        assert env["RAY_SERVE_HAPROXY_BINARY_PATH"]["value"] == kuberay.HAPROXY_BINARY
        assert env["LAYA_FLEET_HAPROXY_BUSY_POLLING"]["value"] == env["RAY_SERVE_HAPROXY_NBTHREAD"]["value"] == "1"
        assert env["LAYA_FLEET_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "laya-fleet-api-key",
                                                                          "key": "api-key"}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["volumes"]}
        assert claims[mounts["/mnt/laya-fleet/cache"]] == "laya-fleet-cache"
        assert "/mnt/laya-fleet/cache" == prod_env["LAYA_FLEET_CACHE_DIR"]
        assert claims[mounts["/mnt/laya-fleet/checkpoints"]] == "laya-fleet-checkpoints"
    head = _head(doc)["template"]["spec"]["containers"][0]
    assert {"name": "serve", "containerPort": 8000} in head["ports"]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    worker = _worker(doc)
    assert worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    # prod.yaml: the default checkpoint's 3 to 24 replicas and each other checkpoint's 0 to 6, three per GPU
    assert (worker["minReplicas"], worker["maxReplicas"]) == (1, 12)


def test_rayjob_runs_the_offline_cli_with_real_flags():
    from serve_app.offline import parser

    doc = manifest("rayjob")
    argv = shlex.split(doc["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "serve_app.offline"]
    args = parser().parse_args(argv[3:])  # argparse exits (SystemExit) on an unknown or missing flag
    prod = yaml.safe_load((kuberay.ROOT / "configs" / "prod.yaml").read_text())["applications"][0]
    assert args.checkpoint == prod["args"]["checkpoint"]
    assert args.cache_dir == prod["runtime_env"]["env_vars"]["LAYA_FLEET_CACHE_DIR"]
    offline = yaml.safe_load((kuberay.ROOT / "configs" / "offline-job.yaml").read_text())
    assert yaml.safe_load(doc["spec"]["runtimeEnvYAML"]) == {"env_vars": offline["env_vars"]}
    # every path the job reads or writes is on a volume its pods mount
    mounted = {m["mountPath"] for m in _head(doc)["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert mounted == {m["mountPath"] for m in _worker(doc)["template"]["spec"]["containers"][0]["volumeMounts"]}
    for path in [*args.input, args.output, args.questions, args.checkpoint, args.cache_dir]:
        assert any(path.startswith(m + "/") or path == m for m in mounted), path
    assert _worker(doc)["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_deploy_doc_states_the_manifests_and_prod_yamls_numbers():
    """docs/deploy.md's pods, environment, Secret, claims and ports are the manifest's, prod.yaml's and Ray's."""
    from ray.serve._private import constants as serve

    doc = (kuberay.ROOT / "docs" / "deploy.md").read_text()
    text = " ".join(doc.split())  # the doc's wrapped lines as one
    svc = manifest("rayservice")
    prod = yaml.safe_load((kuberay.ROOT / "configs" / "prod.yaml").read_text())
    head, worker = _head(svc), _worker(svc)
    (h,), (w,) = head["template"]["spec"]["containers"], worker["template"]["spec"]["containers"]
    lo, hi = worker["minReplicas"], worker["maxReplicas"]
    assert "a CPU head and %d-%d GPU worker pods" % (lo, hi) in text
    assert "a head pod (%s CPUs, no GPU, `num-cpus: %s`" % (h["resources"]["limits"]["cpu"],
                                                            head["rayStartParams"]["num-cpus"]) in text
    limits = w["resources"]["limits"]
    assert "GPU worker pods of one `nvidia.com/gpu`, %s CPUs and %s GiB each, %d to %d of them" % (
        limits["cpu"], limits["memory"].removesuffix("Gi"), lo, hi) in text and limits["nvidia.com/gpu"] == 1
    deps = {d["name"]: d for d in prod["applications"][0]["deployments"]}
    scale = deps["Ingress"]["autoscaling_config"]
    others = {d["autoscaling_config"]["max_replicas"] for n, d in deps.items() if n.startswith("Scorer-")}
    assert "prod.yaml's %d to %d fused replicas" % (scale["min_replicas"], scale["max_replicas"]) in text
    assert len(others) == 1 and "0 to %d scorer replicas of each other checkpoint" % others.pop() in text
    # the environment every pod gets, as the doc writes it
    for c in (h, w):
        env = {e["name"]: e for e in c["env"]}
        for name in ("RAY_SERVE_ENABLE_HA_PROXY", "RAY_SERVE_HAPROXY_BINARY_PATH", *GPU_NODE_ENV):
            assert "`%s=%s`" % (name, env[name]["value"]) in text
        ref = env[prod["applications"][0]["args"]["api_key_env"]]["valueFrom"]["secretKeyRef"]
        assert "kubectl create secret generic %s --from-literal=%s=" % (ref["name"], ref["key"]) in text
    claims = {v["persistentVolumeClaim"]["claimName"] for c in (head, worker)
              for v in c["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
    claims |= {v["persistentVolumeClaim"]["claimName"] for v in _worker(manifest("rayjob"))["template"]["spec"]
               ["volumes"] if "persistentVolumeClaim" in v}
    assert "for claim in %s; do" % " ".join(sorted(claims)) in text
    # ports: the clients' one is prod.yaml's, the rest Ray's defaults
    assert prod["http_options"]["port"] == 8000 and "**8000** is the only port for clients" in text
    assert {"name": "serve", "containerPort": 8000} in h["ports"]
    assert {"name": "dashboard", "containerPort": 8265} in h["ports"] and "**8265** (dashboard" in text
    assert "the replicas' own ports %d-%d" % (serve.RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT,
                                               serve.RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT) in text
    assert "%d (Serve's fallback proxy)" % serve.RAY_SERVE_FALLBACK_PROXY_HTTP_PORT in text
    assert "%d and %d (HAProxy's stats page and Prometheus exporter" % (
        serve.RAY_SERVE_HAPROXY_STATS_PORT, serve.RAY_SERVE_HAPROXY_METRICS_PORT) in text
    assert "laya-fleet-head-svc" in text and svc["metadata"]["name"] == "laya-fleet"
