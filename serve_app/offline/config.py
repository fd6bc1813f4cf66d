"""The offline job's configuration.

`OfflineConfig` is what a user sets: one typed field per CLI flag, its help text the field's doc (the CLI's
parser is generated from these fields). `JobSpec` is the small, picklable part of a checked job that every
Ray Data stage receives; `Job` is a checked job as the driver holds it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, dataclass, field
from typing import Any

from model import abstention


def _csv(s: str) -> list[str]:
    return [c.strip() for c in s.split(",") if c.strip()]


def parse_min_confidence(text: str) -> float | dict[str, float]:
    """`--min-confidence`'s value: a number in [0, 1], or a JSON object of bucket -> number ("choice:3-5",
    "noul:2", ..., "default"); argparse.ArgumentTypeError with upstream's text otherwise."""
    text = text.strip()
    try:
        value = json.loads(text) if text.startswith("{") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number in [0.0, 1.0] or a JSON object of bucket -> number, "
                                         "got %r" % text) from None
    try:
        return abstention.check(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def option(default: Any = MISSING, doc: str = "", **cli: Any) -> Any:
    """A config field: its default, its doc (the flag's help text) and any argparse arguments of its flag."""
    meta = {"help": doc, "cli": cli}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class OfflineConfig:
    """Everything the offline job takes; field `x_y` is the flag `--x-y`, a field without default is required."""

    input: list[str] = option(doc="Parquet file(s), directories (recursive) or globs; one filesystem", nargs="+")
    output: str = option(doc="output directory: one Parquet file per input file, plus markers")
    questions: str = option(doc="JSON file: {question id: definition}")
    state_column: str = option(doc="column holding the state (string, JSON string, struct, list or map)")
    id_column: str | None = option(None, "column copied first into the output")
    passthrough: list[str] = option([], "more columns copied into the output, comma-separated", type=_csv)
    json_state: bool = option(False, "parse string states as JSON (object, array or string)", action="store_true")
    checkpoint: str = option(doc="checkpoint directory (on every node, e.g. a shared mount)")
    backend: str = option("auto", "auto | eager | fast | compile | aot")
    num_gpus: int | None = option(None, "GPUs to use, one scorer actor each (default: all; 0: CPU)", type=int)
    num_actors: int | None = option(None, "scorer actors when no GPU is used (default 1)", type=int)
    cpus_per_actor: float = option(1.0, "CPUs per scorer actor (torch threads on CPU)", type=float)
    max_batch_tokens: int | None = option(None, "token budget per forward (default: measured on GPU)", type=int)
    max_batch_rows: int | None = option(None, "cap on rows per forward", type=int)
    batch_size: int = option(1024, "states per tokenize/scorer call (sorting window)", type=int)
    tokenize_tasks: int | None = option(None, "concurrent tokenize tasks (default: sized from a sample of the "
                                        "job so the scorer actors' forward is kept fed)", type=int)
    decode_tasks: int | None = option(None, "concurrent decode tasks (default: sized like --tokenize-tasks)",
                                      type=int)
    cuda_graphs: bool = option(False, "capture the fast backend's CUDA graph per token bucket at start-up, as a "
                               "Serve replica does (several seconds of warm-up)", action="store_true")
    cache_dir: str | None = option(None, "compile/kernel cache root shared with Serve replicas")
    max_len: int | None = option(None, "token budget per row (default: the checkpoint's)", type=int)
    head_max_len: int | None = option(None, "tokens for question + options (default: the checkpoint's)", type=int)
    max_state_chars: int = option(50000, "longer states get an error value (0: no limit)", type=int)
    min_confidence: float | dict[str, float] | None = option(
        None, "abstention gate, as upstream laya's min_confidence: a number in [0, 1] or a JSON object of "
        "option-count bucket -> number, e.g. '{\"choice:3-5\": 0.6, \"noul:2\": 0.8, \"default\": 0.5}'; adds "
        "<qid>_abstention (passed | abstained | unevaluated), <qid>_abstention_threshold and <qid>_low_confidence "
        "after the other columns (default: no gate, no such columns)", type=parse_min_confidence, metavar="P|JSON")
    max_files: int | None = option(None, "score at most this many pending input files, then stop", type=int)
    skip_bad_files: bool = option(False, "skip input files that cannot be read or lack a column or have one of "
                                  "the wrong type (reported in the summary; default: refuse the job)",
                                  action="store_true")
    overwrite: bool = option(False, "discard everything in --output (any job) and start over", action="store_true")
    address: str | None = option(None, "Ray cluster address (default: RAY_ADDRESS, or a new local cluster)")
    ray_dashboard: bool = option(False, "start the dashboard with the new local cluster (a few seconds of "
                                 "start-up; a cluster of --address / RAY_ADDRESS has its own)", action="store_true")
    progress_interval: float = option(10.0, "seconds between progress log lines", type=float)
    # None: Ray Data's progress output is shown when stderr is a terminal
    ray_progress: bool | None = option(None, "show Ray Data's progress", action="store_true",
                                       negative=("--no-ray-progress", "hide Ray Data's progress"))


@dataclass(frozen=True)
class JobSpec:
    """What every stage needs to know about the job; small and picklable."""

    checkpoint: str
    questions_json: str                 # the questions file, canonical JSON
    state_column: str
    carry_columns: tuple[str, ...] = ()  # id column first, then passthrough columns
    json_state: bool = False            # parse string states as JSON
    max_len: int | None = None
    head_max_len: int | None = None
    max_state_chars: int = 50000        # 0 = no limit
    min_confidence_json: str | None = None  # the validated abstention threshold as JSON; None: no gate

    @property
    def questions(self) -> dict:
        """The question mapping (id -> definition)."""
        return json.loads(self.questions_json)

    @property
    def min_confidence(self) -> float | dict[str, float] | None:
        """The abstention threshold (a number or a bucket -> number map), or None for no gate."""
        return None if self.min_confidence_json is None else json.loads(self.min_confidence_json)


@dataclass
class Job:
    """A checked job: spec for the stages, prepared questions, files, the fingerprint of its outputs, bad files."""

    spec: JobSpec
    prepared: Any        # model.codec.Prepared
    fs: Any              # pyarrow filesystem of the inputs
    files: list          # io.InputFile, sorted by path
    fingerprint: dict
    bad: list = field(default_factory=list)  # input files skipped (--skip-bad-files): file, reason, rows
