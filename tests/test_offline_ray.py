"""Offline scoring on a real local Ray cluster (`ray start --head`, dashboard and job server included).

The cluster declares 4 logical CPUs and 2 logical GPUs: "GPU" actors get `CUDA_VISIBLE_DEVICES` and
`ray.get_gpu_ids()` like on a GPU node, and score on CPU because torch has no CUDA here. Inputs are real
Parquet files with bad rows of every kind; outputs are compared with `Engine.predict_batch`, and exactly
with one-row-at-a-time scoring where batch composition is taken out of the picture.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from serve_app import offline
from serve_app.offline.io import PROGRESS_DIR
from serve_app.offline.summary import PIECES
from tests.test_offline import (  # noqa: F401 - one_thread is a fixture
    EXAMPLE_QUESTIONS,
    compare_to_reference,
    expected_error,
    make_json_inputs,
    one_thread,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
QUESTIONS = json.load(open(EXAMPLE_QUESTIONS))
MAX_LEN, MAX_CHARS = 128, 20000
pytestmark = pytest.mark.slow


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def own_cluster():
    """A head node of our own on free ports (other Ray clusters may run on this machine); yields addresses.

    conftest.py's session fixture `cluster` runs it once for the Ray Data modules of one pytest process."""
    import ray

    if ray.is_initialized():  # e.g. the Serve tests' session cluster; one driver attaches to one cluster
        pytest.skip("this process is attached to another Ray cluster; run tests/test_offline_ray.py on its own "
                    "or before modules that keep a session-wide Ray (alphabetical order does)")
    tmp = tempfile.mkdtemp(prefix="lfo-", dir="/tmp")  # short: Ray's unix sockets live under it
    gcs, dash, agent, agent_grpc, client, metrics, rtenv = _free_ports(7)
    env = dict(os.environ, PATH=BIN + os.pathsep + os.environ.get("PATH", ""), RAY_AUTH_MODE="disabled")
    cmd = [os.path.join(BIN, "ray"), "start", "--head", "--block", "--port", str(gcs), "--num-cpus", "4",
           "--num-gpus", "2", "--temp-dir", tmp, "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--ray-client-server-port", str(client), "--metrics-export-port", str(metrics),
           "--runtime-env-agent-port", str(rtenv), "--disable-usage-stats"]
    log = open(os.path.join(tmp, "ray-start.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        url = "http://127.0.0.1:%d" % dash
        deadline = time.time() + 90
        while True:  # the job server answers once the dashboard and its agent are up
            try:
                with urllib.request.urlopen(url + "/api/jobs/", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None and time.time() < deadline, open(log.name).read()[-3000:]
            time.sleep(0.5)
        ray.init(address="127.0.0.1:%d" % gcs, log_to_driver=False)
        yield {"gcs": "127.0.0.1:%d" % gcs, "dashboard": url, "env": env, "tmp": tmp}
    finally:
        ray.shutdown()
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the node's processes on SIGTERM
        try:
            proc.wait(3)  # it takes over 10 s there; nothing of the node is needed after the tests
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the node we started, nothing else
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Three input files: 60 and 45 rows (bad cells of every kind among them) and an empty one."""
    d = tmp_path_factory.mktemp("offline")
    paths = make_json_inputs(str(d / "in"), sizes=(60, 45, 0))
    qf = d / "questions.json"
    qf.write_text(json.dumps(QUESTIONS))
    return {"dir": d, "inputs": paths, "questions": str(qf)}


def run_offline(data, ckpt, out, on_progress=None, **kw):
    """Run the job in this process (attached to the session's `cluster`); returns the summary."""
    cfg = offline.OfflineConfig(input=[os.path.dirname(data["inputs"][0])], output=str(out),
                                questions=data["questions"], state_column="state_json", json_state=True,
                                id_column="id", passthrough=["score_in"], checkpoint=ckpt, max_len=MAX_LEN,
                                max_state_chars=MAX_CHARS, progress_interval=1e9, ray_progress=False, **kw)
    return offline.run(cfg, on_progress=on_progress)


def outputs(out) -> dict[str, pa.Table]:
    """Output tables by file name."""
    return {n: pq.read_table(os.path.join(out, n)) for n in sorted(os.listdir(out)) if n.endswith(".parquet")}


def good_states(inp: pa.Table) -> tuple[list[int], list]:
    """(row positions, states) of the usable cells of an input table."""
    cells = inp.column("state_json").to_pylist()
    idx = [i for i, c in enumerate(cells) if expected_error(c) is None]
    return idx, [json.loads(cells[i]) for i in idx]


def one_row_reference(engine, states) -> list[dict]:
    """Answers with every row scored alone: what the pipeline gives with --max-batch-rows 1."""
    from model.decode import result

    prepared = engine.prepare(QUESTIONS, max_len=MAX_LEN)
    refs = []
    for s in states:
        enc = engine.encode(s, prepared)
        outs = [engine.score([r]) for r in enc.rows]
        logits = np.full((len(outs), max(o[0].shape[1] for o in outs)), -1e4, np.float32)
        for j, (lg, _) in enumerate(outs):
            logits[j, :lg.shape[1]] = lg[0]
        refs.append(result(prepared.questions, prepared.heads, enc, logits, np.array([a[0] for _, a in outs]),
                           engine.temperatures))
    return refs


def check_outputs(data, out, engine, refs_fn, tol):
    """Every input row is in its output file, in order, with its id, passthrough, error or answers."""
    got = outputs(out)
    assert sorted(got) == sorted(os.path.basename(p) for p in data["inputs"])
    checked = 0
    for p in data["inputs"]:
        inp, o = pq.read_table(p), got[os.path.basename(p)]
        assert o.num_rows == inp.num_rows
        assert o.column("id").to_pylist() == inp.column("id").to_pylist()
        assert o.column("score_in").to_pylist() == inp.column("score_in").to_pylist()
        errors = o.column("error").to_pylist()
        for cell, err in zip(inp.column("state_json").to_pylist(), errors):
            want = expected_error(cell)
            assert (err is None) if want is None else (err or "").startswith(want), (cell and cell[:40], err)
        idx, states = good_states(inp)
        if not idx:
            continue
        rows = o.take(pa.array(idx)).to_pylist()
        compare_to_reference(rows, refs_fn(engine, states), QUESTIONS, tol=tol)
        bad = o.filter(pa.compute.invert(pa.compute.is_null(o.column("error"))))
        assert all(v is None for c in ("intent", "urgency", "angry", "input_tokens") for v in bad.column(c).to_pylist())
        checked += len(idx)
    return checked


@pytest.fixture(scope="module")
def clean(cluster, data, tiny_checkpoint):
    """One uninterrupted run with one row per forward (values independent of batch composition)."""
    out = data["dir"] / "clean"
    summary = run_offline(data, tiny_checkpoint, out, num_gpus=0, num_actors=1, max_batch_rows=1, batch_size=8)
    return {"out": str(out), "summary": summary, "tables": outputs(out)}


def test_cuda_graphs_on_cpu_actors_is_warned_not_ignored(cluster, caplog):
    """--cuda-graphs with CPU scorer actors (or a backend without graphs) cannot take effect: the plan carries
    it to the scorers and the driver says it does nothing here."""
    from serve_app.offline.driver import plan_actors

    cfg = offline.OfflineConfig(input=["x"], output="y", questions="q", state_column="s", checkpoint="c",
                                num_gpus=0, cuda_graphs=True)
    with caplog.at_level("WARNING", logger="serve_app.offline"):
        plan = plan_actors(cfg)
    assert plan["scorer_options"]["cuda_graphs"] is True
    assert "--cuda-graphs has no effect here" in caplog.text and "0 GPUs" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="serve_app.offline"):
        assert plan_actors(offline.OfflineConfig(**{**cfg.__dict__, "cuda_graphs": False}))[
            "scorer_options"]["cuda_graphs"] is False
    assert "--cuda-graphs" not in caplog.text


@pytest.mark.usefixtures("one_thread")
def test_end_to_end_on_gpu_actors(cluster, data, tiny_checkpoint, engine):
    """Two 'GPU' scorer actors, token-budget batches: rows out == rows in, bad rows carry the reason,
    good rows equal Engine.predict_batch; a re-run skips every file."""
    out = data["dir"] / "e2e"
    s = run_offline(data, tiny_checkpoint, out, num_gpus=2, batch_size=16)
    n_rows = sum(pq.read_metadata(p).num_rows for p in data["inputs"])
    n_bad = sum(expected_error(c) is not None for p in data["inputs"]
                for c in pq.read_table(p).column("state_json").to_pylist())
    assert (s["rows"], s["errors"], s["files_scored"], s["files_left"]) == (n_rows, n_bad, 3, 0)
    assert n_bad >= 7 and set(s["error_kinds"]) == {"state is null", "state is empty", "state is not valid JSON",
                                                    "state JSON must be an object, array or string",
                                                    "state too large"}
    checked = check_outputs(data, out, engine, lambda e, st: e.predict_batch(st, QUESTIONS, max_len=MAX_LEN), 1e-4)
    assert checked == n_rows - n_bad
    # one scorer actor per GPU, each on its own device id; budgets, padding and token counts reported
    assert s["gpus"] == 2 and s["actors"] == 2 and len(s["gpu_ids"]) == 2
    assert s["budgets"] == [8192] and s["oom_retries"] == 0 and 0 < s["padding_overhead"] < 1
    assert s["tokens"] == sum(pa.compute.sum(t.column("input_tokens")).as_py() or 0 for t in outputs(out).values())
    assert s["scorer_tokens"] == s["tokens"] and s["tokens_per_s"] > 0
    # start-up piece by piece, adding up to run start -> first scorer ready; CPU pools sized to the one spare CPU
    su = s["startup"]
    assert su["total_s"] > 0 and len(su["actors_ready_s"]) == 2 and su["first_batch_s"] >= 0
    assert all(su[k] >= 0 for k, _ in PIECES) and abs(sum(su[k] for k, _ in PIECES) - su["total_s"]) < 0.02
    assert (s["stages"]["tokenize_tasks"], s["stages"]["decode_tasks"], s["stages"]["spare_cpus"]) == (1, 1, 1)
    assert s["sample"]["states"] > 0 and s["sample"]["tokenize_tokens_per_cpu_s"] > 0
    assert json.load(open(out / "_summary.json"))["rows"] == n_rows
    assert outputs(out)["part-02.parquet"].num_rows == 0
    assert outputs(out)["part-02.parquet"].schema.field("intent_probabilities").type == pa.map_(pa.string(),
                                                                                                 pa.float64())
    # a second run finds every file done and scores nothing
    again = run_offline(data, tiny_checkpoint, out, num_gpus=2, batch_size=16)
    assert (again["files_skipped_done"], again["files_scored"], again["rows"]) == (3, 0, 0)


@pytest.mark.usefixtures("one_thread")
def test_one_row_forwards_are_exact(clean, data, engine):
    """With one row per forward, the Ray pipeline's values equal in-process scoring bit for bit."""
    checked = check_outputs(data, clean["out"], engine, one_row_reference, tol=0.0)
    assert checked > 80 and clean["summary"]["actors"] == 1 and clean["summary"]["gpus"] == 0


def test_resume_after_interruption_with_actor_killed_equals_clean_run(cluster, clean, data, tiny_checkpoint):
    """A run that stopped after one file, plus the debris a crash leaves, is resumed while its scorer actor
    is killed (ray.kill) mid-run: done files are skipped, Ray restarts the actor and retries its batches,
    and the output equals one clean run exactly, every row once."""
    import ray
    from ray.util.state import list_actors

    out = data["dir"] / "resumed"
    first = run_offline(data, tiny_checkpoint, out, num_gpus=0, num_actors=1, max_batch_rows=1, batch_size=8,
                        max_files=1)
    seen = {a.actor_id for a in list_actors(address=cluster["dashboard"])}  # earlier runs' scorer actors
    assert (first["files_scored"], first["files_left"]) == (1, 2)
    done = os.path.join(out, "part-00.parquet")
    st = os.stat(done)
    marker = os.path.join(out, PROGRESS_DIR, "part-00.parquet.json")
    tries = []
    for _ in range(3):
        # a crash while writing part-01 (temporary file), and one between its output and its marker
        for name in os.listdir(out):
            if name.startswith(("part-01", "part-02")):
                os.remove(os.path.join(out, name))
        for name in os.listdir(os.path.join(out, PROGRESS_DIR)):
            if os.path.join(out, PROGRESS_DIR, name) != marker:
                os.remove(os.path.join(out, PROGRESS_DIR, name))
        with open(os.path.join(out, "part-01.parquet.tmp-4242"), "wb") as fh:
            fh.write(b"half a file")
        pq.write_table(pa.table({"garbage": [1]}), os.path.join(out, "part-01.parquet"))

        killed, stop, latest = [], threading.Event(), {"rows": 0}

        def kill_scorer_actor(killed=killed, stop=stop, latest=latest):
            # a thread: the scorer actor is killed as soon as it is up, so its batches are still to come or in flight
            while not stop.is_set() and not killed:
                up = [a for a in list_actors(address=cluster["dashboard"], filters=[("state", "=", "ALIVE")])
                      if "ScoreStage" in a.class_name and a.actor_id not in seen]
                if up:
                    handle = ray._private.worker.global_worker.core_worker.get_actor_handle(
                        ray.ActorID.from_hex(up[0].actor_id))
                    ray.kill(handle, no_restart=False)
                    killed.append((up[0].actor_id, up[0].pid, latest["rows"]))
                    seen.add(up[0].actor_id)
                time.sleep(0.05)

        killer = threading.Thread(target=kill_scorer_actor, daemon=True)
        killer.start()
        try:
            second = run_offline(data, tiny_checkpoint, out, on_progress=lambda snap, latest=latest: latest.update(
                rows=snap["rows"]), num_gpus=0, num_actors=1, max_batch_rows=1, batch_size=8)
        finally:
            stop.set()
            killer.join(30)
        assert (second["files_skipped_done"], second["files_scored"], second["files_left"]) == (1, 2, 0)
        assert os.stat(done).st_mtime_ns == st.st_mtime_ns and os.stat(done).st_ino == st.st_ino  # not rewritten
        assert not [n for n in os.listdir(out) if ".tmp-" in n]
        got = outputs(out)
        assert sorted(got) == sorted(clean["tables"])
        for name, t in clean["tables"].items():
            assert got[name].equals(t), name
        assert killed, "the run finished before the actor could be killed"
        actor, pid, rows_at_kill = killed[0]
        assert rows_at_kill < second["rows"]  # the driver had not received every row when the actor was killed
        # the same actor came back in a new process and scored more, unless the kill landed after the actor
        # had scored its last batch: then the round is repeated
        procs = {k.split("/")[1]: v for k, v in second["budget_history"].items() if k.startswith(actor + "/")}
        tries.append(second["budget_history"])
        if str(pid) in procs and len(procs) >= 2 and second["actor_restarts"] >= 1:
            break
    else:
        raise AssertionError("the killed actor never came back with work left in 3 rounds: %s" % tries)


@pytest.mark.usefixtures("one_thread")
def test_ray_job_submit_struct_column(cluster, tmp_path, tiny_checkpoint, engine):
    """`ray job submit --working-dir . --runtime-env configs/offline-job.yaml -- python -m serve_app.offline`
    on a struct column: the job succeeds and its rows equal predict_batch."""
    rng = np.random.default_rng(1)
    docs = [{"subject": "order %d" % i, "body": " ".join(rng.choice(["late", "refund", "angry", "thanks"], 12)),
             "meta": {"vip": bool(i % 2), "n": i}} for i in range(20)]
    cells = docs[:7] + [None] + docs[7:]
    inp = tmp_path / "in"
    inp.mkdir()
    pq.write_table(pa.table({"id": list(range(21)), "doc": cells}), inp / "docs.parquet")
    out = tmp_path / "out"
    cmd = [os.path.join(BIN, "ray"), "job", "submit", "--address", cluster["dashboard"], "--working-dir", REPO,
           "--runtime-env", os.path.join(REPO, "configs", "offline-job.yaml"), "--",
           "python", "-m", "serve_app.offline", "--input", str(inp), "--output", str(out),
           "--questions", os.path.abspath(EXAMPLE_QUESTIONS), "--state-column", "doc", "--id-column", "id",
           "--checkpoint", tiny_checkpoint, "--num-gpus", "0", "--max-len", str(MAX_LEN), "--no-ray-progress"]
    r = subprocess.run(cmd, env=cluster["env"], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "succeeded" in r.stdout and "offline scoring summary" in r.stdout and "rows       21 (1 errors" in r.stdout
    t = pq.read_table(out / "docs.parquet").to_pylist()
    assert [row["id"] for row in t] == list(range(21)) and t[7]["error"] == "state is null"
    compare_to_reference(t[:7] + t[8:], engine.predict_batch(docs, QUESTIONS, max_len=MAX_LEN), QUESTIONS, tol=1e-4)
