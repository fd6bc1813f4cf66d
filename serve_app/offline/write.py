"""The write stage, on the driver: decoded batches grouped per input file; a complete file is sorted back into
input order, checked (every row exactly once), written atomically and marked done.

Workers never write output, so the output directory only has to be reachable from the driver.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .config import Job
from .io import InputFile, OutputDir
from .schema import C_PATH, C_ROW, OUT_ERROR, OUT_TOKENS, output_fields

log = logging.getLogger("serve_app.offline")


def output_schema(f: InputFile, job: Job) -> pa.Schema:
    """The output schema for input `f`: carried columns with their input types, then the answers (with the
    abstention columns of a gated job)."""
    answers = output_fields(job.prepared, job.spec.min_confidence is not None)
    return pa.schema([f.schema.field(c) for c in job.spec.carry_columns] + answers)


def error_kind(msg: str) -> str:
    """The reason class of an error value (its text before the first ':')."""
    return msg.split(":", 1)[0]


class Collector:
    """Receives decoded batches, groups rows per input file, and writes each file once it is complete.

    `scorers` returns the scorer actors' latest reports ("actor/pid" -> report) for progress snapshots.
    """

    def __init__(self, job: Job, out: OutputDir, files: list[InputFile], progress_interval: float,
                 on_progress: Callable[[dict], None] | None = None,
                 scorers: Callable[[], dict[str, dict]] | None = None):
        self.job, self.out = job, out
        self.files = {f.path: f for f in files}
        self.buffers: dict[str, list[pa.Table]] = defaultdict(list)
        self.counts: dict[str, int] = defaultdict(int)
        self.done: list[str] = []
        self.rows = self.errors = self.tokens = 0
        self.error_kinds: Counter = Counter()
        self.rows_total = sum(f.num_rows for f in files)
        self.t0 = time.perf_counter()
        self.wall0 = time.time()
        self.t_first: float | None = None
        self.timeline: list[tuple[float, int, int]] = [(0.0, 0, 0)]
        self.progress_interval = progress_interval
        self._last_log = self.t0
        self.on_progress = on_progress
        self.scorers = scorers

    def add(self, table: pa.Table) -> None:
        """Take one decoded batch."""
        now = time.perf_counter()
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
            s = self.snapshot(scorers=False)
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

    def snapshot(self, scorers: bool = True) -> dict:
        """Where the run stands: files, rows, errors, tokens, rates, and (`scorers`) the scorer actors' reports."""
        el = max(1e-9, time.perf_counter() - self.t0)
        return {"files_done": len(self.done), "files": len(self.files), "rows": self.rows,
                "rows_total": self.rows_total, "errors": self.errors, "tokens": self.tokens, "elapsed_s": el,
                "rows_per_s": self.rows / el, "tokens_per_s": self.tokens / el,
                "actors": self.scorers() if scorers and self.scorers else {}}

    def missing(self) -> list[str]:
        """Inputs of this run that did not complete."""
        return [f.uri for p, f in self.files.items() if p not in self.done]
