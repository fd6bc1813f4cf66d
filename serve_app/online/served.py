"""One checkpoint as the ingress serves it: its codec (tokenizing, decoding) and its scorer deployment.

`ServedCheckpoint.score(rows)` sends one request's rows to the checkpoint's scorer, sharing a call with
concurrent requests (coalescer.py), retrying when the replica died and mapping Serve's failures to HTTP:
overload 503 + Retry-After, the deadline (`Limits.scorer_timeout_s`) 504, or 503 + Retry-After when the
deadline passed while the checkpoint had no running replica (scaled to zero and still warming up).
`answer_states` scores a batch's states and decodes them, a failed state getting an error entry of its own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from model.codec import Codec
from model.engine import row_token_limit

from .coalescer import CallCoalescer
from .request_checks import HTTPError
from .schemas import Limits

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
COLD_RETRY_AFTER_S = 5  # a cold start (process, load, warm-up) takes seconds, not one
STATE_FAILED = "inference failed"


class ServedCheckpoint:
    """A served checkpoint: `name` (its served name), `path`, `codec`, and `scorer`, a handle with
    `score_many` / `stats` / `info` methods; `backend`, the scorer's backend name, bounds a row's tokens.
    `is_warm()` (async) says whether it has a running replica."""

    def __init__(self, name: str, path: str, scorer, limits: Limits, errors, *, backend: str = "eager",
                 max_inflight: int = 4, max_call_tokens: int = 65536,
                 is_warm: Callable[[], Awaitable[bool]] | None = None):
        self.name, self.path, self.scorer, self.limits, self._err = name, path, scorer, limits, errors
        self.codec = Codec.open(path)
        # rows as long as the scorer's backend takes (eager: past the checkpoint's max_len, as upstream)
        self.codec.max_tokens_per_row = row_token_limit(self.codec.bundle, backend)
        self.model_name = Codec.empty_result()["model"]
        self.calls = CallCoalescer(self._score_many, max_inflight=max_inflight, max_call_tokens=max_call_tokens)
        self.last_ok = 0.0
        self._is_warm = is_warm

    async def is_warm(self) -> bool:
        """Whether a replica of this checkpoint's scorer runs now (True when nobody can tell)."""
        return True if self._is_warm is None else await self._is_warm()

    def counters(self) -> dict[str, int]:
        """Scorer calls of this ingress replica, the requests they carried, and requests waiting or in a call."""
        c = self.calls
        return {"scorer_calls": c.calls, "requests": c.requests, "waiting": c.waiting, "inflight": c.inflight}

    # -- scoring ------------------------------------------------------------------------------
    async def score(self, rows: list) -> tuple:
        """The scorer's (logits, act) for one request's rows, sharing a scorer call with concurrent requests."""
        try:
            out = await self.calls.submit(rows)
        except HTTPError as e:  # one instance per request: it may be raised in many handlers
            raise HTTPError(e.status, e.detail, e.headers) from None
        if isinstance(out, dict):  # this request failed in its batch (the scorer logged why); others did not
            raise HTTPError(500, STATE_FAILED)
        return out

    async def deadline_passed(self) -> HTTPError:
        """The error for a call past the deadline: 503 + Retry-After while no replica runs (a cold start
        outlasting the deadline), else 504."""
        if not await self.is_warm():
            return HTTPError(503, "checkpoint %r is starting, try again later" % self.name,
                             {"Retry-After": str(COLD_RETRY_AFTER_S)})
        return HTTPError(504, "scoring timed out")

    async def _score_many(self, groups: list) -> list:
        """One scorer call for several requests' rows; retries when the replica died, maps overload to 503."""
        err = self._err
        attempts = self.limits.scorer_retries + 1
        for attempt in range(attempts):
            resp = self.scorer.score_many.remote(groups)
            try:
                out = await asyncio.wait_for(resp, self.limits.scorer_timeout_s)
                self.last_ok = time.monotonic()
                return out
            except err.BackPressureError:
                raise HTTPError(503, "server busy, try again later", {"Retry-After": str(RETRY_AFTER_S)}) from None
            except err.DeploymentUnavailableError:
                raise HTTPError(503, "scorer unavailable, try again later",
                                {"Retry-After": str(RETRY_AFTER_S)}) from None
            except TimeoutError:
                resp.cancel()
                raise await self.deadline_passed() from None
            except (err.ActorDiedError, err.ActorUnavailableError) as e:
                # the replica died mid-request (killed, node lost); forwards are idempotent, so retry
                log.warning("scorer %s replica unavailable (%s), attempt %d/%d", self.name, type(e).__name__,
                            attempt + 1, attempts)
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
            except err.RequestCancelledError:
                raise HTTPError(499, "request cancelled") from None
            except (err.RayTaskError, err.RayActorError) as e:
                log.error("scorer %s failed: %s", self.name, type(getattr(e, "cause", None) or e).__name__)
                raise HTTPError(500, STATE_FAILED) from None
        raise HTTPError(503, "scorer unavailable, try again later", {"Retry-After": str(RETRY_AFTER_S)})

    # -- tokenizing and decoding (CPU; the ingress runs large ones on its thread pool) ---------
    def _encode(self, encode, what, questions, budget):
        """(prepared questions, `encode(what, prepared)`), or (None, None) for no questions; 422 for a bad
        question, budget or state. The codec remembers prepared question sets itself."""
        try:
            prepared = self.codec.prepare(questions, **budget)
            if not prepared:
                return None, None
            return prepared, encode(what, prepared)
        except (ValueError, TypeError) as e:
            raise HTTPError(422, str(e)) from None

    def encode_one(self, state, questions, budget):
        """(prepared, the state's rows) as `_encode` gives them."""
        return self._encode(self.codec.encode, state, questions, budget)

    def encode_many(self, states, questions, budget):
        """(prepared, each state's rows) as `_encode` gives them; the states are tokenized in one batch."""
        return self._encode(self.codec.encode_many, states, questions, budget)

    def decode_many(self, prepared, encs, logits, act) -> list[dict]:
        """One answer JSON per encoded state, from the concatenated (logits, act) of their rows."""
        out, pos = [], 0
        for enc in encs:
            n = len(enc.rows)
            out.append(self.codec.decode(prepared, enc, logits[pos:pos + n], act[pos:pos + n]))
            pos += n
        return out

    async def answer_states(self, prepared, encs, cpu) -> list[dict]:
        """One answer JSON per state (decoded through `cpu`, the ingress's thread pool); when the scorer fails
        the batch, each state is scored alone and a state that fails again gets `{"model", "error"}` (500 if
        every state fails, any other error as it is)."""
        try:
            logits, act = await self.score([r for e in encs for r in e.rows])
        except HTTPError as e:
            if e.status != 500 or len(encs) == 1:
                raise
        else:
            return await cpu(self.decode_many, prepared, encs, logits, act)
        outs = await asyncio.gather(*(self.score(e.rows) for e in encs), return_exceptions=True)
        failed = [isinstance(o, HTTPError) and o.status == 500 for o in outs]
        if all(failed):
            raise HTTPError(500, STATE_FAILED)
        other = next((o for o, f in zip(outs, failed) if isinstance(o, BaseException) and not f), None)
        if other is not None:
            raise other
        return [{"model": self.model_name, "error": STATE_FAILED} if f
                else self.codec.decode(prepared, enc, *out) for enc, out, f in zip(encs, outs, failed)]
