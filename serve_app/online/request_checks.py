"""Checks of one HTTP request before any tokenizing: body reading under limits, shape, sizes and budgets.

Every failure is an `HTTPError` with upstream laya-serve's status and text where upstream has one: 400
malformed (including NaN / Infinity, which JSON does not have), 408 slow body, 413 over a limit, 415 a body
that is not declared JSON, 422 a bad budget. No message carries a traceback or a file path.
"""

import asyncio
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request

from model.questions import render_criterion, serialize_state

from .schemas import Limits


class HTTPError(Exception):
    """An error answer: status, client-safe detail, optional headers."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers or {}


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


STATE_PROBE_VALUES = 64  # values of a state `_chars_over` looks at before leaving the measure to the serializer
LONE_SURROGATE_DETAIL = "request body contains an unpaired surrogate escape; those cannot be encoded as UTF-8"


def _chars_over(state: Any, cap: int) -> int:
    """The summed length of the state's first string values when that already exceeds `cap` (a lower bound on
    its JSON length, which upstream reports too), else 0; looks at `STATE_PROBE_VALUES` values at most."""
    total, stack, budget = 0, [state], STATE_PROBE_VALUES
    while stack and budget > 0:
        budget -= 1
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
            if total > cap:
                return total
        elif type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list:
            stack.extend(item)
        else:  # any other value ends the probe: the serializer measures the state
            return 0
    return 0


def state_chars(state: Any, cap: int | None = None) -> int:
    """Characters of the text the model reads for `state` (JSON for dicts and lists); with `cap`, a state whose
    string values alone exceed it reports their length instead, as upstream does, without serializing it."""
    over = _chars_over(state, cap) if cap is not None and not isinstance(state, str) else 0
    if over:
        return over
    try:
        return len(serialize_state(state))
    except (TypeError, ValueError):
        raise HTTPError(400, "'state' must be a string or JSON object/array") from None


def _text_chars(value: Any) -> int:
    """Characters of `value` as the model reads it (strings as-is, anything else as JSON); 0 if unrenderable
    (question validation then names the problem)."""
    try:
        return len(render_criterion(value))
    except (TypeError, ValueError, RecursionError):
        return 0


def _question_texts(q: dict) -> list[tuple[str, Any]]:
    """(what, value) for each criterion text of a question definition: labels, descriptions, levels."""
    crit, out = q.get("criteria"), []
    if isinstance(crit, dict):
        for k, v in crit.items():
            out += [("criterion label", k), ("criterion %r" % (k,), v)]
    elif isinstance(crit, list):
        out += [("criterion %d" % i, v) for i, v in enumerate(crit)]
    labels = q.get("labels")
    if isinstance(labels, dict):
        out += [("label %r" % (k,), v) for k, v in labels.items()]
    return out


def _check_texts(qid: Any, q: dict, limits: Limits) -> None:
    """413 naming the question when its instructions or one of its criterion texts is over its limit."""
    if "instructions" in q:
        n = _text_chars(q["instructions"])
        if n > limits.max_instruction_chars:
            raise HTTPError(413, "instructions too long for %r (%d > %d chars)"
                            % (qid, n, limits.max_instruction_chars))
    for what, value in _question_texts(q):
        n = _text_chars(value)
        if n > limits.max_criterion_chars:
            raise HTTPError(413, "%s of %r too long (%d > %d chars)" % (what, qid, n, limits.max_criterion_chars))


def check_questions(questions: Any, limits: Limits) -> None:
    """400 if `questions` is not an object; 413 over the question, option and text limits; 422 for a score
    question with a null level (upstream's check before any tokenizing)."""
    if not isinstance(questions, dict):
        raise HTTPError(400, "'questions' must be an object")
    if len(questions) > limits.max_questions:
        raise HTTPError(413, "too many questions (%d > %d)" % (len(questions), limits.max_questions))
    total = 0
    for qid, q in questions.items():
        if not isinstance(q, dict):
            continue
        crit, qtype = q.get("criteria"), q.get("type")
        if qtype == "choice" and isinstance(crit, (dict, list)):
            total += len(crit)
            if len(crit) > limits.max_choice_options:
                raise HTTPError(413, "too many choice options for %r (%d > %d)"
                                % (qid, len(crit), limits.max_choice_options))
        elif qtype == "score" and isinstance(crit, list):
            total += len(crit)
            if len(crit) > limits.max_score_levels:
                raise HTTPError(413, "too many score levels for %r (%d > %d)"
                                % (qid, len(crit), limits.max_score_levels))
            if None in crit:  # a hole in the rubric: a Jev client cannot parse a null legend entry
                raise HTTPError(422, "score question %r has a null level at index %d; give every level a "
                                     "description" % (qid, crit.index(None)))
    if total > limits.max_total_options:
        raise HTTPError(413, "too many answer options across questions (%d > %d)"
                        % (total, limits.max_total_options))
    for qid, q in questions.items():  # after the counts, which bound how many texts there are
        if isinstance(q, dict):
            _check_texts(qid, q, limits)


def check_state(state: Any, limits: Limits) -> int:
    """400 for a missing state, 413 over the character limit; returns the state's length."""
    if state is None:
        raise HTTPError(400, "'state' is required")
    n = state_chars(state, limits.max_state_chars)
    if n > limits.max_state_chars:
        raise HTTPError(413, "state too large (%d > %d chars)" % (n, limits.max_state_chars))
    return n


def check_request(state: Any, questions: Any, limits: Limits) -> None:
    """The checks of one state's request in upstream's order: the state is there (400), the questions
    (`check_questions`: 400 / 413 / 422), then the state's size (413)."""
    if state is None:
        raise HTTPError(400, "'state' is required")
    check_questions(questions, limits)
    check_state(state, limits)


def check_batch(states: Any, questions: Any, limits: Limits) -> None:
    """The checks of a batch in upstream's order: a non-empty list (400), at most `max_batch_states` (413), then
    `check_request` of each state in turn."""
    if not isinstance(states, list) or not states:
        raise HTTPError(400, "'states' must be a non-empty list")
    if len(states) > limits.max_batch_states:
        raise HTTPError(413, "too many states in batch (%d > %d)" % (len(states), limits.max_batch_states))
    for s in states:
        check_request(s, questions, limits)


def budget_args(body: dict) -> dict[str, int]:
    """`max_len` / `head_max_len` from the body (integers only; range checked by the engine). The routes read
    them through `controls.parse_controls`, which checks them as upstream does."""
    out = {}
    for key in ("max_len", "head_max_len"):
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise HTTPError(422, "%s must be a positive integer, got %s" % (key, type(v).__name__))
        out[key] = v
    return out


class _NotJSON(ValueError):
    """A parsed value JSON does not have (NaN, Infinity, a number out of double range)."""


def _reject_constant(name: str) -> Any:
    raise _NotJSON("%s is not a JSON value (JSON has no NaN or Infinity)" % name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotJSON("the number %s is out of range" % (text[:32],))
    return value


def loads_strict(raw: bytes) -> Any:
    """`raw` parsed as strict JSON: NaN, Infinity, -Infinity and numbers that overflow a double raise
    ValueError (Python's json module accepts them by default)."""
    return json.loads(raw, parse_constant=_reject_constant, parse_float=_finite_float)


JSON_MEDIA_HINT = "send the body as JSON with Content-Type: application/json"


def check_media_type(content_type: str | None) -> None:
    """415 unless `content_type` is `application/json` or `application/<x>+json`, with at most a UTF-8 charset.

    A text/plain or form body must not be parsed: browsers send those cross-origin without a preflight."""
    media, _, params = (content_type or "").partition(";")
    if not media.strip():
        raise HTTPError(415, "missing Content-Type; %s" % JSON_MEDIA_HINT)
    main, _, sub = media.strip().lower().partition("/")
    if main != "application" or not (sub == "json" or sub.endswith("+json")):
        raise HTTPError(415, "unsupported Content-Type %r; %s" % (media.strip()[:64], JSON_MEDIA_HINT))
    for param in params.split(";"):
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in ("utf-8", "utf8"):
            raise HTTPError(415, "unsupported charset %r; JSON bodies are UTF-8" % value.strip()[:32])


async def read_json(request: Request, limits: Limits, run_cpu: Callable[..., Awaitable[Any]]) -> tuple[Any, int]:
    """The request's JSON body and its size in bytes, read under `limits` (413 over max_body_bytes, 408 past
    body_read_timeout_s, 400 for a bad Content-Length or invalid JSON, 415 for a body not declared JSON); a
    large body is parsed by `run_cpu(loads_strict, raw)`."""
    cap = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared:
        try:
            if int(declared) > cap:
                raise HTTPError(413, "request body too large")
        except ValueError:
            raise HTTPError(400, "invalid Content-Length") from None

    total, chunks = 0, []
    try:
        # a deadline on this task (no task of its own per request, as wait_for makes on Python 3.11)
        async with asyncio.timeout(limits.body_read_timeout_s):
            async for chunk in request.stream():  # chunked or understated lengths are capped here too
                total += len(chunk)
                if total > cap:
                    raise HTTPError(413, "request body too large")
                chunks.append(chunk)
        raw = b"".join(chunks)
    except TimeoutError:
        raise HTTPError(408, "request body was not received in time") from None
    check_media_type(request.headers.get("content-type"))  # after the size limits, before any parsing
    try:
        if len(raw) > 64 * 1024:  # a multi-MiB parse would stall every other request on this loop
            return await run_cpu(loads_strict, raw), len(raw)
        return loads_strict(raw), len(raw)
    except _NotJSON as e:
        raise HTTPError(400, "request body must be valid JSON: %s" % e) from None
    except (ValueError, RecursionError):
        raise HTTPError(400, "request body must be valid JSON") from None


def object_body(body: Any, required: tuple[str, ...]) -> dict:
    """`body` when it is an object with every `required` key and no unpaired surrogate escape; HTTPError 400
    otherwise. `model` is not checked here: routing reads any value as upstream does (controls.py)."""
    if not isinstance(body, dict) or any(k not in body for k in required):
        raise HTTPError(400, "request body must be an object with %s"
                        % " and ".join("'%s'" % k for k in required))
    if _has_lone_surrogate(body):
        raise HTTPError(400, LONE_SURROGATE_DETAIL)
    return body
