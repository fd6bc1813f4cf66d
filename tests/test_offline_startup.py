"""The offline job's budget choice, CPU-stage sizing and start-up accounting, without a cluster.

The budget choice runs on measured tables and on the real fast backend (its torch ops, on CPU); the sizing on a
real sample of Parquet rows; the start-up pieces on the marks and reports the driver and a real score stage write.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from serve_app import offline
from serve_app.offline.cli import parser
from serve_app.offline.score import ScoreStage, process_started_at
from serve_app.offline.sizing import HEADROOM, Sample, stage_tasks, take_sample
from serve_app.offline.summary import PIECES, format_summary, startup
from serve_app.offline.tokenize import extract_state
from serve_app.planning import pick_budget, probe_rows
from serve_app.scorer import THROUGHPUT_WITHIN, Scorer
from tests.test_offline import EXAMPLE_QUESTIONS, make_json_inputs, one_thread  # noqa: F401 - a fixture

# tokens/s per budget shaped like the H200's offline forward (598k at 16384 and 660k at 65536 were measured there)
H200 = [(16384, 598e3), (32768, 640e3), (65536, 660e3), (131072, 655e3)]


def test_throughput_goal_lands_on_the_forwards_best():
    assert pick_budget(H200, 512) == 32768                          # latency: smallest within 5% of the best
    assert pick_budget(H200, 512, THROUGHPUT_WITHIN) == 65536       # throughput: the best, within noise
    # within noise of the best, the smaller budget wins (less memory, fewer tokens staged before the GPU starts)
    assert pick_budget([(65536, 660e3), (131072, 663e3)], 512, THROUGHPUT_WITHIN) == 65536
    assert pick_budget([(65536, 600e3), (131072, 663e3)], 512, THROUGHPUT_WITHIN) == 131072
    assert pick_budget([], 512, THROUGHPUT_WITHIN) == 512


def test_the_throughput_search_stops_at_the_first_budget_below_the_best(tiny_checkpoint, monkeypatch):
    """Largest first; a budget more than the noise below the best ends the search (the H200's shape: 16384 is
    never run), an out-of-memory skips to the next smaller."""
    s = Scorer(tiny_checkpoint, backend="eager", device="cpu", warmup=False, budget_goal="throughput",
               budget_candidates=[b for b, _ in H200])
    try:
        ran = []
        rates = dict(H200)

        def rate(budget, chunked):
            ran.append(budget)
            if budget == 131072 and oom:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")
            return rates[budget]

        monkeypatch.setattr(s, "_probe_rate", rate)
        oom = False
        assert s._choose_budget() == 65536 and ran == [131072, 65536, 32768]
        ran.clear()
        oom = True
        rates[32768] = 655e3  # within 1% of 65536's 660k: the search goes on, and the smaller one wins
        assert s._choose_budget() == 32768 and ran == [131072, 65536, 32768, 16384]
    finally:
        s.close()


def test_probe_rows_follow_the_job_lengths():
    rows = probe_rows([30, 500, 2, 120], 4000, pad_id=3, arrays=True)
    assert sum(len(r) for r in rows) >= 4000 > sum(len(r) for r in rows) - 500
    assert sorted({len(r) for r in rows}) == [30, 120, 500]          # a length under 4 tokens is left out
    assert [len(r) for r in rows] == sorted((len(r) for r in rows), reverse=True)
    assert all(r.arr.dtype == np.int32 and len(r.arr) == len(r) and max(r.markers) < len(r) for r in rows)
    assert probe_rows([64], 100, 0)[0].arr is None
    with pytest.raises(ValueError, match="at least one length"):
        probe_rows([1, 2], 100, 0)


@pytest.mark.usefixtures("one_thread")
def test_throughput_probe_sizes_the_fast_backend_and_measures_every_budget(tiny_checkpoint):
    """The fast backend cuts chunks at its buffers: sized for the largest candidate first, every candidate measures
    its own chunk size, on rows of the job's lengths; a latency scorer leaves the backend's default size."""
    cands = (256, 512, 1024)
    s = Scorer(tiny_checkpoint, backend="fast", device="cpu", backend_options={"ops": "torch"},
               budget_goal="throughput", probe_budget=True, budget_candidates=cands,
               probe_lengths=[40, 90, 200, 480])
    try:
        assert s.engine.backend.chunk_tokens >= max(cands)
        probe = {int(b): t for b, t in s.stats.budget_probe.items()}
        assert 1024 in probe and set(probe) <= set(cands)
        assert s.budget == pick_budget(list(probe.items()), 512, THROUGHPUT_WITHIN)
        info = s.info()
        assert info["budget_goal"] == "throughput" and info["budget"] == s.budget
        su = info["startup"]
        assert su["probe_s"] > 0 and su["warmup_s"] >= 0 and su["load_s"] > 0
    finally:
        s.close()
    lat = Scorer(tiny_checkpoint, backend="fast", device="cpu", backend_options={"ops": "torch"}, warmup=False)
    try:
        assert lat.engine.backend.chunk_tokens == 16384 and lat.budget_goal == "latency"
    finally:
        lat.close()
    with pytest.raises(ValueError, match="budget_goal"):
        Scorer(tiny_checkpoint, backend="eager", device="cpu", budget_goal="fast")


def test_cuda_graphs_reach_the_fast_backend_and_only_it(tiny_checkpoint):
    """`cuda_graphs` becomes the fast backend's `use_graphs` (graphs on a CPU device are refused, which shows the
    value arrived); a backend without graphs ignores it; the offline job asks for none unless --cuda-graphs."""
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Scorer(tiny_checkpoint, backend="fast", device="cpu", backend_options={"ops": "torch"}, warmup=False,
               cuda_graphs=True)
    s = Scorer(tiny_checkpoint, backend="fast", device="cpu", backend_options={"ops": "torch"}, warmup=False,
               cuda_graphs=False)
    try:
        assert s.engine.backend.engine.use_graphs is False
    finally:
        s.close()
    e = Scorer(tiny_checkpoint, backend="eager", device="cpu", warmup=False, cuda_graphs=True)
    e.close()
    base = ["--input", "x", "--output", "y", "--questions", "q", "--state-column", "s", "--checkpoint", "c"]
    assert parser().parse_args(base).cuda_graphs is False
    assert parser().parse_args(base + ["--cuda-graphs"]).cuda_graphs is True


def test_stage_tasks_from_the_forward_rate():
    fast = Sample(states=512, rows=1536, tokens=250_000, tokenize_cpu_s=0.1, decode_cpu_s=0.025)  # 2.5M, 10M /s
    slow = Sample(states=512, rows=512, tokens=80_000, tokenize_cpu_s=0.4, decode_cpu_s=0.02)     # 200k, 4M /s
    # a 16-core GPU host, one GPU actor: enough tokenize tasks for HEADROOM x the forward, most cores left idle
    st = stage_tasks(1, True, fast, 16, 1.0)
    assert st["tokenize_tasks"] == 2 and st["decode_tasks"] == 1 and st["spare_cpus"] == 14
    assert st["tokenize_tasks"] * st["tokenize_tokens_per_cpu_s"] >= HEADROOM * st["forward_tokens_per_s_assumed"]
    # a slow tokenizer gets more tasks, as far as the CPUs go; the pools never take more than the spare CPUs
    st = stage_tasks(1, True, slow, 16, 1.0)
    assert (st["tokenize_tasks"], st["decode_tasks"], st["tokenize_tasks_needed"]) == (13, 1, 15)
    st = stage_tasks(8, True, slow, 128, 1.0)
    assert st["tokenize_tasks"] == 118 and st["tokenize_tasks"] + st["decode_tasks"] <= st["spare_cpus"]
    # a laptop: 4 CPUs, one CPU actor; a tiny cluster with no CPU to spare still runs one task per pool
    st = stage_tasks(1, False, fast, 4, 1.0)
    assert (st["tokenize_tasks"], st["decode_tasks"], st["spare_cpus"]) == (1, 1, 2)
    st = stage_tasks(2, True, slow, 4, 1.0)
    assert (st["tokenize_tasks"], st["decode_tasks"], st["spare_cpus"]) == (1, 1, 1)
    # explicit counts win; no sample (or one of error rows only) falls back to a slow tokenizer's rate
    st = stage_tasks(1, True, fast, 16, 1.0, tokenize=5, decode=3)
    assert (st["tokenize_tasks"], st["decode_tasks"]) == (5, 3)
    empty = Sample(states=10, tokens=0, tokenize_cpu_s=0.01, decode_cpu_s=0.01)
    assert stage_tasks(1, True, None, 16, 1.0) == stage_tasks(1, True, empty, 16, 1.0)
    assert stage_tasks(1, True, None, 16, 1.0)["tokenize_tasks"] == 6


def test_sample_measures_the_job_rows(tmp_path, tiny_checkpoint, engine):
    paths = make_json_inputs(str(tmp_path / "in"), sizes=(40, 20))
    cfg = offline.OfflineConfig(input=[str(tmp_path / "in")], output=str(tmp_path / "out"),
                                questions=EXAMPLE_QUESTIONS, state_column="state_json", json_state=True,
                                id_column="id", checkpoint=tiny_checkpoint)
    job = offline.prepare_job(cfg)
    s = take_sample(job, job.files, n=32)
    cells = pq.read_table(paths[0]).column("state_json").to_pylist()[:32]
    prepared = engine.prepare(json.load(open(EXAMPLE_QUESTIONS)))
    good = [st for st, _, err in (extract_state(c, True, cfg.max_state_chars) for c in cells) if err is None]
    assert 0 < len(good) < 32
    want = [len(r) for e in engine.encode_many(good, prepared) for r in e.rows]
    assert s.states == 32 and s.rows == len(want) and s.tokens == sum(want)
    assert sorted(s.row_lengths) == sorted(want)
    d = s.as_dict()
    assert d["tokenize_tokens_per_cpu_s"] > 0 and d["decode_tokens_per_cpu_s"] > 0 and s.seconds > 0
    # a first file of error rows only tells nothing: no rates, and sizing falls back to its defaults
    pq.write_table(pa.table({"id": pa.array(["a", "b"]), "state_json": pa.array([None, ""], pa.string()),
                             "score_in": pa.array([0.0, 1.0]), "unused": pa.array([b"", b""])}), paths[0])
    job = offline.prepare_job(cfg)
    s = take_sample(job, job.files)
    assert (s.states, s.tokens, s.rate(s.tokenize_cpu_s)) == (2, 0, None)


def test_new_flags_are_checked_before_any_work(tmp_path, capsys, tiny_checkpoint):
    make_json_inputs(str(tmp_path / "in"), sizes=(5,))
    for flag in ("--tokenize-tasks", "--decode-tasks"):
        rc = offline.main(["--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"), "--questions",
                           EXAMPLE_QUESTIONS, "--state-column", "state_json", "--checkpoint", tiny_checkpoint,
                           flag, "0", "-q"])
        assert rc == 2 and "must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.usefixtures("one_thread")
def test_startup_pieces_add_up_from_a_real_score_stage(tiny_checkpoint):
    """The pieces of `summary.startup` partition run start -> first scorer ready, with a real stage's report."""
    t0 = time.time() - 4.0   # the driver's marks before the pipeline was built (now)
    marks = {"start": t0, "prepared": t0 + 0.5, "sampled": t0 + 0.7, "ray_up": t0 + 3.0, "built": time.time()}
    spec = offline.JobSpec(checkpoint=tiny_checkpoint, questions_json=open(EXAMPLE_QUESTIONS).read(),
                           state_column="state")
    stage = ScoreStage(spec, {"backend": "eager", "device": "cpu", "budget_goal": "throughput"})
    st = stage.stats()
    began = st["started"]
    assert began["entered_at"] <= st["ready_at"] <= time.time()
    assert began["process_at"] is not None and began["process_at"] <= began["entered_at"]
    assert process_started_at() == pytest.approx(began["process_at"], abs=0.02)
    su = startup(marks, [st], first_batch_at=st["ready_at"] + 0.25)
    assert su["total_s"] == pytest.approx(st["ready_at"] - t0, abs=1e-3)
    assert sum(su[k] for k, _ in PIECES) == pytest.approx(su["total_s"], abs=0.01)
    assert su["first_batch_s"] == pytest.approx(0.25, abs=1e-3) and su["ray_init_s"] == pytest.approx(2.3, abs=1e-3)
    # this process imported the package long before the stage: none of that counts as the actor's imports
    assert su["actor_start_s"] == pytest.approx(0.0, abs=0.01) and su["actor_import_s"] >= 0
    assert su["model_load_s"] > 0 and all(su[k] >= 0 for k, _ in PIECES)
    assert startup(marks, [], None) is None and startup({"start": t0}, [st], None) is None
    text = format_summary({**_summary_stub(), "startup": su, "stages": stage_tasks(1, False, None, 4, 1.0)})
    assert "start-up   %.1f s to the first scorer ready: job checks 0.5" % su["total_s"] in text
    assert "CPU stages 1 tokenize and 1 decode task(s)" in text


def _summary_stub() -> dict:
    """The fields `format_summary` prints besides start-up and stages, for a run of no rows."""
    return {"output": "/out", "files_scored": 0, "files_skipped_done": 0, "files_left": 0, "input_files": 0,
            "rows": 0, "errors": 0, "error_kinds": {}, "tokens": 0, "seconds": 1.0, "tokens_per_s": 0.0,
            "rows_per_s": 0.0, "tokens_per_s_after_ready": None, "seconds_to_scorers_ready": None, "actors": 1,
            "actor_restarts": 0, "gpus": 0, "gpu_ids": [], "backend": ["eager"], "devices": ["cpu"],
            "budgets": [8192], "oom_retries": 0, "padding_overhead": 0.0, "packed": False, "forward_s": 0.0}


def test_tokenize_and_decode_workers_do_not_import_torch(tiny_checkpoint):
    """The offline job's CPU stages (and anything that only reads a bundle and tokenizes) run without torch:
    importing it costs each worker seconds of CPU and hundreds of MB while the GPU actors start beside them."""
    code = ("import sys, model, model.codec, model.abstention, serve_app.offline.tokenize, serve_app.offline.decode,"
            " serve_app.offline.write\n"
            "from model.bundle import open_bundle\n"
            "open_bundle(sys.argv[1])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "model.load\n"
            "assert 'torch' in sys.modules\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, tiny_checkpoint], capture_output=True, text=True, cwd=repo,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
