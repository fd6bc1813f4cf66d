"""Stage 2, an actor pool (one actor per GPU, or CPU actors): score token ids with the shared `Scorer`.

Each actor reports what its scorer did (identity, budgets, counters, timings) to a `ScorerReports` actor
after warm-up and after every batch; the driver reads the reports for progress and the run summary, so no
statistics travel in the data.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import numpy as np
import pyarrow as pa

from ._clock import IMPORT_STARTED_AT
from .config import JobSpec
from .schema import C_ACT, C_ERROR, C_IDS, C_LEFT, C_LOGITS, Stage, list_values
from .tokenize import TokenizeStage

log = logging.getLogger(__name__)


class ScorerReports:
    """A Ray actor holding the latest report of every scorer process of a run, keyed "actor id/pid".

    A restarted scorer actor keeps its actor id in a new process, so it adds a key.
    """

    def __init__(self) -> None:
        self.reports: dict[str, dict] = {}

    def report(self, st: dict) -> None:
        """Keep `st` unless a report of the same process with more rows came first."""
        key = "%s/%s" % (st.get("actor"), st.get("pid"))
        old = self.reports.get(key)
        if old is None or st["stats"]["rows"] >= old["stats"]["rows"]:
            self.reports[key] = st

    def all(self) -> dict[str, dict]:
        """Every scorer process's latest report."""
        return dict(self.reports)


class ScoreStage(Stage):
    """A Ray Data actor: one `Scorer` (warmed up in the constructor) scoring whole batches.

    The scorer sorts a batch's rows by length, cuts micro-batches under its token budget and puts the
    outputs back in order; the budget is measured at warm-up on CUDA and halved on out-of-memory.
    `reports` is the run's `ScorerReports` actor handle (None in-process, where `stats()` says the same).
    """

    ADDS = {C_LOGITS: "raw option logits, questions x kmax per state (list<float32>; null on error)",
            C_ACT: "P(action 0) per question (list<float32>; null on error)",
            C_ERROR: "as read, or 'scoring failed: ...' for a state whose forward failed alone"}
    DROPS = (C_IDS, C_LEFT, C_ERROR)

    def __init__(self, spec: JobSpec, scorer_options: dict, cpus: float = 1.0, reports: Any = None):
        entered = time.time()
        import torch

        from ..scorer import Scorer

        imported = time.time()
        if scorer_options.get("device") == "cpu" or not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(cpus)))
        self.spec = spec
        self.scorer = Scorer(spec.checkpoint, **scorer_options)
        # the engine's codec builds rows as its backend stages them (int32 ids for a packed backend)
        self.codec = self.scorer.engine.codec
        self.prepared = self.codec.prepare(spec.questions, spec.max_len, spec.head_max_len)
        self._lock = threading.Lock()
        self.identity = self._identity()
        # wall clock, so the driver can line these up with its own marks: where this actor's start-up went
        self.identity["started"] = {"process_at": process_started_at(), "import_began_at": IMPORT_STARTED_AT,
                                    "entered_at": entered, "import_s": imported - entered}
        self.identity["ready_at"] = time.time()  # wall clock: the summary's "after start-up" rate starts here
        self.reports = reports
        self._report()
        log.info("score stage ready: %s", self.identity)

    def requires(self) -> dict[str, str]:
        """Token ids, the conversation flag and the error column of `TokenizeStage`."""
        return {c: TokenizeStage.ADDS[c] for c in (C_IDS, C_LEFT, C_ERROR)}

    @staticmethod
    def _identity() -> dict:
        ident = {"pid": os.getpid(), "actor": None, "node": None, "gpus": []}
        try:
            import ray

            if not ray.is_initialized():  # in-process use: do not start a cluster just to ask
                return ident
            ctx = ray.get_runtime_context()
            ident.update(actor=ctx.get_actor_id(), node=ctx.get_node_id(),
                         gpus=[str(g) for g in ray.get_gpu_ids()])
        except Exception:  # outside Ray (unit tests)
            pass
        return ident

    def stats(self) -> dict:
        """This scorer's identity, whether it packs rows, and `Scorer.info()` (backend, budget, counters)."""
        with self._lock:
            return {**self.identity, "packed": self.scorer.packed, **self.scorer.info()}

    def _report(self) -> None:
        """Send `stats()` to the run's `ScorerReports` (waits, so a report is in before its batch returns)."""
        if self.reports is not None:
            import ray

            ray.get(self.reports.report.remote(self.stats()))

    def _score(self, rows: list, per_state: list[tuple[int, int]], errors: list) -> tuple[np.ndarray, np.ndarray]:
        """Scores all rows; if the batch fails for a reason other than memory, scores state by state."""
        from ..scorer import is_oom

        try:
            return self.scorer.score_rows(rows)
        except Exception as e:
            if is_oom(e):
                raise
            log.warning("batch of %d rows failed (%s); scoring state by state", len(rows), e)
            logits = np.zeros((len(rows), self.prepared.kmax), dtype=np.float32)
            act = np.zeros(len(rows), dtype=np.float32)
            failed = 0
            for i, (a, b) in enumerate(per_state):
                if a == b:
                    continue
                try:
                    lg, ap = self.scorer.score_rows(rows[a:b])
                    logits[a:b, :lg.shape[1]] = lg[:, :self.prepared.kmax]
                    act[a:b] = ap
                except Exception as e2:
                    errors[i] = "scoring failed: %s" % e2
                    failed += 1
            if failed and failed == sum(1 for a, b in per_state if a != b):
                raise
            return logits, act

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The batch with raw option logits and P(action 0) per state instead of token ids."""
        self.check(batch)
        rows, per_state, errors = build_rows(batch, self.codec, self.prepared)
        kmax = self.prepared.kmax
        if rows:
            logits, act = self._score(rows, per_state, errors)
        else:
            logits, act = np.zeros((0, kmax), np.float32), np.zeros(0, np.float32)
        out = scored_table(batch, errors, per_state, logits, act, len(self.prepared.questions), kmax)
        self._report()
        return out


def process_started_at() -> float | None:
    """This process's start as wall-clock seconds (Linux /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(float(ln.split()[1]) for ln in fh if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def build_rows(batch: pa.Table, codec, prepared) -> tuple[list, list[tuple[int, int]], list]:
    """The model rows of a tokenized batch: (rows, each state's [start, end) in them, each state's error)."""
    errors = batch.column(C_ERROR).to_pylist()
    left = batch.column(C_LEFT).to_pylist()
    values, offsets = list_values(batch.column(C_IDS))
    rows, per_state = [], []
    for i in range(batch.num_rows):
        start = len(rows)
        if errors[i] is None:
            ids = values[offsets[i]:offsets[i + 1]].tolist()
            rows.extend(codec.encode_ids(ids, prepared, keep_newest=left[i]).rows)
        per_state.append((start, len(rows)))
    return rows, per_state, errors


def scored_table(batch: pa.Table, errors: list, per_state: list[tuple[int, int]], logits: np.ndarray,
                 act: np.ndarray, nq: int, kmax: int) -> pa.Table:
    """`batch` without token ids, with each state's logits (questions x kmax) and P(action 0) as list columns
    (null for a state with an error) and the error column last."""
    n = batch.num_rows
    if logits.shape[1] < kmax:
        logits = np.pad(logits, ((0, 0), (0, kmax - logits.shape[1])), constant_values=-1e4)
    good = np.array([errors[i] is None for i in range(n)], dtype=bool)
    sel = np.concatenate([np.arange(a, b) for (a, b), g in zip(per_state, good) if g] or [np.zeros(0, int)])
    flat_logits = logits[sel, :kmax].reshape(-1).astype(np.float32)
    flat_act = act[sel].astype(np.float32)
    lg_off = np.zeros(n + 1, dtype=np.int32)
    lg_off[1:] = np.cumsum(good * nq * kmax)
    act_off = np.zeros(n + 1, dtype=np.int32)
    act_off[1:] = np.cumsum(good * nq)
    mask = pa.array(~good)
    out = batch.drop_columns(list(ScoreStage.DROPS))
    lg_col = pa.ListArray.from_arrays(pa.array(lg_off), pa.array(flat_logits), mask=mask)
    act_col = pa.ListArray.from_arrays(pa.array(act_off), pa.array(flat_act), mask=mask)
    return (out.append_column(C_LOGITS, lg_col).append_column(C_ACT, act_col)
            .append_column(C_ERROR, pa.array(errors, pa.string())))
