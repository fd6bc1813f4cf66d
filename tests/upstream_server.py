"""Upstream's own `laya-serve` and laya-fleet's app side by side, on the same local checkpoints under the same names.

`UpstreamServe` (`upstream_serve`) runs upstream's real server (`python -m laya.serve`, laya 0.4.15) as a
subprocess on a free loopback port. Upstream serves its built-in names (`english`, `multilingual`) from the Hub;
`LAYA_EXTRA_MODELS` re-points a built-in name at a local directory, so both servers answer `routing.model` with
the same names and nothing is downloaded (`HF_HUB_OFFLINE=1`: a name with no local source, such as
`typed-decisions`, fails at once instead of hanging). `our_config` is configs/local.yaml pointed at the same
directories, and upstream gets its routing settings (`LAYA_DEFAULT_MODEL`, `LAYA_AUTO_TASK`), so the two are
configured alike; the session fixtures `upstream` and `ours` start one server each for every test module that uses
them (this module is a pytest plugin: `pytest_plugins = ["tests.upstream_server"]`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from .serve_helpers import REPO, ServeRun, free_port, load_config
from .upstream_corpus import API_KEY

NAMES = ("english", "multilingual")


@dataclass
class Server:
    """One running server: its origin, bearer key and a way to read its log."""

    name: str
    base: str
    api_key: str | None
    log_tail: Callable[..., str]


class UpstreamServe:
    """Upstream's `laya-serve` in a subprocess of its own process group, serving `checkpoints` ({name: directory}).

    Ready when an authorized `/health` lists every checkpoint as loaded (upstream preloads them before it binds);
    stopped with SIGTERM, then SIGKILL. A failed start raises with the tail of the server's log."""

    def __init__(self, checkpoints: dict[str, str], api_key: str | None = None, timeout: float = 180.0,
                 **env: str):
        self.checkpoints, self.api_key, self.timeout, self.extra_env = dict(checkpoints), api_key, timeout, env
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self._tmp = tempfile.TemporaryDirectory(prefix="laya-upstream-")
        self.log_path = os.path.join(self._tmp.name, "laya-serve.log")
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """The server's environment: this process's, less every LAYA_* setting, plus the ones this server needs."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LAYA_")}
        env.update(LAYA_HOST="127.0.0.1", LAYA_PORT=str(self.port), LAYA_DEVICE="cpu", LAYA_THREADS="1",
                   LAYA_PRELOAD="1", LAYA_MODELS=",".join(self.checkpoints), LAYA_LOG_LEVEL="warning",
                   LAYA_EXTRA_MODELS=json.dumps({k: os.path.abspath(v) for k, v in self.checkpoints.items()}),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
        if self.api_key:
            env["LAYA_API_KEY"] = self.api_key
        env.update(self.extra_env)
        return env

    def log_tail(self, n: int = 4000) -> str:
        """The last `n` characters of the server's output."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()[-n:]
        except OSError:
            return ""

    def _ready(self) -> bool:
        headers = {"Authorization": "Bearer " + self.api_key} if self.api_key else {}
        try:
            r = httpx.get(self.base + "/health", headers=headers, timeout=5.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and set(self.checkpoints) <= set(r.json().get("loaded") or [])

    def __enter__(self) -> UpstreamServe:
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "laya.serve"], env=self.env(), cwd=self._tmp.name,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() - t0 > self.timeout:
                why = ("exited with %s" % self.proc.returncode if self.proc.poll() is not None
                       else "not ready after %.0fs" % self.timeout)
                tail = self.log_tail()
                self.__exit__(None, None, None)
                raise AssertionError("upstream laya-serve %s; its log ends:\n%s" % (why, tail))
            time.sleep(0.3)
        return self

    def __exit__(self, *exc) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # uvicorn drains and exits on SIGTERM
            if self.proc is None or self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        self._log.close()
        self._tmp.cleanup()


def our_config(checkpoints: dict[str, str], port: int) -> dict:
    """configs/local.yaml serving `checkpoints` ({name: directory}) on `port`: its default checkpoint, deployments
    and resources as shipped (the bearer key comes from LAYA_API_KEY in the environment, as upstream's does)."""
    cfg = load_config("local.yaml")
    cfg["http_options"]["port"] = port
    args = cfg["applications"][0]["args"]
    paths = {k: os.path.abspath(v) for k, v in checkpoints.items()}
    default = args.get("default_checkpoint", "english")
    args["checkpoint"] = paths[default]
    args["checkpoints"] = {k: v for k, v in paths.items() if k != default}
    return cfg


def upstream_env(config: dict) -> dict[str, str]:
    """The LAYA_* settings that configure upstream's routing as an app config configures ours: the routing
    default (`routing_default`, unset = upstream's own) and task auto-detection (`auto_task`)."""
    args = config["applications"][0]["args"]
    env = {"LAYA_AUTO_TASK": "1" if args.get("auto_task") else "0"}
    if args.get("routing_default"):
        env["LAYA_DEFAULT_MODEL"] = args["routing_default"]
    return env


class _KeepTail(ServeRun):
    """`ServeRun` whose failed start reports the tail of the `serve run` log (its temporary log is gone after)."""

    def __enter__(self) -> ServeRun:
        try:
            return super().__enter__()
        except AssertionError as exc:
            raise AssertionError("%s; serve run output ends:\n%s" % (exc, self._tail)) from None

    def __exit__(self, *exc) -> None:
        self._tail = self.log_tail(6000)
        super().__exit__(*exc)


def our_serve(checkpoints: dict[str, str], api_key: str | None = API_KEY) -> ServeRun:
    """A `serve run` (a local Ray of its own) of `our_config(checkpoints)`; use it as a context manager."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYA_")}
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=REPO)
    if api_key:
        env["LAYA_API_KEY"] = api_key
    return _KeepTail(our_config(checkpoints, port), env, "http://127.0.0.1:%d" % port, timeout=300)


def upstream_serve(checkpoints: dict[str, str], api_key: str | None = API_KEY) -> UpstreamServe:
    """Upstream's laya-serve configured as `our_config(checkpoints)` is: the same names, directories and routing."""
    return UpstreamServe(checkpoints, api_key=api_key, **upstream_env(our_config(checkpoints, 0)))


@pytest.fixture(scope="session")
def multilingual_checkpoint(tmp_path_factory) -> str:
    """A multilingual-shaped tiny checkpoint from make-checkpoint (what `make checkpoint` writes)."""
    from model.make_checkpoint import make_checkpoint

    with warnings.catch_warnings(action="ignore"):
        return make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "tiny-multilingual"), "tiny-multilingual")


def require_upstream() -> None:
    """Skip without upstream laya installed, except in CI (`CI` set), where a missing reference fails."""
    try:
        import laya.serve  # noqa: F401
    except ImportError as exc:
        reason = "the upstream tests need laya==0.4.15 (the dev extra installs it: pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail("%s (%s)" % (reason, exc), pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def served_checkpoints(tiny_checkpoint, multilingual_checkpoint) -> dict[str, str]:
    """{served name: checkpoint directory}, the same on both servers (which need upstream laya installed)."""
    require_upstream()
    return {"english": tiny_checkpoint, "multilingual": multilingual_checkpoint}


@contextlib.contextmanager
def _serving(request, name: str, runner):
    """`runner` started as the session's `Server` called `name`; its log tail is shown when a test failed."""
    failed = request.session.testsfailed
    with runner as running:
        server = Server(name, running.base, API_KEY, running.log_tail)
        yield server
        tr = request.config.pluginmanager.get_plugin("terminalreporter")
        if request.session.testsfailed > failed and tr is not None:
            tr.write_sep("-", "%s output (tail)" % name)
            tr.write_line(server.log_tail(6000))


@pytest.fixture(scope="session")
def upstream(served_checkpoints, request):
    """Upstream's laya-serve on the served checkpoints, with API_KEY set."""
    with _serving(request, "upstream laya-serve", upstream_serve(served_checkpoints)) as server:
        yield server


@pytest.fixture(scope="session")
def ours(served_checkpoints, request):
    """laya-fleet's app (`serve run` of configs/local.yaml) on the served checkpoints, LAYA_API_KEY set."""
    with _serving(request, "laya-fleet serve run", our_serve(served_checkpoints)) as server:
        yield server
