"""The HTTP ingress deployment (CPU): upstream Laya/Jev wire format in, answer JSON out.

Per request: bearer check (auth.py), capped body read, JSON, shape and size checks (request_checks.py),
question validation and tokenization with the weightless codec (model/codec.py), one call to the scorer
deployment with the rows, shared with concurrent requests (coalescer.py), then decoding; a large body is
checked and tokenized on a thread pool, off the event loop. Error mapping: malformed JSON / missing fields
400, bad bearer 401, over a size limit 413, a body not declared JSON 415, invalid question 422, overload
503 with Retry-After, anything else 500 with a fixed message; in a batch, a state the scorer fails on gets
an error entry of its own. No response ever carries a traceback or a file path.
"""

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.codec import Codec

from . import metrics, ray_compat
from .auth import BearerAuth
from .coalescer import CallCoalescer
from .request_checks import HTTPError, budget_args, check_questions, check_state, object_body, read_json
from .schemas import (
    BATCH_DOC,
    BODY_DOC,
    SCORE_ERRORS,
    BatchResponse,
    DocumentedApp,
    HealthResponse,
    InfoResponse,
    Limits,
    ReadyResponse,
    StatsResponse,
    SystemOneResponse,
    error_docs,
)
from .service_info import package_versions, serve_request_path

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
SMALL_BODY_BYTES = 8 * 1024  # bodies up to this are checked and tokenized on the event loop (no thread hop)
STATE_FAILED = "inference failed"
ROUTES = ("/v1/systemone", "/v1/systemone/batch")


# the OpenAPI document describes the wire format with schemas.py's models; the handlers below read the raw body
# and check it themselves, so statuses and error texts stay upstream's
app = DocumentedApp(
    title="laya-fleet",
    summary="Laya typed-decision answers over the Jev /v1/systemone protocol, on Ray Serve",
    description="`POST /v1/systemone` answers `choice` / `score` / `noul` questions about one state; "
                "`POST /v1/systemone/batch` answers one question set over many states. Errors are "
                "`{\"detail\": ...}` with 400 (malformed JSON or missing fields), 401 (bearer), 413 (limits), "
                "415 (not `Content-Type: application/json`), 422 (invalid question), 503 + Retry-After "
                "(overloaded or not ready), 500 (internal).",
    version="0.1.0",
)


@app.exception_handler(HTTPError)
async def _http_error(_request: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)


@app.exception_handler(StarletteHTTPException)
async def _starlette_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else "error"
    return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))


@app.exception_handler(Exception)
async def _internal_error(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled %s in the ingress", type(exc).__name__, exc_info=exc)
    return JSONResponse({"detail": "internal error"}, status_code=500)


def _hide_docs(fastapi_app: FastAPI) -> None:
    """Drop the OpenAPI schema and the docs pages from this replica's app."""
    hidden = {fastapi_app.openapi_url, fastapi_app.docs_url, fastapi_app.redoc_url,
              fastapi_app.swagger_ui_oauth2_redirect_url}
    fastapi_app.router.routes[:] = [r for r in fastapi_app.router.routes if getattr(r, "path", None) not in hidden]


@serve.deployment(name="Ingress", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.5})
@serve.ingress(app)
class Ingress:
    """FastAPI ingress: validates and tokenizes on CPU, scores through the scorer handle, decodes."""

    topology = "split"

    def __init__(self, scorer, checkpoint: str, limits: dict | None = None, api_key_env: str | None = None,
                 docs: bool = True, cpu_threads: int = 2, max_inflight_calls: int = 4,
                 max_call_tokens: int = 65536):
        t0 = time.perf_counter()
        ray_compat.check()  # a Ray without the APIs used here fails now, not on the first request
        self._err = ray_compat.errors()  # resolved once: the scorer-call path only reads them
        self.scorer = scorer
        self.limits = Limits.model_validate(limits or {})
        self.auth = BearerAuth(api_key_env)
        self.docs = bool(docs)
        if not self.docs:
            _hide_docs(app)
        self.codec = Codec.open(checkpoint)
        self.model_name = Codec.empty_result()["model"]
        self._versions = package_versions()
        self._pool = ThreadPoolExecutor(max(1, int(cpu_threads)), thread_name_prefix="laya-ingress")
        self._calls = CallCoalescer(self._score_many, max_inflight=max_inflight_calls,
                                    max_call_tokens=max_call_tokens)
        self._last_score_ok = 0.0
        self._m = {n: metrics.make(n, checkpoint=metrics.checkpoint_label(checkpoint)) for n in (
            "laya_fleet_requests", "laya_fleet_request_duration_seconds", "laya_fleet_ingress_warmup_seconds")}
        warm_s = time.perf_counter() - t0
        self._gauges = metrics.Refresher(lambda: self._m["laya_fleet_ingress_warmup_seconds"].set(warm_s))
        self._m["laya_fleet_ingress_warmup_seconds"].set(warm_s)
        log.info("ingress ready in %.2fs (auth %s)", time.perf_counter() - t0,
                 "on" if self.auth else "off")

    # -- plumbing -----------------------------------------------------------------------------
    def _record(self, route: str, status: int, t0: float) -> None:
        tags = {"route": route, "status": str(status)}
        self._m["laya_fleet_requests"].inc(tags=tags)
        self._m["laya_fleet_request_duration_seconds"].observe(time.perf_counter() - t0, tags=tags)

    async def _cpu(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _score(self, rows: list) -> tuple:
        """The scorer's (logits, act) for one request's rows, sharing a scorer call with concurrent requests."""
        try:
            out = await self._calls.submit(rows)
        except HTTPError as e:  # one instance per request: it may be raised in many handlers
            raise HTTPError(e.status, e.detail, e.headers) from None
        if isinstance(out, dict):  # this request failed in its batch (the scorer logged why); others did not
            raise HTTPError(500, "inference failed")
        return out

    async def _score_many(self, groups: list) -> list:
        """One scorer call for several requests' rows; retries when the replica died, maps overload to 503."""
        err = self._err
        ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError = (
            err.ActorDiedError, err.ActorUnavailableError, err.RayActorError, err.RayTaskError)
        BackPressureError, DeploymentUnavailableError, RequestCancelledError = (
            err.BackPressureError, err.DeploymentUnavailableError, err.RequestCancelledError)

        attempts = self.limits.scorer_retries + 1
        for attempt in range(attempts):
            resp = self.scorer.score_many.remote(groups)
            try:
                out = await asyncio.wait_for(resp, self.limits.scorer_timeout_s)
                self._last_score_ok = time.monotonic()
                return out
            except BackPressureError:
                raise HTTPError(503, "server busy, try again later", {"Retry-After": str(RETRY_AFTER_S)}) from None
            except DeploymentUnavailableError:
                raise HTTPError(503, "scorer unavailable, try again later",
                                {"Retry-After": str(RETRY_AFTER_S)}) from None
            except TimeoutError:
                resp.cancel()
                raise HTTPError(504, "scoring timed out") from None
            except (ActorDiedError, ActorUnavailableError) as e:
                # the replica died mid-request (killed, node lost); forwards are idempotent, so retry
                log.warning("scorer replica unavailable (%s), attempt %d/%d", type(e).__name__, attempt + 1, attempts)
                await asyncio.sleep(min(2.0, 0.25 * 2 ** attempt))
            except RequestCancelledError:
                raise HTTPError(499, "request cancelled") from None
            except (RayTaskError, RayActorError) as e:
                log.error("scorer failed: %s", type(getattr(e, "cause", None) or e).__name__)
                raise HTTPError(500, "inference failed") from None
        raise HTTPError(503, "scorer unavailable, try again later", {"Retry-After": str(RETRY_AFTER_S)})

    # -- the work (CPU, off the event loop for large requests) --------------------------------
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

    def _encode_one(self, state, questions, budget):
        """(prepared, the state's rows) as `_encode` gives them."""
        return self._encode(self.codec.encode, state, questions, budget)

    def _encode_many(self, states, questions, budget):
        """(prepared, each state's rows) as `_encode` gives them; the states are tokenized in one batch."""
        return self._encode(self.codec.encode_many, states, questions, budget)

    def _decode_many(self, prepared, encs, logits, act) -> list[dict]:
        out, pos = [], 0
        for enc in encs:
            n = len(enc.rows)
            out.append(self.codec.decode(prepared, enc, logits[pos:pos + n], act[pos:pos + n]))
            pos += n
        return out

    async def _handle(self, route: str, request: Request, answer) -> JSONResponse:
        """`answer(body)`'s response for a request that passes the bearer check and whose body reads as JSON;
        the request is counted under `route` with its status."""
        t0 = time.perf_counter()
        status = 500
        try:
            self.auth.require(request)
            body, size = await read_json(request, self.limits, self._cpu)
            response = await answer(body, size > SMALL_BODY_BYTES)
            status = 200
            return response
        except HTTPError as e:
            status = e.status
            raise
        finally:
            self._record(route, status, t0)

    def _encode_request(self, body: Any) -> tuple:
        """(prepared, the state's rows) for a `/v1/systemone` body that passes its checks (400 / 413 / 422)."""
        if not isinstance(body, dict) or "questions" not in body:
            raise HTTPError(400, "request body must be an object with a 'questions' field")
        state, questions = body.get("state"), body["questions"]
        check_state(state, self.limits)
        check_questions(questions, self.limits)
        body = object_body(body, ("questions",))
        return self._encode_one(state, questions, budget_args(body))

    def _encode_batch_request(self, body: Any) -> tuple:
        """(states, prepared, each state's rows) for a batch body that passes its checks (400 / 413 / 422)."""
        if not isinstance(body, dict) or "questions" not in body or "states" not in body:
            raise HTTPError(400, "request body must be an object with 'states' and 'questions' fields")
        states, questions = body["states"], body["questions"]
        if not isinstance(states, list) or not states:
            raise HTTPError(400, "'states' must be a non-empty list")
        if len(states) > self.limits.max_batch_states:
            raise HTTPError(413, "too many states in batch (%d > %d)" % (len(states), self.limits.max_batch_states))
        for s in states:
            check_state(s, self.limits)
        check_questions(questions, self.limits)
        body = object_body(body, ("states", "questions"))
        return (states, *self._encode_many(states, questions, budget_args(body)))

    async def _answer_one(self, body: Any, large: bool) -> JSONResponse:
        """The answer JSON for one state's body, with its X-Inference-Time-Ms header; a `large` body is checked
        and tokenized on the CPU pool, so it does not hold up the small requests beside it."""
        prepared, enc = await self._cpu(self._encode_request, body) if large else self._encode_request(body)
        if prepared is None:
            return JSONResponse(Codec.empty_result())
        t_inf = time.perf_counter()
        logits, act = await self._score(enc.rows)
        infer_ms = (time.perf_counter() - t_inf) * 1000.0
        result = self.codec.decode(prepared, enc, logits, act)
        return JSONResponse(result, headers={"X-Inference-Time-Ms": "%.2f" % infer_ms})

    async def _answer_states(self, prepared, encs) -> list[dict]:
        """One answer JSON per state; when the scorer fails the batch, each state is scored alone and a state that
        fails again gets `{"model", "error"}` (500 if every state fails, any other error as it is)."""
        try:
            logits, act = await self._score([r for e in encs for r in e.rows])
        except HTTPError as e:
            if e.status != 500 or len(encs) == 1:
                raise
        else:
            return await self._cpu(self._decode_many, prepared, encs, logits, act)
        outs = await asyncio.gather(*(self._score(e.rows) for e in encs), return_exceptions=True)
        failed = [isinstance(o, HTTPError) and o.status == 500 for o in outs]
        if all(failed):
            raise HTTPError(500, STATE_FAILED)
        other = next((o for o, f in zip(outs, failed) if isinstance(o, BaseException) and not f), None)
        if other is not None:
            raise other
        return [{"model": self.model_name, "error": STATE_FAILED} if f
                else self.codec.decode(prepared, enc, *out) for enc, out, f in zip(encs, outs, failed)]

    async def _answer_batch(self, body: Any, large: bool) -> JSONResponse:
        """One answer JSON per state of a batch body (an error entry for a state the scorer failed on), with
        the answered states' total usage; checked and tokenized on the CPU pool whatever its size."""
        states, prepared, encs = await self._cpu(self._encode_batch_request, body)
        if prepared is None:
            results = [Codec.empty_result() for _ in states]
        else:
            results = await self._answer_states(prepared, encs)
        answered = [r for r in results if "usage" in r]
        total = {"input_tokens": sum(r["usage"]["input_tokens"] for r in answered),
                 "output_tokens": sum(r["usage"]["output_tokens"] for r in answered)}
        return JSONResponse({"model": self.model_name, "results": results, "total_usage": total})

    # -- routes -------------------------------------------------------------------------------
    @app.post("/v1/systemone", openapi_extra=BODY_DOC, response_model=None,
              responses={200: {"model": SystemOneResponse, "description": "the answer JSON"}, **SCORE_ERRORS},
              summary="Answer questions about one state (upstream Laya/Jev wire format)")
    async def systemone(self, request: Request):
        """`{"state", "questions", "model"?, "max_len"?, "head_max_len"?}` -> `{"model", "answers", "usage"}`."""
        return await self._handle(ROUTES[0], request, self._answer_one)

    @app.post("/v1/systemone/batch", openapi_extra=BATCH_DOC, response_model=None,
              responses={200: {"model": BatchResponse, "description": "one answer JSON per state"}, **SCORE_ERRORS},
              summary="Answer one question set about many states")
    async def systemone_batch(self, request: Request):
        """`{"states": [...], "questions", "model"?}` -> `{"model", "results": [...], "total_usage"}`."""
        return await self._handle(ROUTES[1], request, self._answer_batch)

    @app.get("/health", summary="Liveness: the ingress process answers", response_model=None,
             responses={200: {"model": HealthResponse, "description": "the ingress runs"}})
    async def health(self) -> dict:
        """Always `{"status": "ok"}` while the ingress runs."""
        return {"status": "ok"}

    async def _ask_scorer(self, method) -> dict:
        """`method.remote()`'s answer (a scorer replica's stats or info); 503 + Retry-After if none answers in 5 s."""
        resp = method.remote()
        try:
            return await asyncio.wait_for(resp, 5.0)
        except Exception:  # noqa: BLE001 - no replica yet, saturated or timed out
            resp.cancel()
            raise HTTPError(503, "scorer unavailable, try again later", {"Retry-After": str(RETRY_AFTER_S)}) from None

    @app.get("/stats", summary="Batching counters of one scorer replica and this ingress replica's coalescing",
             response_model=None, responses={200: {"model": StatsResponse, "description": "the counters"},
                                             **error_docs(401, 503)})
    async def stats(self, request: Request):
        """The counters of whichever scorer replica answers (requests, batches, requests-per-batch histogram,
        waits, forward seconds) and, under `ingress`, this ingress replica's scorer calls and the requests they
        carried. Same bearer rule as the scoring routes."""
        self.auth.require(request)
        out = await self._ask_scorer(self.scorer.stats)
        out["ingress"] = dict(self._call_counters(), ray_serve=serve_request_path())
        return out

    @app.get("/info", summary="What this service runs: checkpoints, backend, precision, limits, batching, versions",
             response_model=None, responses={200: {"model": InfoResponse, "description": "the facts"},
                                             **error_docs(401, 503)})
    async def server_info(self, request: Request):
        """The checkpoint(s) served (name, content hash, backend, dtype, device, token lengths), this ingress's
        limits, the batching policy and budget, and the versions of laya-fleet, torch, ray and tilelang. Scorer
        facts come from whichever scorer replica answers (in-process when fused); 503 if none does in 5 s.
        Same bearer rule as the scoring routes."""
        self.auth.require(request)
        s = await self._ask_scorer(self.scorer.info)
        return {"topology": self.topology,
                "checkpoints": [{"name": s["checkpoint"], "hash": s["checkpoint_hash"], "model": self.model_name,
                                 "backend": s["backend"], "dtype": s["dtype"], "device": s["device"],
                                 "max_len": s["max_len"], "head_max_len": s["head_max_len"]}],
                "limits": self.limits.model_dump(),
                "batching": dict(s["policy"], budget=s["budget"]),
                "versions": self._versions}

    def _call_counters(self) -> dict[str, int]:
        """This replica's scorer calls, the requests they carried, and requests waiting for or in a call."""
        c = self._calls
        return {"scorer_calls": c.calls, "requests": c.requests, "waiting": c.waiting, "inflight": c.inflight}

    @app.get("/ready", summary="Readiness: 200 once a warm scorer replica answers, else 503", response_model=None,
             responses={200: {"model": ReadyResponse, "description": "ready"},
                        503: {"model": ReadyResponse, "description": "`{\"ready\": false}`, with Retry-After"}})
    async def ready(self):
        """200 `{"ready": true, ...}` when a scorer replica is warm; 503 `{"ready": false}` otherwise."""
        BackPressureError = self._err.BackPressureError

        resp = self.scorer.stats.remote()
        try:
            stats = await asyncio.wait_for(resp, 2.0)
        except BackPressureError:  # replicas exist and are saturated: still ready
            return {"ready": True, "busy": True}
        except Exception:  # noqa: BLE001 - timeout or no replica yet
            resp.cancel()
            if time.monotonic() - self._last_score_ok < 5.0:
                return {"ready": True, "busy": True}
            return JSONResponse({"ready": False}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"ready": True, "budget": stats.get("budget")}

    # HEAD answers as GET does, without the body (the HTTP server drops it); FastAPI routes take only the
    # methods they name
    for _path, _endpoint in (("/health", health), ("/ready", ready), ("/stats", stats), ("/info", server_info)):
        app.head(_path, include_in_schema=False, response_model=None)(_endpoint)
    del _path, _endpoint


