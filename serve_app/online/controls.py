"""The body controls of `/v1/systemone` and `/v1/systemone/batch`, and the answer JSON upstream sends (pure, no Ray).

`parse_controls` reads every control upstream laya-serve 0.4.15 takes from a body (its `BODY_CONTROLS`, and on
the batch route `batch_size` / `sort_by_length`) with upstream's rules and error texts, and refuses with 422 the
keys upstream refuses: the hook keys (`BODY_REFUSALS`), which run server-side code, and the batch route's
`diagnostics`, an out-parameter HTTP cannot return. `model`, `task`, `lang` and `lang_guess` are passed through
as sent: routing.py validates and decides on them. `finish_answer` turns a decoded answer into the one upstream
sends: the `min_confidence` gate (model/abstention.py), `routing`, and `x_jev_confidence` on choice and score
answers (or, under Jev strict mode, only the fields of the Jev contract).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from model import abstention

from .request_checks import HTTPError

SERVER_TOKEN_BUDGET = 8192  # upstream's LAYA_MAX_TOKEN_BUDGET default: the most a body's max_len may ask for
BODY_CONTROLS = ("model", "max_len", "head_max_len", "task", "lang", "lang_guess", "min_confidence")
BODY_REFUSALS = ("hooks", "on_predict_start", "on_predict_end", "hooks_raise", "hooks_timeout")
BATCH_CALL_CONTROLS = ("batch_size", "min_confidence", "sort_by_length")
BATCH_OUT_PARAMETERS = ("diagnostics",)
ROUTING_KEYS = ("model", "task", "lang", "lang_guess")


@dataclass(frozen=True)
class Controls:
    """A body's validated controls; None where the body does not set one (or sets it to null).

    `batch_size` and `sort_by_length` are validated on the batch route and change no answer here: the scorer
    cuts micro-batches by tokens across requests, and results keep their order either way."""

    max_len: int | None = None
    head_max_len: int | None = None
    min_confidence: float | dict[str, float] | None = None
    model: Any = None
    task: Any = None
    lang: Any = None
    lang_guess: Any = None
    batch_size: int | None = None
    sort_by_length: bool | None = None

    def budget(self) -> dict[str, int]:
        """The `max_len` / `head_max_len` the body sets, as keywords for `Codec.prepare`."""
        return {k: v for k, v in (("max_len", self.max_len), ("head_max_len", self.head_max_len)) if v is not None}

    def route_args(self) -> dict[str, Any]:
        """`model`, `task`, `lang`, `lang_guess` as sent, as keywords for `CheckpointRouter.route`."""
        return {k: getattr(self, k) for k in ROUTING_KEYS}


def _given(body: dict, keys: tuple[str, ...]) -> list[str]:
    return sorted(k for k in keys if body.get(k) is not None)


def refuse_keys(body: dict, *, batch: bool) -> None:
    """422 with upstream's text when the body sends a hook key (any route) or `diagnostics` (batch route) with a
    non-null value; returns None otherwise."""
    given = _given(body, BODY_REFUSALS)
    if given:
        raise HTTPError(422, "%s run inside the server process and cannot be sent to this endpoint; "
                             "install them where laya-serve runs, or drop them" % ", ".join(given))
    given = _given(body, BATCH_OUT_PARAMETERS) if batch else []
    if given:
        raise HTTPError(422, "%s is filled in place for an in-process caller and cannot be returned over "
                             "HTTP; read the per-group report from the CLI or a local Router" % ", ".join(given))


def _budget(body: dict, key: str, cap: int) -> int | None:
    """A token budget: None when absent or null, else a positive int at most `cap` (422 with upstream's text)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(422, "%s must be an integer" % key)
    if value <= 0:
        raise HTTPError(422, "%s must be a positive integer" % key)
    if value > cap:
        raise HTTPError(422, "%s exceeds server limit (%d > %d)" % (key, value, cap))
    return value


def _min_confidence(body: dict) -> float | dict[str, float] | None:
    try:
        return abstention.check_optional(body.get("min_confidence"))
    except ValueError as e:
        raise HTTPError(422, str(e)) from None


def _batch_size(body: dict) -> int | None:
    value = body.get("batch_size")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPError(422, "batch_size must be an integer")
    if value < 1:
        raise HTTPError(422, "batch_size must be a positive integer, got %r" % (value,))
    return value


def _sort_by_length(body: dict) -> bool | None:
    value = body.get("sort_by_length")
    if value is not None and not isinstance(value, bool):
        raise HTTPError(422, "sort_by_length must be a boolean")
    return value


def parse_controls(body: dict, *, batch: bool, max_token_budget: int = SERVER_TOKEN_BUDGET) -> Controls:
    """The body's `Controls`, checked in upstream's order: refused keys, `max_len`, `head_max_len` (each at most
    `max_token_budget`), `min_confidence`, then on the batch route `batch_size` and `sort_by_length`; raises
    HTTPError 422 with upstream's text for the first bad one. The single route ignores `batch_size`,
    `sort_by_length` and `diagnostics`, as upstream does."""
    refuse_keys(body, batch=batch)
    max_len = _budget(body, "max_len", max_token_budget)
    head_max_len = _budget(body, "head_max_len", max_token_budget)
    min_confidence = _min_confidence(body)
    batch_size = _batch_size(body) if batch else None
    sort_by_length = _sort_by_length(body) if batch else None
    return Controls(max_len, head_max_len, min_confidence, *(body.get(k) for k in ROUTING_KEYS),
                    batch_size=batch_size, sort_by_length=sort_by_length)


# -- answers ----------------------------------------------------------------------------------------------------
def jev_confidence(answer: dict) -> float | None:
    """The `confidence` Jev's formulas give an answer's probabilities (choice: (max p - 1/n) / (1 - 1/n); score:
    1 - expected distance from the mode over that of a uniform distribution), or None for a noul answer, an
    unknown type or probabilities that are not finite non-negative numbers."""
    kind, probs = answer.get("type"), answer.get("probabilities")
    if kind not in ("choice", "score") or not isinstance(probs, dict) or not probs:
        return None
    if any(isinstance(v, bool) for v in probs.values()):
        return None
    try:
        keys = sorted(probs, key=int) if kind == "score" else list(probs)
        p = [float(probs[k]) for k in keys]
    except (TypeError, ValueError):
        return None
    if not all(math.isfinite(v) and v >= 0.0 for v in p):
        return None
    n = len(p)
    if n == 1:
        return 1.0
    total = sum(p)
    p = [v / total for v in p] if total else [1.0 / n] * n
    if kind == "choice":
        return (max(p) - 1.0 / n) / (1.0 - 1.0 / n)
    mode = max(range(n), key=p.__getitem__)
    spread = sum(v * abs(i - mode) for i, v in enumerate(p))
    uniform = sum(abs(i - (n - 1) / 2) for i in range(n)) / n
    return max(0.0, 1.0 - spread / uniform)


def _with_jev_confidence(answer: Any) -> Any:
    conf = jev_confidence(answer) if isinstance(answer, dict) else None
    return answer if conf is None else {**answer, "x_jev_confidence": round(conf, 4)}


def jev_strict(result: dict) -> dict:
    """`result` cut to the Jev wire contract: `model`, `answers` with each type's contracted fields, and `usage`'s
    two token counts; an answer of an unknown type passes unchanged."""
    fields = {"choice": ("type", "choice", "confidence", "probabilities"),
              "score": ("type", "score", "confidence", "probabilities", "legend"),
              "noul": ("type", "noul")}
    answers = {}
    for qid, a in (result.get("answers") or {}).items():
        keep = fields.get(a.get("type")) if isinstance(a, dict) else None
        answers[qid] = a if keep is None else {k: a[k] for k in keep}
    usage = result.get("usage") or {}
    return {"model": result["model"], "answers": answers,
            "usage": {"input_tokens": usage.get("input_tokens", 0), "output_tokens": usage.get("output_tokens", 0)}}


def finish_answer(answer: dict, controls: Controls | None, routing: dict, *, strict: bool = False) -> dict:
    """The answer JSON upstream laya-serve sends for a decoded `answer` (not modified): `routing` (a copy of the
    dict given) after `model`, `answers` and `usage`; each answer gated at `controls.min_confidence` when set; then
    `x_jev_confidence` appended to every choice and score answer. With `strict` (upstream's LAYA_JEV_STRICT) the
    gated result cut to the Jev contract (`jev_strict`) instead. An entry without `answers` (a batch state that
    failed) is returned as it is."""
    if not isinstance(answer.get("answers"), dict):
        return answer
    result = {k: v for k, v in answer.items() if k != "routing"}
    result["answers"] = {q: dict(a) if isinstance(a, dict) else a for q, a in answer["answers"].items()}
    result["routing"] = dict(routing)
    abstention.apply([result], controls.min_confidence if controls is not None else None)
    if strict:
        return jev_strict(result)
    return {**result, "answers": {q: _with_jev_confidence(a) for q, a in result["answers"].items()}}
