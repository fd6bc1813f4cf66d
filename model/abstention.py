"""The `min_confidence` abstention gate, as upstream `laya` 0.4.15 applies it to answer JSON.

A threshold is a number in [0, 1] or a per-bucket map (`"choice:3-5"`, `"noul:2"`, ..., plus `"default"`)
keyed by an answer's type and option count. `check` validates one with upstream's error texts; `apply`
gates answers in place: every answer of a gated call gets `abstention` ("passed", "abstained" or
"unevaluated") and `abstention_threshold` (the threshold its bucket was gated at), and an answer whose
confidence falls below it also gets `low_confidence: true`, written before the other two. An ungated call
(`None`) writes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

Threshold = float | dict[str, float]

PASSED, ABSTAINED, UNEVALUATED = "passed", "abstained", "unevaluated"
QTYPES = ("choice", "score", "noul")
SIZES = ("2", "3-5", "6-10", "11+")
DEFAULT_KEY = "default"
BUCKETS = frozenset("%s:%s" % (t, s) for t in QTYPES for s in SIZES)


def _number(value: Any) -> float | None:
    """`value` as a float when it is a finite real number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _one(value: Any) -> float:
    """A single threshold as a float; ValueError with upstream's text unless a real number in [0, 1]."""
    v = _number(value)
    if v is None or not 0.0 <= v <= 1.0:
        raise ValueError("min_confidence must be a float in [0.0, 1.0], got %r" % (value,))
    return v


def check(value: Any) -> Threshold:
    """`value` validated: a float for a number, a {bucket: float} dict for a map (keys from `BUCKETS` or
    "default"); ValueError with upstream's text for anything else. None is not a threshold: callers
    treat an absent value before calling this."""
    if not isinstance(value, dict):
        return _one(value)
    if not value:
        raise ValueError("a min_confidence map must be a non-empty dict of bucket -> float, got %r" % (value,))
    out: dict[str, float] = {}
    for key, v in value.items():
        if not isinstance(key, str) or (key not in BUCKETS and key != DEFAULT_KEY):
            raise ValueError("min_confidence map keys must be a bucket like 'choice:3-5' or "
                             "'default', got %r" % (key,))
        out[key] = _one(v)
    return out


def check_optional(value: Any) -> Threshold | None:
    """None for None, else `check(value)`."""
    return None if value is None else check(value)


def bucket(answer: dict) -> str | None:
    """The answer's option-count bucket ("choice:3-5", ...), or None for an unknown type or no options."""
    kind = answer.get("type")
    if kind not in QTYPES:
        return None
    probs = answer.get("probabilities")
    if isinstance(probs, dict) and probs:
        k = len(probs)
    elif kind == "noul":
        k = 2
    else:
        return None
    size = "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"
    return "%s:%s" % (kind, size)


def threshold_for(answer: dict, threshold: Threshold) -> float:
    """The threshold `answer` is gated at: the number itself, or its bucket's entry of a map, else the map's
    "default", else 0.0 (gate nothing)."""
    if not isinstance(threshold, dict):
        return float(threshold)
    key = bucket(answer)
    if key is not None and key in threshold:
        return threshold[key]
    return threshold.get(DEFAULT_KEY, 0.0)


def gate_confidence(answer: dict) -> float | None:
    """The number the gate compares: `answer_confidence`, else the older `confidence`; None when neither is a
    finite real number."""
    conf = _number(answer.get("answer_confidence"))
    return conf if conf is not None else _number(answer.get("confidence"))


def gate_answer(answer: dict, threshold: Threshold) -> str:
    """Gate one answer dict in place (see the module docstring); returns its `abstention` state."""
    thr = threshold_for(answer, threshold)
    conf = gate_confidence(answer)
    if conf is not None and conf < thr:
        answer["low_confidence"] = True
        state = ABSTAINED
    else:
        answer.pop("low_confidence", None)
        state = UNEVALUATED if conf is None else PASSED
    answer["abstention"] = state
    answer["abstention_threshold"] = float(thr)
    return state


def apply(results: Iterable[Any], threshold: Threshold | None) -> None:
    """Gate every answer of every result (`{"answers": {...}, ...}`) in place at a validated `threshold`;
    None gates nothing and writes nothing. Entries without an answers object (batch errors) are skipped."""
    if threshold is None:
        return
    for result in results:
        answers = result.get("answers") if isinstance(result, dict) else None
        if not isinstance(answers, dict):
            continue
        for answer in answers.values():
            if isinstance(answer, dict):
                gate_answer(answer, threshold)
