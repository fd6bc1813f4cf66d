"""The Ray Data stages of the offline job: tokenize (CPU tasks), score (scorer actors), decode (CPU tasks).

Every stage takes and returns a pyarrow Table. Internal columns start with ``__`` and never reach the
output files. A row that cannot be scored keeps its reason in ``__error`` from the stage that found it
and flows on with null values, so rows out always equals rows in.

Only the score stage loads weights. Tokenize and decode build the question heads from the checkpoint's
tokenizer and config alone (`QuestionSet`), with the same `SequenceBuilder` code the Engine uses, so a
row built here is token-for-token the row `Engine.encode` builds.
"""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import pyarrow as pa

log = logging.getLogger(__name__)

# Columns Ray's read_parquet synthesizes (include_paths / include_row_hash).
RAY_PATH, RAY_ROW_HASH = "path", "row_hash"
# Internal columns between stages.
C_PATH, C_ROW, C_IDS, C_LEFT = "__path", "__row", "__ids", "__left"
C_TOKENS, C_TRUNC, C_ERROR = "__tokens", "__truncated", "__error"
C_LOGITS, C_ACT, C_STATS = "__logits", "__act", "__stats"
# Output columns besides the question columns.
OUT_TOKENS, OUT_TRUNC, OUT_ERROR = "input_tokens", "truncated", "error"
SUFFIXES = ("", "_confidence", "_answer_confidence", "_probabilities")


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

    @property
    def questions(self) -> dict:
        """The question mapping (id -> definition)."""
        return json.loads(self.questions_json)


# -- questions without weights ------------------------------------------------------------------
class QuestionSet:
    """A validated question set with its heads, temperatures and column names; no weights loaded.

    Raises ValueError naming the question when a definition is bad or its options cannot fit in
    `max_len` (that does not depend on the state, so it is checked here once).
    """

    def __init__(self, checkpoint: str, questions: Any, max_len: int | None = None,
                 head_max_len: int | None = None):
        from model.bundle import open_bundle
        from model.decode import Temperatures
        from model.questions import validate_questions
        from model.sequence import SequenceBuilder

        bundle = open_bundle(checkpoint)
        self.builder = SequenceBuilder(bundle.tokenizer, bundle.max_len, bundle.head_max_len)
        self.questions = validate_questions(questions)
        if not self.questions:
            raise ValueError("the questions file has no questions; add at least one")
        for name, v in (("max_len", max_len), ("head_max_len", head_max_len)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError("%s must be a positive integer, got %r" % (name, v))
        self.max_len = max_len or bundle.max_len
        self.head_max_len = head_max_len or bundle.head_max_len
        if self.max_len > bundle.max_len:
            raise ValueError("max_len=%d is longer than the checkpoint's max_len (%d)" % (self.max_len, bundle.max_len))
        self.heads = [self.builder.head(q, self.head_max_len) for q in self.questions]
        # Raises "question 'x': only n of its k option markers fit ..." for any state.
        self.builder.encode("", self.questions, self.heads, state_ids=[], max_len=self.max_len,
                            head_max_len=self.head_max_len)
        self.temps = Temperatures(bundle.cfg, bundle.path)
        self.kmax = max(q.n_options for q in self.questions)
        # The most state tokens any row keeps; a state is shipped to the scorer trimmed to this.
        self.room = max(0, self.max_len - min(len(h.ids) for h in self.heads) - 1)
        self.names = [str(q.qid) for q in self.questions]

    def encode(self, state: Any, state_ids: list[int]):
        """The `EncodedState` of one state (rows exactly as `Engine.encode` builds them)."""
        return self.builder.encode(state, self.questions, self.heads, state_ids=state_ids,
                                   max_len=self.max_len, head_max_len=self.head_max_len)

    def output_fields(self) -> list[pa.Field]:
        """The per-question output fields, then input_tokens, truncated and error."""
        fields = []
        for q, name in zip(self.questions, self.names):
            fields += [pa.field(name, label_type(q)), pa.field(name + "_confidence", pa.float64()),
                       pa.field(name + "_answer_confidence", pa.float64()),
                       pa.field(name + "_probabilities", pa.map_(pa.string(), pa.float64()))]
        return fields + [pa.field(OUT_TOKENS, pa.int64()), pa.field(OUT_TRUNC, pa.bool_()),
                         pa.field(OUT_ERROR, pa.string())]


@lru_cache(maxsize=4)
def question_set(spec: JobSpec) -> QuestionSet:
    """The `QuestionSet` of a job, built once per worker process."""
    return QuestionSet(spec.checkpoint, spec.questions, spec.max_len, spec.head_max_len)


def json_key(k: Any) -> str:
    """A label as JSON writes it as an object key ('true' for True, '1' for 1)."""
    return k if isinstance(k, str) else json.dumps(k)


def label_type(q: Any) -> pa.DataType:
    """The Arrow type of a question's value column: its labels' type for choice, float otherwise."""
    if q.qtype != "choice":
        return pa.float64()
    kinds = {bool if isinstance(k, bool) else int if isinstance(k, int) else type(k) for k in q.keys}
    if kinds == {str}:
        return pa.string()
    if kinds == {bool}:
        return pa.bool_()
    if kinds == {int}:
        return pa.int64()
    if kinds <= {int, float}:
        return pa.float64()
    return pa.string()  # mixed labels: strings as-is, the others as JSON text


def label_value(label: Any, typ: pa.DataType) -> Any:
    """A choice label converted for its column type."""
    if pa.types.is_string(typ):
        return json_key(label)
    if pa.types.is_floating(typ):
        return float(label)
    return label


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


# -- row index ----------------------------------------------------------------------------------
_M64 = (1 << 64) - 1
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


# -- stage 1: tokenize (CPU tasks) --------------------------------------------------------------
def _carry(batch: pa.Table, spec: JobSpec) -> dict[str, pa.ChunkedArray]:
    return {c: batch.column(c) for c in spec.carry_columns}


def _in_ray_worker() -> bool:
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # pragma: no cover
        return False


def tokenize_batch(batch: pa.Table, spec: JobSpec) -> pa.Table:
    """The read batch with state token ids (trimmed to what any row keeps), usage and errors added."""
    if _in_ray_worker():  # the task holds one CPU: one tokenizer thread (read when the pool first starts)
        os.environ.setdefault("RAYON_NUM_THREADS", "1")
    qs = question_set(spec)
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
        ids_list = qs.builder.states_ids([texts[i] for i in good])
    except Exception:  # one bad text fails the whole batch call; find it
        ids_list = []
        for i in good:
            try:
                ids_list.append(qs.builder.states_ids([texts[i]])[0])
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
            enc = qs.encode(states[i], ids)
        except Exception as e:  # pragma: no cover - heads were checked up front
            errors[i] = "state cannot be encoded: %s" % e
            continue
        left[i] = isinstance(states[i], list)  # a conversation keeps its newest turns
        tokens[i] = enc.tokens
        trunc[i] = max(enc.dropped) > 0
        keep = qs.room
        ids_col[i] = (ids[len(ids) - keep:] if keep else []) if left[i] else ids[:keep]
    paths = batch.column(RAY_PATH).to_pylist()
    rows = row_index(paths, batch.column(RAY_ROW_HASH).to_numpy())
    cols = _carry(batch, spec)
    cols.update({C_PATH: pa.array(paths, pa.string()), C_ROW: pa.array(rows, pa.int64()),
                 C_IDS: pa.array(ids_col, pa.list_(pa.int32())), C_LEFT: pa.array(left, pa.bool_()),
                 C_TOKENS: pa.array(tokens, pa.int64()), C_TRUNC: pa.array(trunc, pa.bool_()),
                 C_ERROR: pa.array(errors, pa.string())})
    return pa.table(cols)


# -- stage 2: score (actor pool, one scorer per GPU) ---------------------------------------------
def _list_values(arr: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, offsets) of a list column (nulls are empty lists)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if len(arr) == 0:
        return np.zeros(0), np.zeros(1, dtype=np.int64)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    return values[offsets[0]:offsets[-1]], offsets - offsets[0]


class ScoreStage:
    """A Ray Data actor: one `Scorer` (warmed up in the constructor) scoring whole batches.

    The scorer sorts a batch's rows by length, cuts micro-batches under its token budget and puts the
    outputs back in order; the budget is measured at warm-up on CUDA and halved on out-of-memory.
    """

    def __init__(self, spec: JobSpec, scorer_options: dict, cpus: float = 1.0):
        import torch

        from .scorer import Scorer

        if scorer_options.get("device") == "cpu" or not torch.cuda.is_available():
            torch.set_num_threads(max(1, int(cpus)))
        self.spec = spec
        self.scorer = Scorer(spec.checkpoint, **scorer_options)
        self.qs = question_set(spec)
        engine = self.scorer.engine
        self.qs.builder.row_arrays = engine.builder.row_arrays   # rows built here are staged here
        prepared = engine.prepare(spec.questions, spec.max_len, spec.head_max_len)
        if [h.ids for h in prepared.heads] != [h.ids for h in self.qs.heads]:  # pragma: no cover
            raise RuntimeError("the scorer's question heads differ from the tokenizer stage's")
        self._lock = threading.Lock()
        self.identity = self._identity()
        self.identity["ready_at"] = time.time()  # wall clock: the summary's "after start-up" rate starts here
        log.info("score stage ready: %s", self.identity)

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

    def _score(self, rows: list, per_state: list[tuple[int, int]], errors: list) -> tuple[np.ndarray, np.ndarray]:
        """Scores all rows; if the batch fails for a reason other than memory, scores state by state."""
        from .scorer import is_oom

        try:
            return self.scorer.score_rows(rows)
        except Exception as e:
            if is_oom(e):
                raise
            log.warning("batch of %d rows failed (%s); scoring state by state", len(rows), e)
            logits = np.zeros((len(rows), self.qs.kmax), dtype=np.float32)
            act = np.zeros(len(rows), dtype=np.float32)
            failed = 0
            for i, (a, b) in enumerate(per_state):
                if a == b:
                    continue
                try:
                    lg, ap = self.scorer.score_rows(rows[a:b])
                    logits[a:b, :lg.shape[1]] = lg[:, :self.qs.kmax]
                    act[a:b] = ap
                except Exception as e2:
                    errors[i] = "scoring failed: %s" % e2
                    failed += 1
            if failed and failed == sum(1 for a, b in per_state if a != b):
                raise
            return logits, act

    def __call__(self, batch: pa.Table) -> pa.Table:
        """The batch with raw option logits and P(action 0) per state instead of token ids."""
        n, nq, kmax = batch.num_rows, len(self.qs.questions), self.qs.kmax
        errors = batch.column(C_ERROR).to_pylist()
        left = batch.column(C_LEFT).to_pylist()
        values, offsets = _list_values(batch.column(C_IDS))
        rows, per_state = [], []
        for i in range(n):
            start = len(rows)
            if errors[i] is None:
                ids = values[offsets[i]:offsets[i + 1]].tolist()
                rows.extend(self.qs.encode([] if left[i] else "", ids).rows)
            per_state.append((start, len(rows)))
        if rows:
            logits, act = self._score(rows, per_state, errors)
        else:
            logits, act = np.zeros((0, kmax), np.float32), np.zeros(0, np.float32)
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
        with self._lock:
            stats = {**self.identity, "packed": self.scorer.packed, **self.scorer.info()}
        stats_col = [json.dumps(stats)] + [None] * (n - 1) if n else []
        out = batch.drop_columns([C_IDS, C_LEFT, C_ERROR])
        lg_col = pa.ListArray.from_arrays(pa.array(lg_off), pa.array(flat_logits), mask=mask)
        act_col = pa.ListArray.from_arrays(pa.array(act_off), pa.array(flat_act), mask=mask)
        return (out.append_column(C_LOGITS, lg_col).append_column(C_ACT, act_col)
                .append_column(C_ERROR, pa.array(errors, pa.string()))
                .append_column(C_STATS, pa.array(stats_col, pa.string())))


# -- stage 3: decode (CPU tasks) ----------------------------------------------------------------
def decode_batch(batch: pa.Table, spec: JobSpec) -> pa.Table:
    """Output columns for a scored batch: carry columns, per-question values, usage, error (+ internals)."""
    from model.decode import answer

    qs = question_set(spec)
    n, nq, kmax = batch.num_rows, len(qs.questions), qs.kmax
    errors = batch.column(C_ERROR).to_pylist()
    lg_vals, lg_off = _list_values(batch.column(C_LOGITS))
    act_vals, act_off = _list_values(batch.column(C_ACT))
    fields = qs.output_fields()
    data: dict[str, list] = {f.name: [None] * n for f in fields[:-3]}
    for i in range(n):
        if errors[i] is not None:
            continue
        lg = lg_vals[lg_off[i]:lg_off[i + 1]].reshape(nq, kmax)
        ap = act_vals[act_off[i]:act_off[i + 1]]
        for j, (q, name) in enumerate(zip(qs.questions, qs.names)):
            a = answer(q, lg[j], float(ap[j]), qs.temps)
            if q.qtype == "choice":
                data[name][i] = label_value(a["choice"], fields[4 * j].type)
                probs = [(json_key(k), v) for k, v in a["probabilities"].items()]
            elif q.qtype == "score":
                data[name][i] = a["score"]
                probs = list(a["probabilities"].items())
            else:
                data[name][i] = a["noul"]
                probs = [("false", round(1.0 - a["noul"], 4)), ("true", a["noul"])]
            data[name + "_confidence"][i] = a["confidence"]
            data[name + "_answer_confidence"][i] = a["answer_confidence"]
            data[name + "_probabilities"][i] = probs
    cols = _carry(batch, spec)
    for f in fields[:-3]:
        cols[f.name] = pa.array(data[f.name], f.type)
    cols[OUT_TOKENS] = batch.column(C_TOKENS)
    cols[OUT_TRUNC] = batch.column(C_TRUNC)
    cols[OUT_ERROR] = batch.column(C_ERROR)
    for c in (C_PATH, C_ROW, C_STATS):
        cols[c] = batch.column(c)
    return pa.table(cols)
