"""The weightless codec: everything around a backend forward, on CPU, from a checkpoint's tokenizer and config.

`prepare` validates a question set and tokenizes its heads (remembered per question set), `encode` turns a
state into one row per question, `encode_ids` does the same from state token ids computed elsewhere,
`decode` builds the upstream answer JSON and `decode_columns` the offline job's per-question column values.
The ingress, the offline stages and `Engine` all use this one class, so their rows and answers are identical.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from . import decode as _decode
from .bundle import Bundle, open_bundle
from .questions import Question, validate_questions
from .sequence import EncodedState, Head, SequenceBuilder

log = logging.getLogger(__name__)

PREPARED_CACHE_SIZE = 256           # question sets kept prepared (validated, heads tokenized) per codec
PREPARED_CACHE_MAX_KEY = 64 * 1024  # larger question sets are prepared on every call, not cached
COLUMN_SUFFIXES = ("", "_confidence", "_answer_confidence", "_probabilities")  # the columns of one question
_WARM_QUESTIONS = {"warm": {"type": "noul", "instructions": "warm up?"}}


def _prepared_key(questions: Any) -> str | None:
    """The question set's JSON text when it is plain JSON data that survives a round trip unchanged (so equal
    texts mean equal question sets: no int keys turned to strings, no tuples, no objects), else None."""
    try:
        text = json.dumps(questions, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None
    if len(text) > PREPARED_CACHE_MAX_KEY or json.loads(text) != questions:
        return None
    return text


def _check_budget(name: str, value: Any) -> int | None:
    """`value` when it is None or a positive int; ValueError naming `name` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("%s must be a positive integer, got %r" % (name, value))
    return value


def json_key(k: Any) -> str:
    """A label as JSON writes it as an object key ('true' for True, '1' for 1)."""
    return k if isinstance(k, str) else json.dumps(k)


def column_kind(q: Question) -> str:
    """The kind of a question's value column: "string", "bool", "int" or "float" (choice: its labels' kind;
    mixed labels are "string", written as JSON text; score and noul: "float")."""
    if q.qtype != "choice":
        return "float"
    kinds = {bool if isinstance(k, bool) else int if isinstance(k, int) else type(k) for k in q.keys}
    if kinds == {str}:
        return "string"
    if kinds == {bool}:
        return "bool"
    if kinds == {int}:
        return "int"
    if kinds <= {int, float}:
        return "float"
    return "string"


def label_value(label: Any, kind: str) -> Any:
    """A choice label converted for a value column of `kind` (see `column_kind`)."""
    if kind == "string":
        return json_key(label)
    if kind == "float":
        return float(label)
    return label


@dataclass(frozen=True)
class Prepared:
    """A validated question set with its state-independent heads, ready to encode states against."""

    questions: tuple[Question, ...]
    heads: tuple[Head, ...]
    max_len: int
    head_max_len: int

    def __bool__(self) -> bool:
        return bool(self.questions)

    @cached_property
    def kmax(self) -> int:
        """The most options of any question (the width of a logits row)."""
        return max((q.n_options for q in self.questions), default=0)

    @cached_property
    def room(self) -> int:
        """The most state tokens any row keeps: state ids beyond it (`trim_ids`) change no row."""
        return max(0, self.max_len - min((len(h.ids) for h in self.heads), default=0) - 1)

    @cached_property
    def names(self) -> tuple[str, ...]:
        """Each question's id as text: the base name of its output columns."""
        return tuple(str(q.qid) for q in self.questions)

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        """Each question's value column kind (`column_kind`)."""
        return tuple(column_kind(q) for q in self.questions)

    @cached_property
    def column_names(self) -> tuple[str, ...]:
        """The per-question output columns, in order: name, name_confidence, name_answer_confidence,
        name_probabilities for each question."""
        return tuple(n + s for n in self.names for s in COLUMN_SUFFIXES)

    def trim_ids(self, state_ids: list[int], keep_newest: bool) -> list[int]:
        """`state_ids` cut to the `room` tokens a row can keep (the newest ones for a conversation)."""
        keep = self.room
        if keep_newest:
            return state_ids[len(state_ids) - keep:] if keep else []
        return state_ids[:keep]


def keeps_newest(state: Any) -> bool:
    """Whether rows of `state` keep its last tokens when truncated (a conversation: a list of turns)."""
    return isinstance(state, list)


class Codec:
    """A checkpoint's tokenizer, token budgets and temperatures; thread-safe, holds no weights."""

    def __init__(self, bundle: Bundle, max_tokens_per_row: int | None = None, row_arrays: bool = False):
        self.bundle = bundle
        self.builder = SequenceBuilder(bundle.tokenizer, bundle.max_len, bundle.head_max_len)
        self.builder.row_arrays = bool(row_arrays)  # rows also carry int32 ids, for a packed backend here
        self.temperatures = _decode.Temperatures(bundle.cfg, bundle.path)
        self.max_tokens_per_row = int(max_tokens_per_row or bundle.max_len)
        self._prepared: OrderedDict[tuple, Prepared] = OrderedDict()
        self._prepared_lock = threading.Lock()

    @classmethod
    def open(cls, checkpoint: str, max_tokens_per_row: int | None = None, warm: bool = True) -> Codec:
        """A codec over `checkpoint`'s tokenizer and config (no weights), its tokenizer warmed when `warm`."""
        t = time.perf_counter()
        codec = cls(open_bundle(checkpoint), max_tokens_per_row)
        if warm:
            codec.warm()
        log.info("codec for %s ready in %.2fs (max_len %d)", checkpoint, time.perf_counter() - t,
                 codec.bundle.max_len)
        return codec

    def warm(self) -> None:
        """Pay the tokenizer's lazy initialisation now, before traffic."""
        self.encode_many(["warm up the tokenizer", {"k": "v"}], self.prepare(_WARM_QUESTIONS))

    # -- questions ----------------------------------------------------------------------------
    def prepare(self, questions: Any, max_len: int | None = None, head_max_len: int | None = None) -> Prepared:
        """The validated question set with its heads; ValueError names a bad question, a bad budget, or a
        question whose options cannot fit in `max_len` (with any state). TypeError if not a mapping.

        Remembered per question set and budgets (the last PREPARED_CACHE_SIZE; clients repeat their question
        sets), for question sets of plain JSON data; an invalid set is never remembered."""
        plain = all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in (max_len, head_max_len))
        text = _prepared_key(questions) if plain else None
        key = None if text is None else (text, max_len, head_max_len)
        if key is not None:
            with self._prepared_lock:
                hit = self._prepared.get(key)
                if hit is not None:
                    self._prepared.move_to_end(key)
                    return hit
        qs = validate_questions(questions)
        ml = _check_budget("max_len", max_len) or self.bundle.max_len
        hml = _check_budget("head_max_len", head_max_len) or self.bundle.head_max_len
        for name, value in (("max_len", ml), ("head_max_len", hml)):  # a head never outgrows its row
            if value > self.max_tokens_per_row:
                raise ValueError("%s=%d is longer than this backend supports (%d tokens per row)"
                                 % (name, value, self.max_tokens_per_row))
        heads = tuple(self.builder.head(q, hml) for q in qs)
        self.builder.check_fits(qs, heads, ml, hml)
        prepared = Prepared(tuple(qs), heads, ml, hml)
        if key is not None:
            with self._prepared_lock:
                self._prepared[key] = prepared
                while len(self._prepared) > PREPARED_CACHE_SIZE:
                    self._prepared.popitem(last=False)
        return prepared

    # -- states -> rows -----------------------------------------------------------------------
    def states_ids(self, states: Sequence[Any]) -> list[list[int]]:
        """The whole (untruncated) token ids of each state, tokenized in one parallel batch."""
        return self.builder.states_ids(states)

    def encode(self, state: Any, prepared: Prepared, state_ids: list[int] | None = None) -> EncodedState:
        """The rows of one state, one per question (TypeError for a None state); `state_ids` skips tokenizing."""
        if state is None:
            raise TypeError("state must not be None; pass a string, dict, or list")
        if state_ids is None:
            state_ids = self.builder.state_ids(state)
        return self.encode_ids(state_ids, prepared, keeps_newest(state))

    def encode_many(self, states: Sequence[Any], prepared: Prepared) -> list[EncodedState]:
        """The rows of many states; the states are tokenized in one parallel batch."""
        for s in states:
            if s is None:
                raise TypeError("state must not be None; pass a string, dict, or list")
        ids = self.builder.states_ids(states)
        return [self.encode(s, prepared, i) for s, i in zip(states, ids)]

    def encode_ids(self, state_ids: list[int], prepared: Prepared, keep_newest: bool = False) -> EncodedState:
        """The rows of a state from its token ids alone (`keep_newest`: truncate from the front, as for a
        conversation); the same rows as `encode` of that state, and of the ids cut by `Prepared.trim_ids`."""
        return self.builder.encode_ids(state_ids, prepared.questions, prepared.heads, keep_newest,
                                       prepared.max_len, prepared.head_max_len)

    # -- outputs -> answers -------------------------------------------------------------------
    def decode(self, prepared: Prepared, enc: EncodedState, logits: np.ndarray, act_p0: np.ndarray) -> dict:
        """The answer JSON for one state from its rows' outputs (logits [rows, >=kmax], P(action 0) [rows])."""
        return _decode.result(prepared.questions, prepared.heads, enc, logits, act_p0, self.temperatures)

    def decode_columns(self, prepared: Prepared, logits: np.ndarray, act_p0: np.ndarray) -> dict[str, Any]:
        """One state's per-question column values, keyed by `prepared.column_names`: the value (choice labels
        converted by `label_value` for their column kind), confidence, answer confidence, and probabilities as
        (key, p) pairs (choice keys as JSON writes them; noul "false"/"true")."""
        out: dict[str, Any] = {}
        for j, (q, name, kind) in enumerate(zip(prepared.questions, prepared.names, prepared.kinds)):
            a = _decode.answer(q, logits[j], float(act_p0[j]), self.temperatures)
            if q.qtype == "choice":
                out[name] = label_value(a["choice"], kind)
                probs = [(json_key(k), v) for k, v in a["probabilities"].items()]
            elif q.qtype == "score":
                out[name] = a["score"]
                probs = list(a["probabilities"].items())
            else:
                out[name] = a["noul"]
                probs = [("false", round(1.0 - a["noul"], 4)), ("true", a["noul"])]
            out[name + "_confidence"] = a["confidence"]
            out[name + "_answer_confidence"] = a["answer_confidence"]
            out[name + "_probabilities"] = probs
        return out

    @staticmethod
    def empty_result() -> dict:
        """The answer JSON for a request with no questions."""
        return _decode.empty_result()
