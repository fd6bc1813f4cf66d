"""Decoding model outputs into the upstream answer JSON (`model`, `answers`, `usage`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .questions import QTYPE_NAMES, Question
from .sequence import EncodedState, Head

MODEL_NAME = "laya-rl-agent"
TEMP_MIN, TEMP_MAX = 0.5, 5.0


def clamp_temperature(t: Any) -> float:
    """A usable temperature: confined to [0.5, 5]; 1.0 for anything that is not a finite number."""
    if isinstance(t, bool):
        return 1.0
    try:
        t = float(t)
    except (TypeError, ValueError):
        return 1.0
    if not math.isfinite(t):
        return 1.0
    return min(TEMP_MAX, max(TEMP_MIN, t))


def _rejected(raw: Any, applied: float) -> bool:
    if isinstance(raw, bool):
        return True
    try:
        return float(raw) != applied
    except (TypeError, ValueError):
        return True


class Temperatures:
    """Per-type and per-option-count temperatures from `rl_agent_config.json`, clamped."""

    def __init__(self, cfg: dict, source: str = "checkpoint"):
        raw = cfg.get("temperature", [1.0, 1.0, 1.0])
        if not isinstance(raw, (list, tuple)) or len(raw) != 3:
            raise ValueError("Incompatible model: %r temperature must be a list of 3 floats, got %r"
                             % (source, raw))
        by_raw = cfg.get("temperature_by_options") or {}
        if not isinstance(by_raw, dict):
            raise ValueError("Incompatible model: %r temperature_by_options must be a mapping, got %r"
                             % (source, by_raw))
        self.by_type = [clamp_temperature(t) for t in raw]
        self.by_options = {k: clamp_temperature(v) for k, v in by_raw.items()}
        bad = ["%s=%r -> %g" % (k, v, self.by_options[k]) for k, v in by_raw.items()
               if _rejected(v, self.by_options[k])]
        bad += ["temperature[%d]=%r -> %g" % (i, v, self.by_type[i]) for i, v in enumerate(raw)
                if _rejected(v, self.by_type[i])]
        if bad:
            warnings.warn("laya-fleet: %s ships temperatures outside [%g, %g] or not numbers; using %s"
                          % (source, TEMP_MIN, TEMP_MAX, ", ".join(bad)), RuntimeWarning, stacklevel=3)

    def for_question(self, qtype: int, k: int) -> float:
        """The temperature applied to a question of type `qtype` with `k` options."""
        size = "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"
        return self.by_options.get("%s:%s" % (QTYPE_NAMES[qtype], size), self.by_type[qtype])


# The ufuncs' own reduce and minimum/maximum, not ndarray.max()/.sum()/np.clip: the same arithmetic without
# their Python wrappers (a large share of decoding a request's time)
_MAX, _SUM = np.maximum.reduce, np.add.reduce


def _entropy_confidence(p: np.ndarray, k: int) -> float:
    if k < 2:
        return 1.0
    pk = p[:k]
    ent = -float(_SUM(pk * np.log(np.minimum(np.maximum(pk, 1e-12), 1.0))))
    score = 1.0 - ent / math.log(k)
    return 0.0 if score < 0.0 else (1.0 if score > 1.0 else score)


def answer(q: Question, logits: np.ndarray, act_p0: float, temps: Temperatures) -> dict:
    """One question's answer dict from its row's raw option logits (length k, slot order)."""
    k = q.n_options
    z = np.asarray(logits[:k], dtype=np.float32) / temps.for_question(q.type_id, k)
    p = np.exp(z - _MAX(z))
    p /= _SUM(p)
    if q.order is not None:  # slot s showed option order[s]; index by option again
        canonical = np.empty_like(p)
        canonical[np.asarray(q.order, dtype=int)] = p
        p = canonical
    top = float(_MAX(p[:k]))
    pl = p.tolist()   # Python floats, exactly float(v) of each element
    ans_conf = round(0.0 if top < 0.0 else (1.0 if top > 1.0 else top), 4)
    action = {"act_probability": round(float(act_p0), 4)}
    if q.qtype == "choice":
        return {"type": "choice", "choice": q.keys[int(p.argmax())],
                "probabilities": {kk: round(v, 4) for kk, v in zip(q.keys, pl)},
                "confidence": round(_entropy_confidence(p, k), 4),
                "answer_confidence": ans_conf, "action": action}
    if q.qtype == "score":
        return {"type": "score", "score": round(float(_SUM(np.arange(k) * p)), 4),
                "legend": {str(i): t for i, t in enumerate(q.legend)},
                "probabilities": {str(i): round(v, 4) for i, v in enumerate(pl)},
                "confidence": round(_entropy_confidence(p, k), 4),
                "answer_confidence": ans_conf, "action": action}
    p1 = pl[1]
    return {"type": "noul", "noul": round(p1, 4), "confidence": round(max(p1, 1.0 - p1), 4),
            "answer_confidence": ans_conf, "action": action}


def result(questions: Sequence[Question], heads: Sequence[Head], enc: EncodedState,
           logits: np.ndarray, act_p0: np.ndarray, temps: Temperatures) -> dict:
    """The full per-state result: answers for every question plus the usage block.

    `logits` is [rows, >=kmax] for this state's rows (question order) and `act_p0` [rows].
    """
    answers = {q.qid: answer(q, logits[j], float(act_p0[j]), temps) for j, q in enumerate(questions)}
    dropped = max(enc.dropped)
    usage = {"input_tokens": enc.tokens, "output_tokens": 0, "state_tokens": enc.state_tokens,
             "state_tokens_dropped": dropped, "truncated": dropped > 0,
             "truncated_questions": [q.qid for q, d in zip(questions, enc.dropped) if d > 0]}
    collapsed = {q.qid: {"total": h.n_options, "distinct": h.n_distinct,
                         "tokens_per_option": h.tokens_per_option}
                 for q, h in zip(questions, heads) if h.n_distinct < h.n_options}
    if collapsed:
        usage["options"] = collapsed
    return {"model": MODEL_NAME, "answers": answers, "usage": usage}


def empty_result() -> dict:
    """The result for a request with no questions: no tokenization, no forward."""
    return {"model": MODEL_NAME, "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}
