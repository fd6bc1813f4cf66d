"""Shared fixtures: one tiny checkpoint per test session, the engine over it, and the upstream oracle; and the
order of the Serve tests that share a deployed app."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch


def _torch_threads() -> int:
    """OMP_NUM_THREADS where it is a number (`make test` runs two pytest processes side by side with one thread
    each: two threads of one process on a core the other process uses wait on each other), else two."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return max(1, min(2, os.cpu_count() or 1))


torch.set_num_threads(_torch_threads())

# Every Ray the tests start (in-process, `ray start`, `serve run` children inherit the environment) starts
# workers when a task or actor needs one rather than a pool up front: on a 2-core machine the offline Ray
# tests, run alone, took 316 s with the prestarted pool and 236 s without it. A proxy
# actor then starts in a new process, and beside the other lane of `make test` Serve once found the starting
# HAProxyManager unhealthy (5 s ready check), killed it, and `serve run` exited: the checks get 30 s, HAProxy
# 120 s to come up.
RAY_TEST_ENV = {"RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0",
                "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30", "RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S": "120"}
for _k, _v in RAY_TEST_ENV.items():
    os.environ.setdefault(_k, _v)


_EXIT: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """After the summary, exit with pytest's status without interpreter finalisation, where native threads of Ray,
    torch or the tokenizers can crash a run whose tests all passed. LAYA_FLEET_TEST_HARD_EXIT=0 exits normally."""
    if _EXIT and os.environ.get("LAYA_FLEET_TEST_HARD_EXIT", "1") != "0":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT[-1])


def pytest_collection_modifyitems(config, items):
    _group_shared_serve_apps(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The module fixtures that deploy a Serve app other modules reuse: tests/test_serve.py's `app` (split) and
# tests/test_serve_fused.py's `fused`, which tests/test_serve_hardening.py and tests/test_serve_info.py take.
SERVE_APP_FIXTURES = ("app", "fused")


def _group_shared_serve_apps(items) -> None:
    """Run every test of a shared Serve app where its first test runs, so the app is built once: deploying it
    over another app starts new replicas, while deploying the config already running (each module's fixture
    does) is a no-op for Serve (same code version, no new replica). Other tests keep their order."""
    def app_of(item):
        module = getattr(item, "module", None)
        for name in SERVE_APP_FIXTURES:
            if name in getattr(item, "fixturenames", ()) and module is not None:
                return getattr(module, name, None)
        return None

    apps = [app_of(item) for item in items]
    modules: dict[int, set[str]] = {}
    for item, app in zip(items, apps):
        if app is not None:
            modules.setdefault(id(app), set()).add(item.module.__name__)
    shared = {k for k, names in modules.items() if len(names) > 1}
    out, placed = [], set()
    for item, app in zip(items, apps):
        key = id(app) if app is not None else None
        if key not in shared:
            out.append(item)
        elif key not in placed:
            placed.add(key)
            out += [other for other, a in zip(items, apps) if a is app]
    items[:] = out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    from model.make_checkpoint import make_checkpoint

    out = str(tmp_path_factory.mktemp("ckpt") / "tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_checkpoint(out, "tiny", seed=0)
    return out


@pytest.fixture(scope="session")
def cluster():
    """A `ray start --head` cluster of the session's own, this process its driver (tests/test_offline_ray.py)."""
    from tests.test_offline_ray import own_cluster

    yield from own_cluster()


@pytest.fixture(scope="session")
def engine(tiny_checkpoint):
    import model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return model.load(tiny_checkpoint, device="cpu", backend="eager")


@pytest.fixture(scope="session")
def bundle(tiny_checkpoint):
    """The tiny checkpoint's parsed bundle (no weights loaded)."""
    from model.bundle import open_bundle

    return open_bundle(tiny_checkpoint)


@pytest.fixture(scope="session")
def rows(engine):
    """Rows of 10 generated (states, questions) cases, encoded by the eager engine."""
    from tests import cases as C

    out = []
    for states, qs in C.cases(10):
        prep = engine.prepare(qs)
        for enc in engine.encode_many(states, prep):
            out += enc.rows
    return out


@pytest.fixture(scope="session")
def rows_scored(engine, rows):
    """The eager engine's (logits, P(action 0)) over `rows`: the reference the other backends are held to
    (computed once; tests only read it)."""
    logits, act = engine.score(rows)
    logits.flags.writeable = act.flags.writeable = False
    return logits, act


@pytest.fixture(scope="session")
def oracle(tiny_checkpoint):
    """Upstream `laya` loaded on the tiny checkpoint: the reference of the parity tests.

    Without `laya` installed these tests skip on a developer's machine and fail in CI (`CI` set, as `.ci/run`
    runs them), where a missing oracle must not pass silently."""
    try:
        import laya
    except ImportError as exc:
        reason = ("the parity tests need upstream laya==0.4.15, which is not installed "
                  "(the dev extra installs it: pip install -e '.[dev]')")
        if os.environ.get("CI"):
            pytest.fail("%s (%s)" % (reason, exc), pytrace=False)
        pytest.skip(reason)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return laya.load(tiny_checkpoint, device="cpu")
