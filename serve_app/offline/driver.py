"""The offline job's driver: check the job, plan the scorer actors, build the Ray Data pipeline, run it.

    read_parquet (projected columns, file path + row hash)
      -> TokenizeStage   CPU tasks: state -> token ids, usage, or an error value
      -> ScoreStage      actor pool, one per GPU (or N CPU actors): Scorer, warmed up, token-budget batches
      -> DecodeStage     CPU tasks: logits -> answers as columns
      -> Collector       on the driver: rows grouped per input file; a complete file is sorted, written, marked

The CPU pools are sized from a sample of the job's rows, which also gives the scorers' warm-up probe its row
lengths (`sizing`). A re-run with the same output directory skips files already done (see `io`). The run
summary comes from the collector's counts, the scorer actors' reports (`score.ScorerReports`) and the driver's
start-up marks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable

from . import reaper
from .config import Job, JobSpec, OfflineConfig
from .decode import DecodeStage
from .io import (
    JOB_FILE,
    SUMMARY_FILE,
    ConfigError,
    InputFile,
    OutputDir,
    atomic_write_json,
    check_columns,
    discover,
    read_footers,
)
from .schema import RAY_PATH, RAY_ROW_HASH, output_fields
from .score import ScorerReports, ScoreStage
from .sizing import Sample, stage_tasks, take_sample
from .summary import summarize
from .tokenize import TokenizeStage
from .write import Collector

log = logging.getLogger("serve_app.offline")


def load_questions(path: str) -> dict:
    """The question mapping from a JSON file; ConfigError says what is wrong."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as e:
        raise ConfigError("cannot read questions file %s: %s" % (path, e)) from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConfigError("questions file %s is not valid JSON: %s" % (path, e)) from None
    if not isinstance(data, dict):
        raise ConfigError("questions file %s must hold a JSON object of question id -> definition, got %s"
                          % (path, type(data).__name__))
    return data


def prepare_questions(cfg: OfflineConfig, questions: dict):
    """The job's `model.codec.Prepared` question set; ConfigError names the question or budget to fix."""
    from model.codec import Codec

    try:
        codec = Codec.open(cfg.checkpoint, warm=False)
        if not questions:
            raise ValueError("the questions file has no questions; add at least one")
        limit = codec.bundle.max_len
        if isinstance(cfg.max_len, int) and not isinstance(cfg.max_len, bool) and cfg.max_len > limit:
            raise ValueError("max_len=%d is longer than the checkpoint's max_len (%d)" % (cfg.max_len, limit))
        return codec.prepare(questions, cfg.max_len, cfg.head_max_len)
    except (ValueError, TypeError) as e:
        raise ConfigError("questions file %s: %s" % (cfg.questions, e)) from None
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


def check_min_confidence(value) -> float | dict[str, float] | None:
    """The job's abstention threshold in its checked form (None: no gate); ConfigError with upstream's text."""
    from model import abstention

    try:
        return abstention.check_optional(value)
    except ValueError as e:
        raise ConfigError("--min-confidence: %s" % e) from None


def prepare_job(cfg: OfflineConfig) -> Job:
    """Check questions, inputs and columns without reading any row; ConfigError on any problem."""
    from model.bundle import checkpoint_hash

    questions = load_questions(cfg.questions)
    prepared = prepare_questions(cfg, questions)
    for name, v, lo in (("batch_size", cfg.batch_size, 1), ("cpus_per_actor", cfg.cpus_per_actor, 0),
                        ("max_state_chars", cfg.max_state_chars, 0)):
        if v is None or v < lo:
            raise ConfigError("%s must be >= %s, got %r" % (name, lo, v))
    for name, v in (("tokenize_tasks", cfg.tokenize_tasks), ("decode_tasks", cfg.decode_tasks)):
        if v is not None and v < 1:
            raise ConfigError("%s must be >= 1, got %r" % (name, v))
    carry = ([cfg.id_column] if cfg.id_column else []) + [c for c in cfg.passthrough if c != cfg.id_column]
    if len(set(carry)) != len(carry):
        raise ConfigError("--passthrough names a column twice: %s" % carry)
    reserved = {RAY_PATH, RAY_ROW_HASH}
    for c in [cfg.state_column] + carry:
        if c in reserved or c.startswith("__"):
            raise ConfigError("column %r cannot be used: 'path', 'row_hash' and names starting with '__' are "
                              "reserved by the pipeline; rename it in the input" % c)
    threshold = check_min_confidence(cfg.min_confidence)
    out_names = carry + [f.name for f in output_fields(prepared, threshold is not None)]
    dup = [n for n, k in Counter(out_names).items() if k > 1]
    if dup:
        raise ConfigError("output column names collide: %s (question ids make <qid>, <qid>_confidence, "
                          "<qid>_answer_confidence, <qid>_probabilities and, with --min-confidence, <qid>_abstention, "
                          "<qid>_abstention_threshold, <qid>_low_confidence; rename the question or column)" % dup)
    fs, files = discover(cfg.input, exclude=os.path.abspath(os.path.expanduser(cfg.output)))
    files, bad = check_files(cfg, fs, files, carry)
    spec = JobSpec(checkpoint=os.path.abspath(cfg.checkpoint),
                   questions_json=json.dumps(questions, sort_keys=False, ensure_ascii=False),
                   state_column=cfg.state_column, carry_columns=tuple(carry), json_state=cfg.json_state,
                   max_len=cfg.max_len, head_max_len=cfg.head_max_len, max_state_chars=cfg.max_state_chars,
                   min_confidence_json=None if threshold is None else json.dumps(threshold, sort_keys=True))
    fingerprint = {"version": 1, "checkpoint_hash": checkpoint_hash(cfg.checkpoint), "questions": questions,
                   "state_column": cfg.state_column, "json_state": cfg.json_state, "id_column": cfg.id_column,
                   "passthrough": list(cfg.passthrough), "max_len": prepared.max_len,
                   "head_max_len": prepared.head_max_len, "max_state_chars": cfg.max_state_chars}
    if threshold is not None:  # absent when ungated, so the outputs of an earlier ungated job stay reusable
        fingerprint["min_confidence"] = threshold
    return Job(spec, prepared, fs, files, fingerprint, bad)


def check_files(cfg: OfflineConfig, fs, files: list[InputFile], carry: list[str]) -> tuple[list[InputFile], list]:
    """(the input files the job can read, the bad ones as {file, reason, rows}) from their footers.

    A bad file is one whose footer cannot be read or that lacks a column or holds one in a type the job cannot
    read; ConfigError names them unless `--skip-bad-files`, and always when no file is left.
    """
    reasons = read_footers(fs, files)
    reasons.update(check_columns([f for f in files if f.path not in reasons], cfg.state_column, carry))
    good = [f for f in files if f.path not in reasons]
    bad = [{"file": f.uri, "reason": reasons[f.path], "rows": f.num_rows if f.schema is not None else None}
           for f in files if f.path in reasons]
    if bad and (not cfg.skip_bad_files or not good):
        shown = "; ".join(b["reason"] for b in bad[:5]) + ("; and %d more" % (len(bad) - 5) if len(bad) > 5 else "")
        hint = "pass --skip-bad-files to score the other %d file(s)" % len(good) if good else "no input file is usable"
        raise ConfigError("%d input file(s) cannot be scored: %s (%s)" % (len(bad), shown, hint))
    for b in bad:
        log.warning("skipping %s", b["reason"])
    return good, bad


# -- Ray ----------------------------------------------------------------------------------------
def init_ray(cfg: OfflineConfig, cpus_needed: float) -> None:
    """Attach to the cluster (--address, RAY_ADDRESS, or the job's), else start a local one."""
    import ray

    if ray.is_initialized():
        return
    if cfg.address:
        ray.init(address=cfg.address)
    elif os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:  # an embedded local cluster; declare enough logical CPUs for actors plus CPU stages
        before = reaper.descendants(os.getpid()) if os.path.isdir("/proc") else set()
        ray.init(num_cpus=int(max(os.cpu_count() or 1, cpus_needed + 2)), include_dashboard=cfg.ray_dashboard)
        reaper.start(os.getpid(), before)  # the local Ray ends with this process, even a SIGKILLed one


def plan_actors(cfg: OfflineConfig, sample: Sample | None = None) -> dict:
    """How many scorer actors, with which resources and scorer options, and the CPU pools that feed them
    (`sizing.stage_tasks`); ConfigError if it cannot fit."""
    import ray

    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0))
    n_gpus = gpus if cfg.num_gpus is None else int(cfg.num_gpus)
    if n_gpus > gpus:
        raise ConfigError("--num-gpus %d asked, but the cluster has %d GPUs" % (n_gpus, gpus))
    n_actors = n_gpus if n_gpus > 0 else (1 if cfg.num_actors is None else int(cfg.num_actors))
    if n_actors < 1:
        raise ConfigError("--num-actors must be at least 1")
    cpus = float(res.get("CPU", 0))
    if n_actors * cfg.cpus_per_actor > cpus - 1:
        raise ConfigError("%d scorer actors x %g CPUs leave no CPU of the cluster's %g for tokenizing and "
                          "decoding; lower --num-actors / --cpus-per-actor" % (n_actors, cfg.cpus_per_actor, cpus))
    if cfg.cuda_graphs and (not n_gpus or cfg.backend not in ("auto", "fast")):
        log.warning("--cuda-graphs has no effect here: only the fast backend on GPU actors captures graphs "
                    "(this job: %s backend, %d GPUs)", cfg.backend, n_gpus)
    # an offline scorer measures its budget for throughput, on rows of the job's own lengths
    options = {"backend": cfg.backend, "device": None if n_gpus else "cpu", "cache_dir": cfg.cache_dir,
               "max_batch_tokens": cfg.max_batch_tokens, "max_batch_rows": cfg.max_batch_rows, "warmup": True,
               "budget_goal": "throughput", "probe_lengths": sample.row_lengths if sample else None,
               "cuda_graphs": cfg.cuda_graphs}
    stages = stage_tasks(n_actors, n_gpus > 0, sample, cpus, cfg.cpus_per_actor, cfg.tokenize_tasks,
                         cfg.decode_tasks)
    return {"n_actors": n_actors, "num_gpus": 1 if n_gpus else 0, "num_cpus": cfg.cpus_per_actor,
            "gpus": n_gpus, "scorer_options": options, "stages": stages}


def build_dataset(cfg: OfflineConfig, job: Job, files: list[InputFile], plan: dict, reports):
    """The Ray Data pipeline over `files` (lazy): read -> tokenize -> score -> decode."""
    import ray
    from ray.data import ActorPoolStrategy, TaskPoolStrategy

    spec = job.spec
    columns = list(dict.fromkeys([spec.state_column, *spec.carry_columns])) + [RAY_PATH, RAY_ROW_HASH]
    ds = ray.data.read_parquet([f.path for f in files], filesystem=job.fs, include_paths=True,
                               include_row_hash=True, partitioning=None, file_extensions=None)
    ds = ds.select_columns(columns)  # pushed down into the Parquet scan
    # A block (a read block can be a whole file) is what one task tokenizes and one actor call scores; the
    # second repartition also keeps Ray from fusing tokenize tasks into CPU-only scorer actors.
    ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
    stages = plan["stages"]
    ds = ds.map_batches(TokenizeStage(spec), batch_size=cfg.batch_size, batch_format="pyarrow",
                        compute=TaskPoolStrategy(size=stages["tokenize_tasks"]))
    ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
    # Ray Data gives actor-pool workers max_restarts=-1 and max_task_retries=-1 by default: a dead scorer
    # actor is restarted and its in-flight batches are retried (tests/test_offline_ray.py kills one).
    ds = ds.map_batches(ScoreStage, fn_constructor_kwargs={"spec": spec, "scorer_options": plan["scorer_options"],
                                                           "cpus": plan["num_cpus"], "reports": reports},
                        batch_size=cfg.batch_size, batch_format="pyarrow",
                        compute=ActorPoolStrategy(size=plan["n_actors"], max_tasks_in_flight_per_actor=4,
                                                  max_concurrent_calls_per_actor=2, enable_true_multi_threading=True),
                        num_gpus=plan["num_gpus"], num_cpus=plan["num_cpus"])
    ds = ds.map_batches(DecodeStage(spec), batch_size=None, batch_format="pyarrow",
                        compute=TaskPoolStrategy(size=stages["decode_tasks"]))
    return ds


def _configure_ray_data(cfg: OfflineConfig) -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    show = sys.stderr.isatty() if cfg.ray_progress is None else cfg.ray_progress
    ctx.enable_progress_bars = show
    for attr in ("enable_operator_progress_bars", "enable_rich_progress_bars"):
        if hasattr(ctx, attr) and not show:
            setattr(ctx, attr, False)
    if hasattr(ctx, "print_on_execution_start"):
        ctx.print_on_execution_start = show


# -- the run ------------------------------------------------------------------------------------
def run(cfg: OfflineConfig, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Score every input file not done yet; returns the run summary (also written to OUT/_summary.json)."""
    t0 = time.perf_counter()
    marks = {"start": time.time()}  # wall clock: the scorer actors' start-up marks are too
    job = prepare_job(cfg)
    out = OutputDir(cfg.output)
    created, had_job_file = not os.path.isdir(out.root), os.path.exists(out.path(JOB_FILE))
    out.lock()
    collector = None
    try:
        reuse = out.check_job(job.fingerprint, cfg.overwrite)
        stale = out.clean_temporaries()
        if stale:
            log.info("removed %d temporary files left by an interrupted run", stale)
        done = [f for f in job.files if reuse and out.is_done(f)]
        pending = [f for f in job.files if f not in done]
        if cfg.max_files is not None:
            pending = pending[:max(0, cfg.max_files)]
        log.info("%d input files: %d already done, %d to score now (%d rows)", len(job.files), len(done),
                 len(pending), sum(f.num_rows for f in pending))
        collector = Collector(job, out, pending, cfg.progress_interval, on_progress)
        plan: dict = {}
        scorers: dict[str, dict] = {}
        for f in pending:
            if f.num_rows == 0:
                collector.finish(f)
        work = [f for f in pending if f.num_rows > 0]
        if work:
            plan, scorers = _execute(cfg, job, work, collector, marks)
        missing = collector.missing()
        if missing:
            raise RuntimeError("the pipeline ended but %d files are incomplete: %s" % (len(missing), missing[:5]))
        summary = summarize(cfg, job, out, done, pending, collector, scorers, plan, time.perf_counter() - t0,
                            marks)
        atomic_write_json(out.path(SUMMARY_FILE), summary)
        return summary
    except BaseException:
        if collector is None or not collector.done:
            out.discard_if_unused(created, had_job_file)
        raise
    finally:
        out.unlock()


def sample_job(job: Job, work: list[InputFile]) -> Sample | None:
    """`sizing.take_sample` of the job, or None (logged) when the sample cannot be read or run: sizing then
    falls back to its defaults and the pipeline reports the problem on the file itself."""
    try:
        sample = take_sample(job, work)
    except Exception as e:  # best effort: a corrupt page must fail the job where the pipeline reads it
        log.warning("could not sample %s for sizing (%s: %s); using default sizes", work[0].uri, type(e).__name__, e)
        return None
    log.info("sample of %d states: %s", sample.states, sample.as_dict())
    return sample


def _execute(cfg: OfflineConfig, job: Job, work: list[InputFile], collector: Collector,
             marks: dict[str, float]) -> tuple[dict, dict]:
    """Run the pipeline over `work` into `collector`; returns (the actor plan, the scorers' last reports).
    Adds its wall-clock start-up marks to `marks` (prepared, sampled, Ray up, pipeline built)."""
    import ray

    marks["prepared"] = time.time()  # job checked, output directory ready
    sample = sample_job(job, work)
    marks["sampled"] = time.time()
    cpus_hint = (cfg.num_actors or 1) * cfg.cpus_per_actor
    init_ray(cfg, cpus_hint)
    marks["ray_up"] = time.time()
    _configure_ray_data(cfg)
    plan = plan_actors(cfg, sample)
    plan["sample"] = sample.as_dict() if sample else None
    log.info("scoring with %d %s actor(s) (%s backend), %g CPU each, batches of %d states, %d tokenize and %d "
             "decode tasks", plan["n_actors"], "GPU" if plan["gpus"] else "CPU", cfg.backend, plan["num_cpus"],
             cfg.batch_size, plan["stages"]["tokenize_tasks"], plan["stages"]["decode_tasks"])
    reports = ray.remote(num_cpus=0)(ScorerReports).remote()
    collector.scorers = lambda: ray.get(reports.all.remote())
    try:
        ds = build_dataset(cfg, job, work, plan, reports)
        marks["built"] = time.time()
        for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            collector.add(table)
        scorers = ray.get(reports.all.remote())
    finally:
        collector.scorers = None
        ray.kill(reports)
    plan["ray_address"] = ray.get_runtime_context().gcs_address
    return plan, scorers
