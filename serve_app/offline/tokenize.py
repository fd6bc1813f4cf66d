"""Stage 1, CPU tasks: read rows' states, validate them, tokenize, and recover each row's position in its file.

A cell that cannot be scored gets its reason in `__error` and flows on with null values, so rows out always
equals rows in. Only the state tokens some row keeps are shipped on to the scorer.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from .config import JobSpec
from .schema import (
    C_ERROR,
    C_IDS,
    C_LEFT,
    C_PATH,
    C_ROW,
    C_TOKENS,
    C_TRUNC,
    RAY_PATH,
    RAY_ROW_HASH,
    Stage,
    job_codec,
)


# -- states -------------------------------------------------------------------------------------
def _jsonable(v: Any) -> Any:
    """A value from a struct/list column with Arrow scalars JSON cannot write turned into text/numbers."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (datetime.date, datetime.time, datetime.datetime)):
        return v.isoformat()
    if isinstance(v, datetime.timedelta):
        return v.total_seconds()
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", errors="replace")
    return v


def column_values(col: pa.ChunkedArray | pa.Array) -> list[Any]:
    """Python values of a state column; map values become dicts."""
    values = col.to_pylist()
    if pa.types.is_map(col.type):
        values = [None if v is None else {str(k): x for k, x in v} for v in values]
    return values


def extract_state(value: Any, json_state: bool, max_chars: int) -> tuple[Any, str | None, str | None]:
    """(state, its text, None) for a usable cell, or (None, None, reason) for one that cannot be scored."""
    from model.questions import serialize_state

    if value is None:
        return None, None, "state is null"
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            return None, None, "state is not valid UTF-8: %s" % e
    if isinstance(value, str):
        if not value.strip():
            return None, None, "state is empty"
        if json_state:
            if max_chars and len(value) > max_chars:
                return None, None, "state too large: %d characters > max_state_chars=%d" % (len(value), max_chars)
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                return None, None, "state is not valid JSON: %s" % e
            if not isinstance(value, (str, dict, list)):
                return None, None, "state JSON must be an object, array or string: got %s" % type(value).__name__
            if isinstance(value, str) and not value.strip():
                return None, None, "state is empty"
    elif isinstance(value, (dict, list)):
        value = _jsonable(value)
    else:
        return None, None, "state must be text, JSON text, or a struct/list/map column: got %s" % type(value).__name__
    if isinstance(value, (dict, list)) and not value:
        return None, None, "state is empty"
    try:
        text = serialize_state(value)
    except (TypeError, ValueError) as e:
        return None, None, "state cannot be written as JSON: %s" % e
    if max_chars and len(text) > max_chars:
        return None, None, "state too large: %d characters > max_state_chars=%d" % (len(text), max_chars)
    return value, text, None


# -- row positions ------------------------------------------------------------------------------
_INV1 = pow(0xBF58476D1CE4E5B9, -1, 1 << 64)
_INV2 = pow(0x94D049BB133111EB, -1, 1 << 64)


def _unxorshift(x: np.ndarray, s: int) -> np.ndarray:
    y = x.copy()
    k = s
    while k < 64:
        y = x ^ (y >> np.uint64(s))
        k += s
    return y


def row_index(paths: list[str], hashes: np.ndarray) -> np.ndarray:
    """Each row's position in its file, recovered from Ray's `row_hash` (int64).

    Ray 2.60's read_parquet(include_row_hash=True) writes splitmix64(md5(path)[:8] + position) with the
    position counted from the start of the file (row groups included), and splitmix64's finalizer is a
    bijection, so inverting it gives the position back exactly. Callers check the result is in range.
    """
    h = np.asarray(hashes, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = _unxorshift(h, 31)
        x = x * np.uint64(_INV2)
        x = _unxorshift(x, 27)
        x = x * np.uint64(_INV1)
        x = _unxorshift(x, 30)
        seeds = {p: np.uint64(int.from_bytes(hashlib.md5(p.encode("utf-8")).digest()[:8], "little"))
                 for p in set(paths)}
        seed = np.array([seeds[p] for p in paths], dtype=np.uint64)
        return (x - seed).astype(np.int64)


# -- the stage ----------------------------------------------------------------------------------
def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # pragma: no cover
        return False


class TokenizeStage(Stage):
    """Read batch -> carried columns plus each row's file, position, state token ids, usage and error."""

    ADDS = {C_PATH: "the input file of the row", C_ROW: "the row's position in its file (int64)",
            C_IDS: "state token ids, trimmed to what any row keeps (list<int32>; null on error)",
            C_LEFT: "the state is a conversation: trimmed from the left, newest turns kept (bool)",
            C_TOKENS: "input tokens over the state's rows (int64; null on error)",
            C_TRUNC: "the state was cut to fit max_len (bool; null on error)",
            C_ERROR: "why the row cannot be scored (string; null when it can)"}
    DROPS = (RAY_PATH, RAY_ROW_HASH)

    def __init__(self, spec: JobSpec):
        self.spec = spec

    def requires(self) -> dict[str, str]:
        """The state column, the carried columns and the two columns Ray's reader synthesizes."""
        need = {self.spec.state_column: "the state: text, JSON text, struct, list or map"}
        need.update({c: "copied to the output" for c in self.spec.carry_columns})
        need.update({RAY_PATH: "the file a row was read from", RAY_ROW_HASH: "Ray's hash of (file, position)"})
        return need

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The carried columns of `batch` with the `ADDS` columns after them."""
        if _in_ray_worker():  # the task holds one CPU: one tokenizer thread (read when the pool first starts)
            os.environ.setdefault("RAYON_NUM_THREADS", "1")
        self.check(batch)
        spec = self.spec
        from model.codec import keeps_newest

        codec, prepared = job_codec(spec)
        n = batch.num_rows
        values = column_values(batch.column(spec.state_column))
        errors: list[str | None] = [None] * n
        states: list[Any] = [None] * n
        texts: dict[int, str] = {}
        for i, v in enumerate(values):
            states[i], text, errors[i] = extract_state(v, spec.json_state, spec.max_state_chars)
            if errors[i] is None:
                texts[i] = text
        good = list(texts)
        try:
            ids_list = codec.states_ids([texts[i] for i in good])
        except Exception:  # one bad text fails the whole batch call; find it
            ids_list = []
            for i in good:
                try:
                    ids_list.append(codec.states_ids([texts[i]])[0])
                except Exception as e:
                    errors[i] = "state cannot be tokenized: %s" % e
                    ids_list.append(None)
        ids_col: list[list[int] | None] = [None] * n
        left = [False] * n
        tokens: list[int | None] = [None] * n
        trunc: list[bool | None] = [None] * n
        for i, ids in zip(good, ids_list):
            if ids is None:
                continue
            try:
                enc = codec.encode(states[i], prepared, ids)
            except Exception as e:  # pragma: no cover - heads were checked up front
                errors[i] = "state cannot be encoded: %s" % e
                continue
            left[i] = keeps_newest(states[i])
            tokens[i] = enc.tokens
            trunc[i] = max(enc.dropped) > 0
            ids_col[i] = prepared.trim_ids(ids, left[i])
        paths = batch.column(RAY_PATH).to_pylist()
        rows = row_index(paths, batch.column(RAY_ROW_HASH).to_numpy())
        cols = {c: batch.column(c) for c in spec.carry_columns}
        cols.update({C_PATH: pa.array(paths, pa.string()), C_ROW: pa.array(rows, pa.int64()),
                     C_IDS: pa.array(ids_col, pa.list_(pa.int32())), C_LEFT: pa.array(left, pa.bool_()),
                     C_TOKENS: pa.array(tokens, pa.int64()), C_TRUNC: pa.array(trunc, pa.bool_()),
                     C_ERROR: pa.array(errors, pa.string())})
        return pa.table(cols)
