"""Faults of the offline job: bad input files, a bad --output, a failed run, a SIGKILLed driver.

Refusals happen before any work (no Ray, exit 2, one line naming the file and column); with --skip-bad-files the
bad files are skipped and reported. The Ray tests run the job on a `ray start --head` cluster of their own
(tests/test_offline_ray.py's fixture), or on the local Ray the CLI starts itself, with real Parquet files.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app import offline
from tests.test_offline import EXAMPLE_QUESTIONS, expected_error, make_json_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 128


def job_args(inp, out, ckpt, *extra) -> list[str]:
    """The CLI's arguments for the test inputs' JSON-string state column."""
    return ["--input", str(inp), "--output", str(out), "--questions", EXAMPLE_QUESTIONS,
            "--state-column", "state_json", "--json-state", "--id-column", "id", "--checkpoint", ckpt,
            "--num-gpus", "0", "--max-len", str(MAX_LEN), "--no-ray-progress", "--progress-interval", "1e9", *extra]


def wrong_typed(path: str, n: int = 12) -> None:
    """A Parquet file whose state column is int64."""
    pq.write_table(pa.table({"id": ["w-%d" % i for i in range(n)], "state_json": list(range(n)),
                             "score_in": [0.5] * n}), path)


def truncated(src: str, dst: str) -> None:
    """`dst`: the first half of Parquet file `src` (no footer)."""
    data = open(src, "rb").read()
    with open(dst, "wb") as fh:
        fh.write(data[:len(data) // 2])


def one_line_refusal(capsys, code: int, *needles: str) -> str:
    """Assert exit 2 with one stderr line, naming each needle and no traceback; returns the line."""
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, (n, err)
    return err


@pytest.fixture
def inputs(tmp_path):
    """Two good files of 20 rows under tmp_path/in."""
    return make_json_inputs(str(tmp_path / "in"), sizes=(20, 20))


# -- refused before any work -------------------------------------------------------------------
def test_wrong_typed_state_column_exits_2_before_work(tmp_path, capsys, tiny_checkpoint, inputs, monkeypatch):
    from serve_app.offline import driver

    inits = []  # the driver attaching to or starting Ray (a session-wide Ray of other modules may be up)
    real_init = driver.init_ray
    monkeypatch.setattr(driver, "init_ray", lambda *a, **k: inits.append(a) or real_init(*a, **k))
    wrong_typed(str(tmp_path / "in" / "part-05.parquet"))
    code = offline.main(job_args(tmp_path / "in", tmp_path / "out", tiny_checkpoint, "-q"))
    one_line_refusal(capsys, code, "part-05.parquet", "'state_json'", "int64", "--skip-bad-files")
    assert not (tmp_path / "out").exists() and inits == []


def test_column_type_differing_between_files_exits_2(tmp_path, capsys, tiny_checkpoint, inputs):
    t = pq.read_table(inputs[1])
    pq.write_table(t.set_column(0, "id", pa.array(range(t.num_rows))), inputs[1])
    code = offline.main(job_args(tmp_path / "in", tmp_path / "out", tiny_checkpoint, "-q"))
    one_line_refusal(capsys, code, "part-01.parquet", "'id'", "int64, but string in the other inputs")


def test_truncated_file_exits_2_naming_it(tmp_path, capsys, tiny_checkpoint, inputs):
    truncated(inputs[0], str(tmp_path / "in" / "part-07.parquet"))
    code = offline.main(job_args(tmp_path / "in", tmp_path / "out", tiny_checkpoint, "-q"))
    one_line_refusal(capsys, code, "part-07.parquet", "cannot read the Parquet footer")
    assert not (tmp_path / "out").exists()


def test_output_that_is_a_file_or_cannot_be_created_exits_2(tmp_path, capsys, tiny_checkpoint, inputs):
    afile = tmp_path / "taken"
    afile.write_text("x")
    code = offline.main(job_args(tmp_path / "in", afile, tiny_checkpoint, "-q"))
    one_line_refusal(capsys, code, "--output %s is a file" % afile)
    code = offline.main(job_args(tmp_path / "in", afile / "sub", tiny_checkpoint, "-q"))
    one_line_refusal(capsys, code, "--output %s cannot be written: Not a directory" % (afile / "sub"))
    code = offline.main(job_args(tmp_path / "in", tmp_path / "out", tiny_checkpoint, "-q",
                                 "--summary-json", str(tmp_path / "nowhere" / "s.json")))
    one_line_refusal(capsys, code, "--summary-json")
    assert afile.read_text() == "x" and not (tmp_path / "out").exists()


# -- on a cluster ------------------------------------------------------------------------------
def outputs_match_inputs(inputs: list[str], out) -> int:
    """Assert each input's output holds its rows once, in order, errors where expected; returns rows checked."""
    n = 0
    for p in inputs:
        inp, o = pq.read_table(p), pq.read_table(os.path.join(str(out), os.path.basename(p)))
        assert o.column("id").to_pylist() == inp.column("id").to_pylist()
        for cell, err, value in zip(inp.column("state_json").to_pylist(), o.column("error").to_pylist(),
                                    o.column("intent").to_pylist()):
            want = expected_error(cell)
            assert (err is None and value is not None) if want is None else (err or "").startswith(want)
        n += o.num_rows
    return n


@pytest.mark.slow
def test_skip_bad_files_scores_the_good_ones(cluster, tmp_path, capsys, tiny_checkpoint, inputs):
    wrong_typed(str(tmp_path / "in" / "part-05.parquet"), n=12)
    truncated(inputs[0], str(tmp_path / "in" / "part-07.parquet"))
    out = tmp_path / "out"
    code = offline.main(job_args(tmp_path / "in", out, tiny_checkpoint, "--address", cluster["gcs"],
                                 "--skip-bad-files", "-q"))
    printed = capsys.readouterr().out
    assert code == 0, printed
    s = json.load(open(out / "_summary.json"))
    assert (s["files_scored"], s["files_bad"], s["input_files"], s["rows"]) == (2, 2, 4, 40)
    assert s["rows_not_scored"] == 12  # the truncated file's row count is not known
    assert [(os.path.basename(b["file"]), b["rows"]) for b in s["bad_files"]] == [("part-05.parquet", 12),
                                                                                   ("part-07.parquet", None)]
    assert "2 bad (skipped)" in printed and "2 bad file(s), 12 rows not scored" in printed
    assert outputs_match_inputs(inputs, out) == 40
    assert sorted(n for n in os.listdir(out) if n.endswith(".parquet")) == ["part-00.parquet", "part-01.parquet"]


def corrupt_data_page(path: str) -> None:
    """Overwrite the first page header of an uncompressed Parquet file (its footer stays readable)."""
    with open(path, "r+b") as fh:
        fh.seek(4)
        fh.write(b"\xff" * 64)


@pytest.mark.slow
def test_failed_job_leaves_nothing_that_blocks_the_next_run(cluster, tmp_path, capsys, tiny_checkpoint):
    paths = make_json_inputs(str(tmp_path / "in"), sizes=(20,))
    good = pq.read_table(paths[0])
    pq.write_table(good, paths[0], compression="none")
    corrupt_data_page(paths[0])
    out = tmp_path / "out"
    argv = job_args(tmp_path / "in", out, tiny_checkpoint, "--address", cluster["gcs"], "-q")
    assert offline.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("offline: the job failed: "), err[-5:]
    assert not out.exists()  # the run created the directory and completed nothing: it is gone
    pq.write_table(good, paths[0])  # the input fixed, the same command works
    assert offline.main(argv) == 0
    assert outputs_match_inputs(paths, out) == 20


def start_driver(argv: list[str], env: dict, log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "serve_app.offline", *argv], cwd=REPO, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def kill_after_first_file(proc: subprocess.Popen, out, n_files: int, log: str, timeout: float = 240) -> int:
    """SIGKILL the driver once its first file is marked done; returns how many files were done then."""
    deadline = time.time() + timeout
    while not glob.glob(os.path.join(str(out), "_progress", "*.json")):
        assert proc.poll() is None and time.time() < deadline, open(log).read()[-3000:]
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(glob.glob(os.path.join(str(out), "_progress", "*.json")))
    assert done < n_files, "the driver finished before it could be killed"
    return done


@pytest.mark.slow
def test_sigkilled_driver_rerun_loses_and_duplicates_no_row(cluster, tmp_path, tiny_checkpoint):
    """A driver attached to the cluster is SIGKILLed after its first file: the cluster ends the dead job's
    actors, and a re-run skips the done files and writes every other row exactly once."""
    from ray.util.state import list_actors

    paths = make_json_inputs(str(tmp_path / "in"), sizes=(24,) * 5)
    out, log = tmp_path / "out", str(tmp_path / "driver.log")
    argv = job_args(tmp_path / "in", out, tiny_checkpoint, "--address", cluster["gcs"], "--max-batch-rows", "1",
                    "--batch-size", "8")
    done = kill_after_first_file(start_driver(argv, cluster["env"], log), out, len(paths), log)
    import ray

    me = ray.get_runtime_context().get_job_id()
    deadline = time.time() + 60
    while True:  # the killed driver's actors (scorers, reports, Ray Data's own) are ended by the cluster
        listed = list_actors(address=cluster["dashboard"], filters=[("state", "=", "ALIVE")])
        alive = [a for a in listed if a.job_id != me]
        if not alive or time.time() > deadline:
            break
        time.sleep(1)
    assert not alive, [(a.class_name, a.job_id) for a in alive]
    assert offline.main(argv + ["-q"]) == 0
    s = json.load(open(out / "_summary.json"))
    assert (s["files_skipped_done"], s["files_scored"]) == (done, len(paths) - done)
    assert outputs_match_inputs(paths, out) == 24 * len(paths)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def session_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose command line or environment names `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open("/proc/%s/cmdline" % pid, "rb").read().replace(b"\0", b" ")
            env = open("/proc/%s/environ" % pid, "rb").read()
        except OSError:
            continue
        if marker.encode() in cmd or marker.encode() in env:
            found.append((int(pid), cmd.decode(errors="replace")[:120]))
    return found


@pytest.mark.slow
def test_sigkilled_local_driver_takes_its_ray_with_it(tmp_path, tiny_checkpoint):
    """Without --address the CLI starts a local Ray; SIGKILLing the driver ends that Ray's GCS, raylet and
    dashboard at once (they share its fate) and its workers soon after: no process of the session survives."""
    paths = make_json_inputs(str(tmp_path / "in"), sizes=(24,) * 4)
    ray_tmp = "/tmp/lfl-%d" % os.getpid()  # short: Ray's unix sockets live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="disabled")
    out, log = tmp_path / "out", str(tmp_path / "driver.log")
    try:
        proc = start_driver(job_args(tmp_path / "in", out, tiny_checkpoint, "--max-batch-rows", "1",
                                     "--batch-size", "8"), env, log)
        kill_after_first_file(proc, out, len(paths), log)
        deadline = time.time() + 45
        while session_processes(ray_tmp) and time.time() < deadline:
            time.sleep(1)
        left = session_processes(ray_tmp)
        assert not left, left
    finally:
        for pid, _ in session_processes(ray_tmp):  # only the processes of this Ray cluster's session dir, by id
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_reaper_ends_what_a_killed_driver_started_and_nothing_else(tmp_path):
    """A 'driver' with a child from before the reaper (left alone) and grandchildren from after (killed)."""
    from serve_app.offline import reaper

    code = ("import subprocess, sys, time\n"
            "old = subprocess.Popen(['sleep', '60'])\n"
            "print(old.pid, flush=True); sys.stdin.readline()\n"
            "new = subprocess.Popen(['sh', '-c', 'sleep 60 & sleep 60'])\n"
            "time.sleep(60)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    old = int(driver.stdout.readline())
    trace = str(tmp_path / "followed")
    watcher = reaper.start(driver.pid, {old}, trace=trace)
    driver.stdin.write("\n")
    driver.stdin.flush()
    deadline = time.time() + 10
    while len(reaper.descendants(driver.pid)) < 4 and time.time() < deadline:  # old, reaper, sh and its sleeps
        time.sleep(0.1)
    new = reaper.descendants(driver.pid, frozenset({old, watcher.pid}))
    assert len(new) == 3, new

    def followed() -> set[int]:
        try:
            return {int(x) for x in open(trace).read().split()}
        except OSError:
            return set()

    # the reaper follows what it has seen in a scan (every 0.5 s): on a loaded machine its first scan can come
    # after these were started, so the driver dies only once it follows them
    deadline = time.time() + 30
    while not new <= followed() and time.time() < deadline:
        time.sleep(0.1)
    assert new <= followed(), (new, followed())
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    watcher.wait(10)
    try:
        assert all(reaper.start_time(p) is None or open("/proc/%d/stat" % p).read().split()[2] == "Z" for p in new)
        assert reaper.start_time(old) is not None
    finally:
        os.kill(old, signal.SIGKILL)
