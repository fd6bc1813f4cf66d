"""bench/serve_load.py's configs: the shipped file with only the machine's paths changed, and the local-topology
rows' config, each accepted by the app builder's typed arguments with every checkpoint it names on disk, and the
shipped file's deployments and limits untouched."""

from __future__ import annotations

import copy
import os
import sys
import tarfile

import yaml

from serve_app.online.app import AppArgs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import serve_load  # noqa: E402


def _dirs(args: dict) -> list[str]:
    return [args["checkpoint"], *(args.get("checkpoints") or {}).values()]


def test_the_shipped_prod_config_keeps_every_served_name_on_the_machines_checkpoint(tiny_checkpoint, tmp_path):
    path = os.path.join(REPO, "configs", "prod.yaml")
    with open(path, encoding="utf-8") as fh:
        shipped = yaml.safe_load(fh)
    cfg, env = serve_load.shipped_config(path, tiny_checkpoint, "auto", "auto", 18123, str(tmp_path))
    app, orig = cfg["applications"][0], shipped["applications"][0]
    args = AppArgs.model_validate(app["args"])
    assert set(args.checkpoints) == set(orig["args"]["checkpoints"]) and len(args.checkpoints) >= 2
    assert all(os.path.isdir(d) for d in _dirs(app["args"]))
    assert app["deployments"] == orig["deployments"]  # autoscaling, limits, user_config: as shipped
    keep = copy.deepcopy(orig["args"])
    for k in ("checkpoint", "checkpoints", "backend", "device"):
        keep.pop(k), app["args"].pop(k)
    assert app["args"] == keep
    assert set(env) == {orig["args"]["api_key_env"]}


def test_the_local_rows_config_serves_one_checkpoint(tiny_checkpoint):
    cfg = serve_load.fleet_config(tiny_checkpoint, "eager", "cpu", 18124, replicas=2, ingress_replicas=1,
                                  max_batch_tokens=None, gpus=0)
    app = cfg["applications"][0]
    AppArgs.model_validate(app["args"])
    assert not app["args"].get("checkpoints") and [d["name"] for d in app["deployments"]] == ["Ingress", "Scorer"]
    assert _dirs(app["args"]) == [os.path.abspath(tiny_checkpoint)]


def test_replica_changes_name_the_replicas_that_ended_and_began():
    before = {"ingress": [11, 12, 13], "scorer": [], "haproxy": [5]}
    assert serve_load.replica_changes(before, {"ingress": [11, 12, 13], "scorer": [], "haproxy": [6]}) == {}
    after = {"ingress": [11, 13, 14], "scorer": [20]}
    assert serve_load.replica_changes(before, after) == {"ingress": {"gone": [12], "new": [14]},
                                                         "scorer": {"gone": [], "new": [20]}}


def test_saved_serve_logs_are_the_tails_of_the_sessions_logs(tmp_path):
    root = tmp_path / "logs"
    (root / "serve").mkdir(parents=True)
    (root / "serve" / "controller_1.log").write_bytes(b"x" * 5000 + b"the end\n")
    (root / "raylet.out").write_text("raylet line\n")
    dest = tmp_path / "kept" / "serve-logs.tar.gz"
    serve_load.save_serve_logs(str(dest), tail_bytes=100, root=str(root))
    with tarfile.open(dest) as tar:
        assert sorted(tar.getnames()) == ["raylet.out", "serve_controller_1.log"]
        kept = tar.extractfile("serve_controller_1.log").read()
        assert len(kept) == 100 and kept.endswith(b"the end\n")
        assert tar.extractfile("raylet.out").read() == b"raylet line\n"


def test_config_variants_alternate_the_shipped_file_with_each_variant_per_round():
    """`--env-variant` and `--rounds`: the shipped file first in every round, each variant labelled as not shipped,
    rounds numbered only when there are several; a variant that is not NAME=VALUE stops the bench."""
    import pytest

    assert serve_load.config_variants(None, []) == [(None, {}, {}, "")]
    runs = serve_load.config_variants("2", ["X=1"], rounds=2)
    assert runs == [(None, {}, {}, " #1"), (2, {}, {}, " #1"), (None, {"X": "1"}, {}, ", X=1 (not as shipped) #1"),
                    (None, {}, {}, " #2"), (2, {}, {}, " #2"), (None, {"X": "1"}, {}, ", X=1 (not as shipped) #2")]
    assert serve_load.config_variants(None, ["A=b=c"])[1][1] == {"A": "b=c"}
    for bad in ("NOVALUE", "=1"):
        with pytest.raises(SystemExit, match="NAME=VALUE"):
            serve_load.config_variants(None, [bad])
    with pytest.raises(SystemExit, match="--rounds"):
        serve_load.main(["--config", "configs/prod.yaml", "--rounds", "0"])
    for alone in (["--env-variant", "X=1"], ["--rounds", "2"], ["--deployment-variant", "Ingress.x=1"]):
        with pytest.raises(SystemExit, match="--config"):   # nothing to vary: refused, not ignored
            serve_load.main(alone)


def test_a_deployment_variant_changes_one_field_of_the_shipped_file_and_refuses_typos(tiny_checkpoint, tmp_path):
    """`--deployment-variant Ingress.max_queued_requests=48`: that field alone differs from the file as shipped,
    the value typed as YAML reads it; a deployment or field the file does not set stops the bench before any
    server starts."""
    import pytest

    runs = serve_load.config_variants(None, [], 1, ["Ingress.max_queued_requests=48"])
    assert runs[1] == (None, {}, {("Ingress", "max_queued_requests"): 48},
                       ", Ingress.max_queued_requests=48 (not as shipped)")
    path = os.path.join(REPO, "configs", "prod.yaml")
    shipped, _ = serve_load.shipped_config(path, tiny_checkpoint, "auto", "auto", 18123, str(tmp_path))
    varied = serve_load.override_deployments(copy.deepcopy(shipped), runs[1][2])
    ingress = [d for d in varied["applications"][0]["deployments"] if d["name"] == "Ingress"][0]
    assert ingress["max_queued_requests"] == 48
    ingress["max_queued_requests"] = [d for d in shipped["applications"][0]["deployments"]
                                      if d["name"] == "Ingress"][0]["max_queued_requests"]
    assert varied == shipped
    for bad, why in (("Ingres.max_queued_requests=48", "no deployment"), ("Ingress.max_queued=48", "sets no"),
                     ("Ingress=48", "DEPLOYMENT.FIELD=VALUE"), ("Ingress.max_queued_requests=", "DEPLOYMENT")):
        with pytest.raises(SystemExit, match=why):
            serve_load.main(["--checkpoint", tiny_checkpoint, "--config", path, "--deployment-variant", bad])
    # without --config and without variants the check has no file to read and passes on to the levels
    with pytest.raises(ValueError, match="invalid literal"):
        serve_load.main(["--checkpoint", tiny_checkpoint, "--levels", "x"])


def test_a_level_counts_shed_requests_without_retry_after_apart():
    """Against a real HTTP server that answers 200, 503 with Retry-After and 503 without it in turn, a level's
    errors name the 503s that came without the header (the 512-client criterion: only 200s and 503s with it)."""
    import asyncio

    from aiohttp import web

    async def scenario() -> dict:
        seen = iter(range(10 ** 9))

        async def handler(_request):
            k = next(seen) % 3
            if k == 0:
                return web.json_response({"ok": True})
            headers = {"Retry-After": "0"} if k == 1 else {}
            return web.json_response({"detail": "overloaded"}, status=503, headers=headers)

        app = web.Application()
        app.router.add_post("/v1/systemone", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            return await serve_load.run_level("http://127.0.0.1:%d/v1/systemone" % port, [{"x": 1}], 2, 0.6, 0.1)
        finally:
            await runner.cleanup()

    level = asyncio.run(scenario())
    assert level["ok"] > 0
    assert set(level["errors"]) == {"503", "503" + serve_load.NO_RETRY_AFTER}
    assert abs(level["errors"]["503"] - level["errors"]["503" + serve_load.NO_RETRY_AFTER]) <= 2
