"""Question validation and normalisation.

A question set is validated once per request (it does not depend on the state) and turned into
`Question` objects that carry everything sequence building and decoding need. Every rejection is
a `ValueError` whose message starts with ``question '<id>':`` so a caller can find the culprit.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

QTYPES = {"choice": 0, "score": 1, "noul": 2}
QTYPE_NAMES = {v: k for k, v in QTYPES.items()}
_DEFAULT_NOUL_TEXT = {"false": "no, the statement does not hold", "true": "yes, the statement holds"}
_LABELS_RULE = "noul labels must map exactly 'false' and 'true' to distinct non-empty strings"


@dataclass(frozen=True)
class Question:
    """One validated question: its id, type, instruction text, rendered options and answer keys."""

    qid: Any
    qtype: str
    instructions: str
    options: tuple[str, ...]          # option texts in canonical (label-index) order
    keys: tuple[Any, ...] = ()        # choice: answer labels (caller's originals); score: level texts
    order: tuple[int, ...] | None = None  # slot s shows option order[s]
    legend: tuple[str, ...] = field(default=())

    @property
    def type_id(self) -> int:
        """The numeric question type fed to the model's type embedding."""
        return QTYPES[self.qtype]

    @property
    def n_options(self) -> int:
        """How many options (markers) the question has."""
        return len(self.options)


def render_criterion(value: Any) -> str:
    """Text for one criterion: strings unchanged, anything else as one-line JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def _fail(qid: Any, msg: str) -> ValueError:
    return ValueError("question %r: %s" % (qid, msg))


def _noul_labels(qid: Any, labels: Any) -> tuple[str, str]:
    if labels is None:
        return "false", "true"
    if not isinstance(labels, dict) or set(labels) != {"false", "true"}:
        raise _fail(qid, _LABELS_RULE)
    lo, hi = labels["false"], labels["true"]
    if not isinstance(lo, str) or not isinstance(hi, str):
        raise _fail(qid, _LABELS_RULE)
    lo, hi = lo.strip(), hi.strip()
    if not lo or not hi or lo == hi:
        raise _fail(qid, _LABELS_RULE)
    return lo, hi


def _check_instructions(qid: Any, ins: Any) -> str:
    if ins is None:
        raise _fail(qid, "'instructions' must not be None; add the text the model should answer")
    if isinstance(ins, bool) or not isinstance(ins, (str, dict, list, int, float)):
        raise _fail(qid, "'instructions' must be a string, dict, or list, got %s" % type(ins).__name__)
    if isinstance(ins, str):
        if not ins.strip():
            raise _fail(qid, "'instructions' must not be empty; add the text the model should answer")
        return ins
    if isinstance(ins, (list, dict)) and not ins:
        raise _fail(qid, "'instructions' must not be empty; add the text the model should answer")
    return json.dumps(ins, ensure_ascii=False)


def _choice(qid: Any, crit: Any) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    if not isinstance(crit, (dict, list)):
        raise _fail(qid, "a choice question takes 'criteria' as a dict of label -> description, "
                         "or a list of labels")
    if not crit:
        raise _fail(qid, "a choice question needs at least one criterion")
    labels = list(crit) if isinstance(crit, list) else list(crit.keys())
    seen: dict[Any, int] = {}
    for i, label in enumerate(labels):
        if label is None:
            raise _fail(qid, "choice label %d is null; a label is option text and the answer key, "
                             "so it must be a string, number or bool" % i)
        if not isinstance(label, (str, int, float, bool)):
            raise _fail(qid, "choice label %d is a %s; a label must be a scalar (string, number or "
                             "bool), got %r" % (i, type(label).__name__, label))
        if isinstance(label, float) and not math.isfinite(label):  # no JSON answer key, never equal to itself
            raise _fail(qid, "choice label %d is %r; a number label must be finite" % (i, label))
        if label in seen:  # 1, 1.0 and True are one dict key
            raise _fail(qid, "choice label %d (%r) repeats label %d; every option needs its own "
                             "answer key (1, 1.0 and True are one key)" % (i, label, seen[label]))
        seen[label] = i
    if isinstance(crit, list):
        descs = [None] * len(labels)
    else:
        descs = list(crit.values())
    texts = tuple(str(k) if d is None or d == "" else "%s: %s" % (k, render_criterion(d))
                  for k, d in zip(labels, descs))
    return texts, tuple(labels)


def _score(qid: Any, crit: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(crit, list):
        raise _fail(qid, "a score question takes 'criteria' as a list of level descriptions, "
                         "index 0 first")
    if not crit:
        raise _fail(qid, "a score question needs at least one level")
    if any(c is None for c in crit):
        raise _fail(qid, "score level %d is null; give every level a description, index 0 first"
                    % next(i for i, c in enumerate(crit) if c is None))
    legend = tuple(render_criterion(c) for c in crit)
    return tuple("level %d: %s" % (i, t) for i, t in enumerate(legend)), legend


def _noul(qid: Any, crit: Any, labels: Any) -> tuple[str, ...]:
    if crit is not None and not isinstance(crit, dict):
        raise _fail(qid, "a noul question takes 'criteria' as a dict with optional 'true'/'false' "
                         "descriptions, or omits it")
    crit = {str(k).lower(): v for k, v in (crit or {}).items()}
    if not set(crit) <= {"true", "false"}:
        raise _fail(qid, "a noul question takes 'criteria' keyed only 'true'/'false', got %s; "
                         "set 'labels' to change how the answer is worded" % sorted(crit))
    names = dict(zip(("false", "true"), _noul_labels(qid, labels)))
    out = []
    for side in ("false", "true"):
        c = crit.get(side)
        out.append(names[side] + ": " + (render_criterion(c) if c not in (None, "") else _DEFAULT_NOUL_TEXT[side]))
    return tuple(out)


def validate_question(qid: Any, qdef: Any) -> Question:
    """Check one question definition and return its normalised `Question`; ValueError names it."""
    if qid is None:
        raise ValueError("question id must not be None")
    if isinstance(qid, bool) or not isinstance(qid, (str, int)) or (isinstance(qid, str) and not qid.strip()):
        raise ValueError("question id must be a non-empty string, got %r" % (qid,))
    if not isinstance(qdef, dict):
        raise _fail(qid, "definition must be a dict, got %s" % type(qdef).__name__)
    qtype = qdef.get("type")
    if not isinstance(qtype, str) or qtype not in QTYPES:
        raise _fail(qid, "unknown type %r; use one of %s" % (qtype, sorted(QTYPES)))
    if "instructions" not in qdef:
        raise _fail(qid, "no 'instructions'; add the text the model should answer")
    ins = _check_instructions(qid, qdef["instructions"])
    if "labels" in qdef and qtype != "noul":
        raise _fail(qid, "'labels' is only supported for noul questions")
    crit = qdef.get("criteria")
    keys: tuple[Any, ...] = ()
    legend: tuple[str, ...] = ()
    if qtype == "choice":
        options, keys = _choice(qid, crit)
    elif qtype == "score":
        options, legend = _score(qid, crit)
    else:
        options = _noul(qid, crit, qdef.get("labels"))
    order = None
    if "option_order" in qdef:
        raw = qdef["option_order"]
        n = len(options)
        ok = (isinstance(raw, (list, tuple)) and len(raw) == n
              and all(isinstance(i, int) and not isinstance(i, bool) for i in raw)
              and sorted(raw) == list(range(n)))
        if not ok:
            raise _fail(qid, "'option_order' must be a permutation of range(%d) -- one slot per option, "
                             "each option once -- got %r" % (n, raw))
        order = tuple(int(i) for i in raw)
    return Question(qid=qid, qtype=qtype, instructions=ins, options=options, keys=keys,
                    order=order, legend=legend)


def validate_questions(questions: Any) -> list[Question]:
    """Validate a whole question mapping (id -> definition), in order; raises on the first bad one."""
    if not isinstance(questions, dict):
        raise TypeError("questions must be a dict of question id -> definition, got %s"
                        % type(questions).__name__)
    return [validate_question(qid, qdef) for qid, qdef in questions.items()]


def serialize_state(state: Any) -> str:
    """The text the model reads for a state: strings as-is, dicts and lists as JSON."""
    if isinstance(state, str):
        return state
    return json.dumps(state, ensure_ascii=False)
