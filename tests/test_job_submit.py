"""README's `ray job submit` sequence, run as written: the fenced block marked `# job-submit:` in README.md.

The block runs in one bash, in a fresh copy of the repository's files (its `.venv` linked to this one), with
HOME a new empty directory (no `~/.ray/auth_token`: the block's own commands set token auth up) and `python`
off the PATH unless the block's `. .venv/bin/activate` puts the venv's there. Three things differ from a
user's shell, for sharing this machine: `ray start` gets this test's free ports and `--temp-dir` appended,
RAY_API_SERVER_ADDRESS points the job CLI at that dashboard (it overrides `--address`), and Ray gets
conftest.py's RAY_TEST_ENV like every Ray of the suite (workers on demand, longer proxy start-up checks); the
block's `ray stop` (which stops every Ray of the machine) is left out: the test ends its own cluster's
processes by id.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request

import pyarrow.parquet as pq
import pytest

from tests.conftest import RAY_TEST_ENV
from tests.test_offline_ray import _free_ports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "# job-submit:"
pytestmark = pytest.mark.slow
# the whole block: about 45 s on an idle 2-core machine, 140 s beside the other lane of `make test`
JOB_LIMIT_S = 480


def readme_block() -> list[str]:
    """The command lines of README.md's `# job-submit:` block, continuation lines joined, comments kept."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    found = re.findall(r"^```(?:sh|bash)\n(%s.*?)^```" % re.escape(MARKER), text, flags=re.S | re.M)
    assert len(found) == 1, "README.md needs exactly one sh block starting with %r" % MARKER
    block = found[0]
    return [ln for ln in block.replace("\\\n", " ").splitlines()[1:] if ln.strip()]


def copy_of_repo(dst: str) -> None:
    """The repository's tracked and untracked-but-not-ignored files, as a fresh clone has them, plus `.venv`."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for n in filter(None, names):
        src = os.path.join(REPO, n)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dst, n)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, n))
    os.symlink(os.path.join(REPO, ".venv"), os.path.join(dst, ".venv"))


def processes_with(marker: str) -> list[int]:
    """Pids of the processes whose environment holds `marker` (what this test's shell started)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in open("/proc/%s/environ" % pid, "rb").read():
                pids.append(int(pid))
        except OSError:
            continue
    return pids


def stop_processes(marker: str) -> None:
    """SIGTERM, then SIGKILL, each process of this test's cluster, by id."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        for pid in processes_with(marker):
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.time() + wait
        while processes_with(marker) and time.time() < deadline:
            time.sleep(0.5)


def _job_states(dash: int, home: str) -> str:
    """The job server's list of jobs (status, message) and the last job's log tail, for a failure message."""
    token = os.path.join(home, ".ray", "auth_token")
    headers = {"Authorization": "Bearer " + open(token).read().strip()} if os.path.exists(token) else {}

    def get(path: str):
        req = urllib.request.Request("http://127.0.0.1:%d%s" % (dash, path), headers=headers)
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    try:
        jobs = get("/api/jobs/")
    except (OSError, ValueError) as e:
        return "job server did not answer: %s" % e
    lines = ["%s %s %s" % (j.get("submission_id"), j.get("status"), (j.get("message") or "")[:300]) for j in jobs]
    if jobs:
        sid = jobs[-1].get("submission_id")
        try:
            lines.append(get("/api/jobs/%s/logs" % sid).get("logs", "")[-4000:])
        except (OSError, ValueError) as e:
            lines.append("no logs: %s" % e)
    return "\n".join(lines)


def test_readme_job_submit_commands_work_as_written():
    lines = readme_block()
    assert any(ln.startswith("ray job submit ") for ln in lines) and "ray stop" in lines, lines
    tmp = tempfile.mkdtemp(prefix="lfj-", dir="/tmp")  # short: Ray's unix sockets live under it
    clone, home, ray_tmp = (os.path.join(tmp, d) for d in ("clone", "home", "ray"))
    os.makedirs(home)
    copy_of_repo(clone)
    gcs, dash, agent, agent_grpc, client, metrics, rtenv = _free_ports(7)
    ports = ("--port=%d --dashboard-port=%d --dashboard-agent-listen-port=%d --dashboard-agent-grpc-port=%d "
             "--ray-client-server-port=%d --metrics-export-port=%d --runtime-env-agent-port=%d --temp-dir=%s "
             "--disable-usage-stats" % (gcs, dash, agent, agent_grpc, client, metrics, rtenv, ray_tmp))
    script = ["set -eo pipefail"]
    for ln in lines:
        if ln.strip() == "ray stop":
            continue
        script.append(ln.split(" #")[0] + " " + ports if ln.startswith("ray start ") else ln)
    venv_bin = os.path.join(REPO, ".venv", "bin")
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and os.path.realpath(p) != os.path.realpath(venv_bin))
    marker = "LAYA_FLEET_JOB_SUBMIT_TEST=%s" % tmp
    env = {"HOME": home, "PATH": path, "LANG": "C.UTF-8", "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:%d" % dash,
           marker.split("=")[0]: tmp, **RAY_TEST_ENV}
    out_log, err_log = os.path.join(tmp, "stdout.log"), os.path.join(tmp, "stderr.log")
    try:
        # output to files, so a run past the limit still shows how far it got (and the job's own state)
        with open(out_log, "w") as so, open(err_log, "w") as se:
            try:
                rc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=clone, env=env, stdout=so, stderr=se,
                                    text=True, timeout=JOB_LIMIT_S).returncode
            except subprocess.TimeoutExpired:
                rc = None
        stdout, stderr = open(out_log).read(), open(err_log).read()
        assert rc == 0, "%s\n-- stdout:\n%s\n-- stderr:\n%s\n-- jobs:\n%s" % (
            "exit %s" % rc if rc is not None else "still running after %d s" % JOB_LIMIT_S, stdout[-4000:],
            stderr[-3000:], _job_states(dash, home))
        assert "succeeded" in stdout and "offline scoring summary" in stdout, stdout[-3000:]
        assert os.path.exists(os.path.join(home, ".ray", "auth_token"))  # token auth, set up by the block
        inp = pq.read_table(os.path.join(clone, "data", "in", "sample.parquet"))
        out = pq.read_table(os.path.join(clone, "data", "out", "sample.parquet"))
        assert out.column("id").to_pylist() == inp.column("id").to_pylist()
        assert out.column("error").null_count == out.num_rows and out.column("intent").null_count == 0
    finally:
        stop_processes(marker)
        shutil.rmtree(tmp, ignore_errors=True)
