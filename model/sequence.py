"""Token sequences: one row per (state, question).

Layout of a row: ``[CLS] "<type> question: <instructions>" [SEP] [MASK] opt0 [MASK] opt1 ... [SEP]
<state> [SEP]``. The question half (the "head") does not depend on the state, so it is built once per
question set; the state is tokenized once and shared by every question of the request.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .questions import Question, serialize_state

OPTION_TOKEN_CAP = 48      # tokens kept per option text (after its [MASK])
MIN_OPTION_BUDGET = 16     # below this many spare head tokens, options are cut evenly
MIN_PER_OPTION = 4         # ... but never below this many tokens each ([MASK] included)
MIN_INSTRUCTION_TOKENS = 8
# Long state texts are tokenized in pieces (the same ids, see `piece_safe`), all pieces of a call in one parallel
# batch, so one long text does not run on one core (see BENCHMARKS.md, "long states tokenized in pieces").
PIECE_CHARS = 512

log = logging.getLogger(__name__)

# Normalizers and pre-tokenizers under which a cut at one space between two non-space characters changes no token:
# that space already begins a new pre-token (byte-level BPE's regex included)
_SAFE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "BertNormalizer", "StripAccents"}
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "BertPreTokenizer", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits"}
_SELF_CHECK = ("The quick brown fox's 12 jumps, 3.5 times: over the lazy dog!  Twice  spaced. "
               "Caf\u00e9 na\u00efve \u00fcber 2024-11-30 \u4e2d\u6587 tab\there x1 y2 end's last")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _parts_ok(spec: Any, safe: set[str]) -> bool:
    if spec is None:
        return True
    if spec.get("type") == "Sequence":
        inner = spec.get("normalizers") or spec.get("pretokenizers") or []
        return all(_parts_ok(x, safe) for x in inner)
    if spec.get("type") == "ByteLevel" and spec.get("use_regex") is False:
        return False   # no split at spaces: BPE merges may span them
    return spec.get("type") in safe


def piece_safe(tokenizer_json: str) -> tuple[bool, str]:
    """(True, "") when a tokenizer (its JSON) gives the same ids for a text and for its pieces cut at single spaces
    between letters or digits (`split_points`); else (False, why)."""
    spec = json.loads(tokenizer_json)
    if not _parts_ok(spec.get("normalizer"), _SAFE_NORMALIZERS):
        return False, "normalizer %s" % (spec.get("normalizer") or {}).get("type")
    if not _parts_ok(spec.get("pre_tokenizer"), _SAFE_PRE_TOKENIZERS):
        return False, "pre-tokenizer %s" % (spec.get("pre_tokenizer") or {}).get("type")
    for a in spec.get("added_tokens") or []:
        # a token that swallows the whitespace after it, or spans one, can straddle a cut
        if a.get("rstrip") or any(c.isspace() for c in a.get("content", "")):
            return False, "added token %r" % a.get("content")
    return True, ""


def split_points(text: str, every: int) -> list[int]:
    """Offsets of single spaces, about `every` characters apart, with a letter or digit on both sides (never within
    `every` // 2 of the end)."""
    cuts: list[int] = []
    n = len(text)
    pos = every
    while pos < n - every // 2:
        p = text.find(" ", pos)
        while 0 < p < n - 1 and not (text[p - 1].isalnum() and text[p + 1].isalnum()):
            p = text.find(" ", p + 1)
        if p <= 0 or p >= min(n - 1, n - every // 2):
            break
        cuts.append(p)
        pos = p + every
    return cuts


def split_text(text: str, every: int) -> list[str]:
    """`text` cut at `split_points(text, every)` (the space starts the next piece); one piece when none."""
    cuts = split_points(text, every)
    if not cuts:
        return [text]
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


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
    # The same ids as int32 when the builder's row_arrays is on (a packed backend stages them in one concatenate).
    # Not pickled: a row sent to another process carries its ids once; None means "convert ids".
    arr: np.ndarray | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["arr"] = None
        return state


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
        # A private copy of the Rust tokenizer (the HF wrapper's ids): nobody can switch truncation or padding on
        # it, as the wrapper does on `truncation=True`, so threads may share it
        from tokenizers import Tokenizer

        self._backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self._backend.no_truncation()
        self._backend.no_padding()
        self.cores = _cores()
        self.piece_chars = self._piece_chars()   # the shortest piece a long text is cut into; 0: never cut
        self.mask = tokenizer.mask_token
        self.cls_id = tokenizer.cls_token_id
        self.sep_id = tokenizer.sep_token_id
        self.mask_id = tokenizer.mask_token_id
        self.pad_id = tokenizer.pad_token_id
        self.max_len = int(max_len)
        self.head_max_len = int(head_max_len)
        # Rows also carry int32 ids (Row.arr) only where a packed backend in this process stages them (the codec
        # of a fast-backend Engine); rows shipped to another process would build them for nothing
        self.row_arrays = False

    # -- tokenization -------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def _batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips character offsets, which nothing here reads: the same ids,
        # faster
        fast = getattr(self._backend, "encode_batch_fast", None) or self._backend.encode_batch
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def _piece_chars(self) -> int:
        """PIECE_CHARS when long states may be tokenized in pieces here, else 0 (one core, or a tokenizer whose
        ids could change at a cut: checked from its spec, then on a sample text)."""
        if self.cores < 2:
            return 0
        ok, why = piece_safe(self._backend.to_str())
        if ok:
            whole = self._ids(_SELF_CHECK)
            for every in (1, 3, 7, 16):
                if [i for p in split_text(_SELF_CHECK, every) for i in self._ids(p)] != whole:
                    ok, why = False, "a sample text tokenized differently in pieces of %d characters" % every
                    break
        if not ok:
            log.info("tokenizing long states whole (%s)", why)
            return 0
        return PIECE_CHARS

    def piece_length(self, texts: Sequence[str]) -> int:
        """How many characters apart `texts` are cut for tokenizing (0: not cut): about 4 pieces a core over the
        long texts, none shorter than piece_chars."""
        if not self.piece_chars or len(texts) >= 2 * self.cores:
            return 0
        total = sum(len(t) for t in texts if len(t) > 2 * self.piece_chars)
        return max(self.piece_chars, total // (4 * self.cores)) if total else 0

    def _ids_many(self, texts: list[str]) -> list[list[int]]:
        """Ids of many texts in one parallel batch; long texts go in as pieces (`piece_length`)."""
        every = self.piece_length(texts)
        if not every:
            return self._batch(texts)
        pieces: list[str] = []
        counts: list[int] = []
        for t in texts:
            parts = split_text(t, every) if len(t) > 2 * every else [t]
            pieces.extend(parts)
            counts.append(len(parts))
        ids = self._batch(pieces)
        out, k = [], 0
        for c in counts:
            if c == 1:
                out.append(ids[k])
            else:
                out.append([i for part in ids[k:k + c] for i in part])
            k += c
        return out

    def _clean(self, text: str) -> str:
        return text.replace(self.mask, " ") if self.mask else text

    def state_ids(self, state: Any) -> list[int]:
        """Token ids of a whole state (untruncated)."""
        text = self._clean(serialize_state(state))
        return self._ids_many([text])[0] if self.piece_length([text]) else self._ids(text)

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
    def check_fits(self, questions: Sequence[Question], heads: Sequence[Head], max_len: int | None = None,
                   head_max_len: int | None = None) -> None:
        """None when every question's option markers fit in `max_len` (with any state); else ValueError naming
        the first question whose options do not."""
        ml = self.max_len if max_len is None else int(max_len)
        for q, h in zip(questions, heads):
            fit = sum(1 for m in h.markers if m < ml)
            if fit != h.n_options:
                raise ValueError(
                    "question %r: only %d of its %d option markers fit in max_len=%d with "
                    "head_max_len=%d spent on the question; lower head_max_len, raise max_len, or use "
                    "fewer options" % (q.qid, fit, h.n_options, ml,
                                       self.head_max_len if head_max_len is None else head_max_len))

    def encode(self, state: Any, questions: Sequence[Question], heads: Sequence[Head],
               state_ids: list[int] | None = None, max_len: int | None = None,
               head_max_len: int | None = None) -> EncodedState:
        """Rows for one state against every question; ValueError if a question's options do not fit."""
        if state_ids is None:
            state_ids = self.state_ids(state)
        # a conversation keeps its newest turns
        return self.encode_ids(state_ids, questions, heads, isinstance(state, list), max_len, head_max_len)

    def encode_ids(self, state_ids: list[int], questions: Sequence[Question], heads: Sequence[Head],
                   keep_newest: bool = False, max_len: int | None = None,
                   head_max_len: int | None = None) -> EncodedState:
        """Rows for a state given as token ids (`keep_newest`: truncate from the front); ValueError if a
        question's options do not fit."""
        ml = self.max_len if max_len is None else int(max_len)
        self.check_fits(questions, heads, ml, head_max_len)
        rows, dropped = [], []
        n = len(state_ids)
        sa = np.asarray(state_ids, dtype=np.int32) if self.row_arrays else None
        sep = np.array([self.sep_id], dtype=np.int32)
        for q, h in zip(questions, heads):
            room = max(0, ml - len(h.ids) - 1)
            lo, hi = (max(0, n - room), n) if keep_newest else (0, min(room, n))
            st = state_ids[lo:hi]
            ids = (list(h.ids) + st + [self.sep_id])[:ml]
            arr = None if sa is None else np.concatenate((np.asarray(h.ids, dtype=np.int32), sa[lo:hi], sep))[:ml]
            rows.append(Row(ids, [m for m in h.markers if m < ml], q.type_id, arr))
            dropped.append(n - len(st))
        return EncodedState(rows, n, dropped)
