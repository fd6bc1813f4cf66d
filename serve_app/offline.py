"""Offline scoring: Parquet in, Parquet out, through Ray Data and a pool of the same scorer actors as Serve.

    python -m serve_app.offline --input 'data/*.parquet' --output out/ --questions q.json \\
        --state-column text --id-column id --checkpoint ckpt/

Pipeline (one Ray Data dataset over every input file still to do):

    read_parquet (projected columns, file path + row position)
      -> tokenize_batch   CPU tasks: state -> token ids, usage, or an error value
      -> ScoreStage       actor pool, one per GPU (or N CPU actors): Scorer, warmed up, token-budget batches
      -> decode_batch     CPU tasks: logits -> answers as columns
      -> driver           rows grouped per input file; a file complete -> sorted, written, marked done

Outputs are one Parquet file per input file, written atomically, then a marker; a re-run with the same
output directory skips files already done (see `offline_io`). See docs/offline.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .offline_io import SUMMARY_FILE, ConfigError, InputFile, OutputDir, atomic_write_json, discover, read_footers
from .offline_stages import (
    C_PATH,
    C_ROW,
    C_STATS,
    OUT_ERROR,
    OUT_TOKENS,
    RAY_PATH,
    RAY_ROW_HASH,
    JobSpec,
    QuestionSet,
    ScoreStage,
    decode_batch,
    tokenize_batch,
)

log = logging.getLogger("serve_app.offline")


@dataclass
class OfflineConfig:
    """Everything the offline job takes; the CLI flags map one to one."""

    input: list[str]
    output: str
    questions: str
    state_column: str
    checkpoint: str
    id_column: str | None = None
    passthrough: list[str] = field(default_factory=list)
    json_state: bool = False
    backend: str = "auto"
    num_gpus: int | None = None        # None: every GPU of the cluster; 0: CPU actors
    num_actors: int | None = None      # CPU actors when no GPU is used (default 1)
    cpus_per_actor: float = 1.0
    max_batch_tokens: int | None = None
    max_batch_rows: int | None = None
    batch_size: int = 1024             # states per tokenize / scorer call
    cache_dir: str | None = None
    max_len: int | None = None
    head_max_len: int | None = None
    max_state_chars: int = 50000
    max_files: int | None = None
    overwrite: bool = False
    address: str | None = None
    progress_interval: float = 10.0
    ray_progress: bool | None = None   # Ray Data's own progress output; None: when stderr is a terminal


@dataclass
class Job:
    """A checked job: spec for the stages, question set, files and the fingerprint of its outputs."""

    spec: JobSpec
    qs: QuestionSet
    fs: Any
    files: list[InputFile]
    fingerprint: dict


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


def prepare_job(cfg: OfflineConfig) -> Job:
    """Check questions, inputs and columns without reading any row; ConfigError on any problem."""
    from model.bundle import checkpoint_hash

    questions = load_questions(cfg.questions)
    try:
        qs = QuestionSet(cfg.checkpoint, questions, cfg.max_len, cfg.head_max_len)
    except (ValueError, TypeError) as e:
        raise ConfigError("questions file %s: %s" % (cfg.questions, e)) from None
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    for name, v, lo in (("batch_size", cfg.batch_size, 1), ("cpus_per_actor", cfg.cpus_per_actor, 0),
                        ("max_state_chars", cfg.max_state_chars, 0)):
        if v is None or v < lo:
            raise ConfigError("%s must be >= %s, got %r" % (name, lo, v))
    carry = ([cfg.id_column] if cfg.id_column else []) + [c for c in cfg.passthrough if c != cfg.id_column]
    if len(set(carry)) != len(carry):
        raise ConfigError("--passthrough names a column twice: %s" % carry)
    reserved = {RAY_PATH, RAY_ROW_HASH}
    for c in [cfg.state_column] + carry:
        if c in reserved or c.startswith("__"):
            raise ConfigError("column %r cannot be used: 'path', 'row_hash' and names starting with '__' are "
                              "reserved by the pipeline; rename it in the input" % c)
    out_names = carry + [f.name for f in qs.output_fields()]
    dup = [n for n, k in Counter(out_names).items() if k > 1]
    if dup:
        raise ConfigError("output column names collide: %s (question ids make <qid>, <qid>_confidence, "
                          "<qid>_answer_confidence, <qid>_probabilities; rename the question or column)" % dup)
    fs, files = discover(cfg.input, exclude=os.path.abspath(os.path.expanduser(cfg.output)))
    read_footers(fs, files)
    for f in files:
        names = set(f.schema.names)
        for c in [cfg.state_column] + carry:
            if c not in names:
                raise ConfigError("column %r is not in %s (it has %s)" % (c, f.uri, sorted(names)))
    spec = JobSpec(checkpoint=os.path.abspath(cfg.checkpoint),
                   questions_json=json.dumps(questions, sort_keys=False, ensure_ascii=False),
                   state_column=cfg.state_column, carry_columns=tuple(carry), json_state=cfg.json_state,
                   max_len=cfg.max_len, head_max_len=cfg.head_max_len, max_state_chars=cfg.max_state_chars)
    fingerprint = {"version": 1, "checkpoint_hash": checkpoint_hash(cfg.checkpoint), "questions": questions,
                   "state_column": cfg.state_column, "json_state": cfg.json_state, "id_column": cfg.id_column,
                   "passthrough": list(cfg.passthrough), "max_len": qs.max_len, "head_max_len": qs.head_max_len,
                   "max_state_chars": cfg.max_state_chars}
    return Job(spec, qs, fs, files, fingerprint)


def output_schema(f: InputFile, job: Job) -> pa.Schema:
    """The output schema for input `f`: carried columns with their input types, then the answers."""
    return pa.schema([f.schema.field(c) for c in job.spec.carry_columns] + job.qs.output_fields())


def error_kind(msg: str) -> str:
    """The reason class of an error value (its text before the first ':')."""
    return msg.split(":", 1)[0]


# -- the driver: collect rows per input file ----------------------------------------------------
class Collector:
    """Receives decoded batches, groups rows per input file, and writes each file once it is complete."""

    def __init__(self, job: Job, out: OutputDir, files: list[InputFile], progress_interval: float,
                 on_progress: Callable[[dict], None] | None = None):
        self.job, self.out = job, out
        self.files = {f.path: f for f in files}
        self.buffers: dict[str, list[pa.Table]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.done: list[str] = []
        self.rows = self.errors = self.tokens = 0
        self.error_kinds: Counter = Counter()
        self.actors: dict[tuple, dict] = {}
        self.rows_total = sum(f.num_rows for f in files)
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.t_first: float | None = None
        self.timeline: list[tuple[float, int, int]] = [(0.0, 0, 0)]
        self.progress_interval = progress_interval
        self._last_log = self.t0
        self.on_progress = on_progress

    def add(self, table: pa.Table) -> None:
        """Take one decoded batch."""
        now = time.perf_counter()
        for s in table.column(C_STATS).drop_null().to_pylist():
            st = json.loads(s)
            key = (st.get("actor"), st.get("pid"))
            old = self.actors.get(key)
            if old is None or st["stats"]["rows"] >= old["stats"]["rows"]:
                self.actors[key] = st
        err = table.column(OUT_ERROR)
        self.rows += table.num_rows
        self.errors += len(err) - err.null_count
        for e in err.drop_null().to_pylist():
            self.error_kinds[error_kind(e)] += 1
        self.tokens += int(pc.sum(table.column(OUT_TOKENS)).as_py() or 0)
        if self.t_first is None:
            self.t_first = now
        paths = table.column(C_PATH)
        for p in pc.unique(paths).to_pylist():
            part = table.filter(pc.equal(paths, p))
            if p not in self.files:
                raise RuntimeError("a row came back from %r, which is not an input of this run" % p)
            self.buffers[p].append(part)
            self.counts[p] += part.num_rows
            if self.counts[p] > self.files[p].num_rows:
                raise RuntimeError("%s: %d rows came back for %d input rows (duplicates)"
                                   % (self.files[p].uri, self.counts[p], self.files[p].num_rows))
            if self.counts[p] == self.files[p].num_rows:
                self.finish(self.files[p])
        self.timeline.append((now - self.t0, self.rows, self.tokens))
        if self.on_progress:
            self.on_progress(self.snapshot())
        if now - self._last_log >= self.progress_interval:
            self._last_log = now
            s = self.snapshot()
            log.info("progress: files %d/%d, rows %d/%d (%.1f%%), errors %d, %.0f rows/s, %.0f tokens/s",
                     s["files_done"], s["files"], s["rows"], s["rows_total"],
                     100.0 * s["rows"] / max(1, s["rows_total"]), s["errors"], s["rows_per_s"], s["tokens_per_s"])

    def finish(self, f: InputFile) -> None:
        """Sort input `f`'s rows into input order, check each row came exactly once, write it."""
        parts = self.buffers.pop(f.path, [])
        schema = output_schema(f, self.job)
        if parts:
            t = pa.concat_tables(parts)
            rows = t.column(C_ROW).to_numpy()
            order = np.argsort(rows, kind="stable")
            if not np.array_equal(rows[order], np.arange(f.num_rows)):
                raise RuntimeError("%s: rows did not come back exactly once each (row positions %s...)"
                                   % (f.uri, rows[order][:10].tolist()))
            t = t.take(pa.array(order)).select(schema.names).cast(schema)
        else:
            t = schema.empty_table()
        err = t.column(OUT_ERROR)
        record = {"rows": t.num_rows, "errors": len(err) - err.null_count,
                  "tokens": int(pc.sum(t.column(OUT_TOKENS)).as_py() or 0)}
        self.out.finish(f, t, record)
        self.done.append(f.path)
        log.info("done: %s -> %s (%d rows, %d errors)", f.uri, self.out.output_path(f), record["rows"],
                 record["errors"])

    def snapshot(self) -> dict:
        """Where the run stands: files, rows, errors, tokens, rates, scorer actors seen."""
        el = max(1e-9, time.perf_counter() - self.t0)
        return {"files_done": len(self.done), "files": len(self.files), "rows": self.rows,
                "rows_total": self.rows_total, "errors": self.errors, "tokens": self.tokens, "elapsed_s": el,
                "rows_per_s": self.rows / el, "tokens_per_s": self.tokens / el,
                "actors": {"%s/%s" % k: v for k, v in self.actors.items()}}

    def missing(self) -> list[str]:
        """Inputs of this run that did not complete."""
        return [f.uri for p, f in self.files.items() if p not in self.done]


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
        ray.init(num_cpus=int(max(os.cpu_count() or 1, cpus_needed + 2)))


def plan_actors(cfg: OfflineConfig) -> dict:
    """How many scorer actors, with which resources and scorer options (ConfigError if it cannot fit)."""
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
    options = {"backend": cfg.backend, "device": None if n_gpus else "cpu", "cache_dir": cfg.cache_dir,
               "max_batch_tokens": cfg.max_batch_tokens, "max_batch_rows": cfg.max_batch_rows, "warmup": True}
    return {"n_actors": n_actors, "num_gpus": 1 if n_gpus else 0, "num_cpus": cfg.cpus_per_actor,
            "gpus": n_gpus, "scorer_options": options}


def build_dataset(cfg: OfflineConfig, job: Job, files: list[InputFile], plan: dict):
    """The Ray Data pipeline over `files` (lazy): read -> tokenize -> score -> decode."""
    import ray
    from ray.data import ActorPoolStrategy

    spec = job.spec
    columns = list(dict.fromkeys([spec.state_column, *spec.carry_columns])) + [RAY_PATH, RAY_ROW_HASH]
    ds = ray.data.read_parquet([f.path for f in files], filesystem=job.fs, include_paths=True,
                               include_row_hash=True, partitioning=None, file_extensions=None)
    ds = ds.select_columns(columns)  # pushed down into the Parquet scan
    # Blocks of `batch_size` states: read blocks can hold whole files, and a block is the unit a CPU task
    # tokenizes and an actor call scores, so this is what spreads the work over CPUs and scorer actors.
    # The second repartition also keeps Ray from fusing the tokenize tasks into the scorer actors when
    # both ask for the same resources (CPU-only runs).
    ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
    ds = ds.map_batches(tokenize_batch, fn_kwargs={"spec": spec}, batch_size=cfg.batch_size,
                        batch_format="pyarrow")
    ds = ds.repartition(target_num_rows_per_block=cfg.batch_size)
    # Ray Data gives actor-pool workers max_restarts=-1 and max_task_retries=-1 by default: a dead scorer
    # actor is restarted and its in-flight batches are retried (tests/test_offline_ray.py kills one).
    ds = ds.map_batches(ScoreStage, fn_constructor_kwargs={"spec": spec, "scorer_options": plan["scorer_options"],
                                                           "cpus": plan["num_cpus"]},
                        batch_size=cfg.batch_size, batch_format="pyarrow",
                        compute=ActorPoolStrategy(size=plan["n_actors"], max_tasks_in_flight_per_actor=4,
                                                  max_concurrent_calls_per_actor=2, enable_true_multi_threading=True),
                        num_gpus=plan["num_gpus"], num_cpus=plan["num_cpus"])
    ds = ds.map_batches(decode_batch, fn_kwargs={"spec": spec}, batch_size=None, batch_format="pyarrow")
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
    job = prepare_job(cfg)
    out = OutputDir(cfg.output)
    out.lock()
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
        for f in pending:
            if f.num_rows == 0:
                collector.finish(f)
        work = [f for f in pending if f.num_rows > 0]
        if work:
            plan = _execute(cfg, job, work, collector)
        missing = collector.missing()
        if missing:
            raise RuntimeError("the pipeline ended but %d files are incomplete: %s" % (len(missing), missing[:5]))
        summary = summarize(cfg, job, out, done, pending, collector, plan, time.perf_counter() - t0)
        atomic_write_json(out.path(SUMMARY_FILE), summary)
        return summary
    finally:
        out.unlock()


def _execute(cfg: OfflineConfig, job: Job, work: list[InputFile], collector: Collector) -> dict:
    import ray

    cpus_hint = (cfg.num_actors or 1) * cfg.cpus_per_actor
    init_ray(cfg, cpus_hint)
    _configure_ray_data(cfg)
    plan = plan_actors(cfg)
    log.info("scoring with %d %s actor(s) (%s backend), %g CPU each, batches of %d states",
             plan["n_actors"], "GPU" if plan["gpus"] else "CPU", cfg.backend, plan["num_cpus"], cfg.batch_size)
    ds = build_dataset(cfg, job, work, plan)
    for table in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
        collector.add(table)
    plan["ray_address"] = ray.get_runtime_context().gcs_address
    return plan


def summarize(cfg: OfflineConfig, job: Job, out: OutputDir, done: list[InputFile], pending: list[InputFile],
              c: Collector, plan: dict, seconds: float) -> dict:
    """The run summary: rows, errors, tokens, time, throughput, GPUs, budgets, padding overhead."""
    scored = [st["stats"] for st in c.actors.values()]
    tok = sum(s["tokens"] for s in scored)
    padded = sum(s["padded_tokens"] for s in scored)
    packed = any(st.get("packed") for st in c.actors.values())
    actor_ids = {k[0] for k in c.actors}
    gpu_ids = sorted({"%s:%s" % (st.get("node"), g) for st in c.actors.values() for g in st.get("gpus") or []})
    # "After start-up": from the first scorer actor ready (model loaded, warmed up) to the end; the
    # fair comparison with an in-process scorer timed after its own load and warm-up.
    ready = min((st["ready_at"] for st in c.actors.values() if st.get("ready_at")), default=None)
    after_ready = time.time() - ready if ready else None
    left = len(job.files) - len(done) - len(pending)
    tl = c.timeline
    if len(tl) > 400:
        tl = tl[::len(tl) // 400 + 1] + [tl[-1]]
    return {
        "output": out.root, "input_files": len(job.files), "files_skipped_done": len(done),
        "files_scored": len(c.done), "files_left": left,
        "rows": c.rows, "errors": c.errors, "error_kinds": dict(c.error_kinds.most_common(10)),
        "tokens": c.tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(c.tokens / seconds, 1) if seconds > 0 else None,
        "rows_per_s": round(c.rows / seconds, 1) if seconds > 0 else None,
        "seconds_to_first_batch": round(c.t_first - c.t0, 3) if c.t_first else None,
        "seconds_to_scorers_ready": round(ready - c.wall0, 3) if ready else None,
        "tokens_per_s_after_ready": round(c.tokens / after_ready, 1) if after_ready else None,
        "actors": len(actor_ids), "actor_processes": len(c.actors),
        "actor_restarts": len(c.actors) - len(actor_ids),
        "gpus": plan.get("gpus", 0), "gpu_ids": gpu_ids,
        "backend": sorted({st.get("backend") for st in c.actors.values()}),
        "devices": sorted({st.get("device") for st in c.actors.values()}),
        "budgets": sorted({st.get("budget") for st in c.actors.values()}),
        "budget_history": {"%s/%s" % k: st["stats"]["budget_history"] for k, st in c.actors.items()},
        "oom_retries": sum(s["oom_retries"] for s in scored),
        "scorer_rows": sum(s["rows"] for s in scored), "scorer_tokens": tok, "scorer_padded_tokens": padded,
        "padding_overhead": 0.0 if packed or not tok else round(padded / tok - 1.0, 4),
        "packed": packed,
        "forward_s": round(sum(s["forward_s"] for s in scored), 3),
        "warmup_s": sorted(round(s["warmup_s"], 3) for s in scored),
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("questions",)},
        "timeline": [[round(t, 3), r, k] for t, r, k in tl],
    }


def format_summary(s: dict) -> str:
    """The summary as a short human-readable block."""
    lines = [
        "offline scoring summary (%s)" % s["output"],
        "  files      %d scored, %d already done, %d left, %d total" % (
            s["files_scored"], s["files_skipped_done"], s["files_left"], s["input_files"]),
        "  rows       %d (%d errors%s)" % (s["rows"], s["errors"], (": " + ", ".join(
            "%s %d" % kv for kv in s["error_kinds"].items())) if s["error_kinds"] else ""),
        "  tokens     %d in %.1f s = %s tokens/s (%s rows/s); %s tokens/s after the scorers were ready (%s s)" % (
            s["tokens"], s["seconds"], s["tokens_per_s"], s["rows_per_s"], s["tokens_per_s_after_ready"],
            s["seconds_to_scorers_ready"]),
        "  scorers    %d actor(s) (%d restart(s)), %d GPU(s) %s, backend %s, device %s" % (
            s["actors"], s["actor_restarts"], s["gpus"], s["gpu_ids"] or "", ",".join(map(str, s["backend"])),
            ",".join(map(str, s["devices"]))),
        "  batching   token budget(s) %s, OOM retries %d, padding overhead %.1f%%%s, forward %.1f s" % (
            s["budgets"], s["oom_retries"], 100 * s["padding_overhead"], " (packed)" if s["packed"] else "",
            s["forward_s"]),
    ]
    return "\n".join(lines)


# -- CLI ----------------------------------------------------------------------------------------
def _csv(s: str) -> list[str]:
    return [c.strip() for c in s.split(",") if c.strip()]


def parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m serve_app.offline`."""
    p = argparse.ArgumentParser(prog="python -m serve_app.offline",
                                description="Score Parquet files with a Laya checkpoint on Ray Data.")
    a = p.add_argument
    a("--input", required=True, nargs="+", help="Parquet file(s), directories (recursive) or globs; one filesystem")
    a("--output", required=True, help="output directory: one Parquet file per input file, plus markers")
    a("--questions", required=True, help="JSON file: {question id: definition}")
    a("--state-column", required=True, help="column holding the state (string, JSON string, struct, list or map)")
    a("--id-column", default=None, help="column copied first into the output")
    a("--passthrough", type=_csv, default=[], help="more columns copied into the output, comma-separated")
    a("--json-state", action="store_true", help="parse string states as JSON (object, array or string)")
    a("--checkpoint", required=True, help="checkpoint directory (on every node, e.g. a shared mount)")
    a("--backend", default="auto", help="auto | eager | fast | compile | aot")
    a("--num-gpus", type=int, default=None, help="GPUs to use, one scorer actor each (default: all; 0: CPU)")
    a("--num-actors", type=int, default=None, help="scorer actors when no GPU is used (default 1)")
    a("--cpus-per-actor", type=float, default=1.0, help="CPUs per scorer actor (torch threads on CPU)")
    a("--max-batch-tokens", type=int, default=None, help="token budget per forward (default: measured on GPU)")
    a("--max-batch-rows", type=int, default=None, help="cap on rows per forward")
    a("--batch-size", type=int, default=1024, help="states per tokenize/scorer call (sorting window)")
    a("--cache-dir", default=None, help="compile/kernel cache root shared with Serve replicas")
    a("--max-len", type=int, default=None, help="token budget per row (default: the checkpoint's)")
    a("--head-max-len", type=int, default=None, help="tokens for question + options (default: the checkpoint's)")
    a("--max-state-chars", type=int, default=50000, help="longer states get an error value (0: no limit)")
    a("--max-files", type=int, default=None, help="score at most this many pending input files, then stop")
    a("--overwrite", action="store_true", help="discard everything in --output (any job) and start over")
    a("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS, or a new local cluster)")
    a("--progress-interval", type=float, default=10.0, help="seconds between progress log lines")
    a("--ray-progress", dest="ray_progress", action="store_true", default=None, help="show Ray Data's progress")
    a("--no-ray-progress", dest="ray_progress", action="store_false", help="hide Ray Data's progress")
    a("--summary-json", default=None, help="also write the summary to this file")
    a("-q", "--quiet", action="store_true", help="log warnings only")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (0 done, 2 bad arguments/inputs, 1 failure)."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kw = {k: v for k, v in vars(args).items() if k not in ("quiet", "summary_json")}
    cfg = OfflineConfig(**kw)
    try:
        summary = run(cfg)
    except ConfigError as e:
        print("offline: %s" % e, file=sys.stderr)
        return 2
    print(format_summary(summary))
    if args.summary_json:
        atomic_write_json(os.path.abspath(args.summary_json), summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
