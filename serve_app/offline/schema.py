"""Columns of the offline pipeline: the names stages pass between them, the output schema, the stage protocol.

Internal columns start with ``__`` and never reach the output files. The output schema (docs/offline.md,
"Output schema") is the carried columns, four columns per question, then `input_tokens`, `truncated`, `error`,
then, for a job with `--min-confidence`, three abstention columns per question.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from .config import JobSpec

if TYPE_CHECKING:
    from model.codec import Codec, Prepared

# Columns Ray's read_parquet synthesizes (include_paths / include_row_hash).
RAY_PATH, RAY_ROW_HASH = "path", "row_hash"
# Internal columns between stages.
C_PATH, C_ROW, C_IDS, C_LEFT = "__path", "__row", "__ids", "__left"
C_TOKENS, C_TRUNC, C_ERROR = "__tokens", "__truncated", "__error"
C_LOGITS, C_ACT = "__logits", "__act"
# Output columns besides the question columns.
OUT_TOKENS, OUT_TRUNC, OUT_ERROR = "input_tokens", "truncated", "error"
# The abstention columns of one question (a gated job only), after every other output column.
GATE_SUFFIXES = ("_abstention", "_abstention_threshold", "_low_confidence")
GATE_TYPES = (pa.string(), pa.float64(), pa.bool_())
# Arrow types of a question's value column by `model.codec.column_kind`.
KIND_TYPES = {"string": pa.string(), "bool": pa.bool_(), "int": pa.int64(), "float": pa.float64()}


class Stage:
    """A Ray Data stage: a callable from one pyarrow Table to the next that declares its columns.

    `requires()` names the columns a batch must hold and `ADDS` the columns the stage adds (each with what it
    holds); `DROPS` are the columns it consumes. `check` raises when a batch lacks a required column.
    """

    ADDS: dict[str, str] = {}
    DROPS: tuple[str, ...] = ()

    def requires(self) -> dict[str, str]:
        """The columns this stage reads, with what each must hold."""
        return {}

    def check(self, batch: pa.Table) -> None:
        """Raise KeyError naming the required columns `batch` lacks."""
        missing = [c for c in self.requires() if c not in batch.column_names]
        if missing:
            raise KeyError("%s needs columns %s; the batch has %s"
                           % (type(self).__name__, missing, batch.column_names))


def list_values(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column (nulls are empty lists)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if len(arr) == 0:
        return np.zeros(0), np.zeros(1, dtype=np.int64)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


def gate_fields(prepared: Prepared) -> list[pa.Field]:
    """The abstention fields of a gated job: `<qid>_abstention`, `<qid>_abstention_threshold`,
    `<qid>_low_confidence` for each question, in question order."""
    return [pa.field(name + suffix, t) for name in prepared.names for suffix, t in zip(GATE_SUFFIXES, GATE_TYPES)]


def output_fields(prepared: Prepared, gated: bool = False) -> list[pa.Field]:
    """The per-question output fields (`prepared.column_names`), then input_tokens, truncated and error, then
    when `gated` the abstention fields (`gate_fields`)."""
    fields = []
    for name, kind in zip(prepared.names, prepared.kinds):
        fields += [pa.field(name, KIND_TYPES[kind]), pa.field(name + "_confidence", pa.float64()),
                   pa.field(name + "_answer_confidence", pa.float64()),
                   pa.field(name + "_probabilities", pa.map_(pa.string(), pa.float64()))]
    fields += [pa.field(OUT_TOKENS, pa.int64()), pa.field(OUT_TRUNC, pa.bool_()), pa.field(OUT_ERROR, pa.string())]
    return fields + (gate_fields(prepared) if gated else [])


@lru_cache(maxsize=4)
def job_codec(spec: JobSpec) -> tuple[Codec, Prepared]:
    """The weightless codec of the job's checkpoint and its prepared question set, once per worker process."""
    from model.codec import Codec

    codec = Codec.open(spec.checkpoint, warm=False)
    return codec, codec.prepare(spec.questions, spec.max_len, spec.head_max_len)
