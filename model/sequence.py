"""Token sequences: one row per (state, question).

Layout of a row: ``[CLS] "<type> question: <instructions>" [SEP] [MASK] opt0 [MASK] opt1 ... [SEP]
<state> [SEP]``. The question half (the "head") does not depend on the state, so it is built once per
question set; the state is tokenized once and shared by every question of the request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .questions import Question, serialize_state

OPTION_TOKEN_CAP = 48      # tokens kept per option text (after its [MASK])
MIN_OPTION_BUDGET = 16     # below this many spare head tokens, options are cut evenly
MIN_PER_OPTION = 4         # ... but never below this many tokens each ([MASK] included)
MIN_INSTRUCTION_TOKENS = 8


@dataclass(frozen=True)
class Head:
    """The state-independent half of a row: token ids, marker positions and option statistics."""

    ids: tuple[int, ...]
    markers: tuple[int, ...]
    n_options: int
    n_distinct: int
    tokens_per_option: int | None


@dataclass
class Row:
    """One model input row: token ids, [MASK] positions and the question type id."""

    ids: list[int]
    markers: list[int]
    qtype: int

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class EncodedState:
    """All rows of one state (one per question, in question order) plus truncation accounting."""

    rows: list[Row]
    state_tokens: int
    dropped: list[int]   # state tokens dropped, per question

    @property
    def tokens(self) -> int:
        """Total tokens over this state's rows (what `usage.input_tokens` reports)."""
        return sum(len(r.ids) for r in self.rows)

    @property
    def max_len(self) -> int:
        """The longest row of this state."""
        return max(len(r.ids) for r in self.rows)


class SequenceBuilder:
    """Builds rows with a checkpoint's tokenizer and token budgets (`max_len`, `head_max_len`)."""

    def __init__(self, tokenizer: Any, max_len: int = 512, head_max_len: int = 192):
        self.tokenizer = tokenizer
        # A private copy of the Rust tokenizer: identical ids to the HF wrapper with
        # add_special_tokens=False, but nobody else can switch truncation or padding on it (the HF
        # wrapper mutates its backend on `truncation=True`), so it is safe to share between threads.
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        self.mask = tokenizer.mask_token
        self.cls_id = tokenizer.cls_token_id
        self.sep_id = tokenizer.sep_token_id
        self.mask_id = tokenizer.mask_token_id
        self.pad_id = tokenizer.pad_token_id
        self.max_len = int(max_len)
        self.head_max_len = int(head_max_len)

    # -- tokenization -------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _ids_many(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips character offsets, which nothing here reads: the same ids
        # in less time (about a quarter to a third less in an ad-hoc timing on the CPU machine)
        fast = getattr(self._backend, "encode_batch_fast", None) or self._backend.encode_batch
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def _clean(self, text: str) -> str:
        return text.replace(self.mask, " ") if self.mask else text

    def state_ids(self, state: Any) -> list[int]:
        """Token ids of a whole state (untruncated)."""
        return self._ids(self._clean(serialize_state(state)))

    def states_ids(self, states: Sequence[Any]) -> list[list[int]]:
        """Token ids of many states at once (the tokenizer parallelises the batch)."""
        return self._ids_many([self._clean(serialize_state(s)) for s in states])

    # -- heads --------------------------------------------------------------------------------
    def head(self, q: Question, head_max_len: int | None = None) -> Head:
        """Build the question half of a row for `q`."""
        hml = self.head_max_len if head_max_len is None else int(head_max_len)
        text_ids = self._ids("%s question: %s" % (q.qtype, self._clean(q.instructions)))
        order = q.order if q.order is not None else range(q.n_options)
        opts = [[self.mask_id] + self._ids(" " + self._clean(q.options[i]))[:OPTION_TOKEN_CAP] for i in order]
        budget = hml - sum(len(o) for o in opts)
        per = None
        if budget < MIN_OPTION_BUDGET:
            per = max(MIN_PER_OPTION, (hml - MIN_OPTION_BUDGET) // max(1, len(opts)))
            opts = [o[:per] for o in opts]
            budget = hml - sum(len(o) for o in opts)
        ids = [self.cls_id] + text_ids[:max(MIN_INSTRUCTION_TOKENS, budget)] + [self.sep_id]
        markers = []
        for o in opts:
            markers.append(len(ids))
            ids.extend(o)
        ids.append(self.sep_id)
        return Head(tuple(ids), tuple(markers), len(opts), len({tuple(o) for o in opts}), per)

    def heads(self, questions: Sequence[Question], head_max_len: int | None = None) -> list[Head]:
        """Heads for a whole question set, checked to fit in `max_len` with no state at all."""
        return [self.head(q, head_max_len) for q in questions]

    # -- rows ---------------------------------------------------------------------------------
    def encode(self, state: Any, questions: Sequence[Question], heads: Sequence[Head],
               state_ids: list[int] | None = None, max_len: int | None = None,
               head_max_len: int | None = None) -> EncodedState:
        """Rows for one state against every question; ValueError if a question's options do not fit."""
        ml = self.max_len if max_len is None else int(max_len)
        if state_ids is None:
            state_ids = self.state_ids(state)
        left = isinstance(state, list)  # a conversation keeps its newest turns
        rows, dropped = [], []
        for q, h in zip(questions, heads):
            room = max(0, ml - len(h.ids) - 1)
            st = state_ids[max(0, len(state_ids) - room):] if left else state_ids[:room]
            ids = (list(h.ids) + st + [self.sep_id])[:ml]
            markers = [m for m in h.markers if m < ml]
            if len(markers) != h.n_options:
                raise ValueError(
                    "question %r: only %d of its %d option markers fit in max_len=%d with "
                    "head_max_len=%d spent on the question; lower head_max_len, raise max_len, or use "
                    "fewer options" % (q.qid, len(markers), h.n_options, ml,
                                       self.head_max_len if head_max_len is None else head_max_len))
            rows.append(Row(ids, markers, q.type_id))
            dropped.append(len(state_ids) - len(st))
        return EncodedState(rows, len(state_ids), dropped)
