"""The HTTP ingress deployment (CPU): upstream Laya/Jev wire format in, answer JSON out.

Per request: bearer check, capped body read, JSON and shape checks, size limits, question validation
and tokenization (here, with the checkpoint's tokenizer and no weights), one call to the scorer
deployment with the rows, then decoding. Error mapping: malformed JSON / missing fields 400, bad
bearer 401, over a size limit 413, invalid question 422, overload 503 with Retry-After, anything
else 500 with a fixed message. No response ever carries a traceback or a file path.
"""

import asyncio
import hmac
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.decode import empty_result
from model.questions import serialize_state

from . import metrics, ray_compat
from .coalesce import CallCoalescer
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

log = logging.getLogger(__name__)

RETRY_AFTER_S = 1
ROUTES = ("/v1/systemone", "/v1/systemone/batch")
VERSIONED = ("laya-fleet", "torch", "ray", "tilelang")  # the distributions `/info` reports


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


def state_chars(state: Any) -> int:
    """Characters of the text the model reads for `state` (JSON for dicts and lists)."""
    try:
        return len(serialize_state(state))
    except (TypeError, ValueError):
        raise HTTPError(400, "'state' must be a string or JSON object/array") from None


def check_questions(questions: Any, limits: Limits) -> None:
    """400 if `questions` is not an object; 413 over the question and option limits."""
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
    if total > limits.max_total_options:
        raise HTTPError(413, "too many answer options across questions (%d > %d)"
                        % (total, limits.max_total_options))


def check_state(state: Any, limits: Limits) -> int:
    """400 for a missing state, 413 over the character limit; returns the state's length."""
    if state is None:
        raise HTTPError(400, "'state' is required")
    n = state_chars(state)
    if n > limits.max_state_chars:
        raise HTTPError(413, "state too large (%d > %d chars)" % (n, limits.max_state_chars))
    return n


def budget_args(body: dict) -> dict[str, int]:
    """`max_len` / `head_max_len` from the body (integers only; range checked by the engine)."""
    out = {}
    for key in ("max_len", "head_max_len"):
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise HTTPError(422, "%s must be a positive integer, got %s" % (key, type(v).__name__))
        out[key] = v
    return out


# the OpenAPI document describes the wire format with serve_app/schemas.py's models; the handlers below read the
# raw body and check it themselves, so statuses and error texts stay upstream's
app = DocumentedApp(
    title="laya-fleet",
    summary="Laya typed-decision answers over the Jev /v1/systemone protocol, on Ray Serve",
    description="`POST /v1/systemone` answers `choice` / `score` / `noul` questions about one state; "
                "`POST /v1/systemone/batch` answers one question set over many states. Errors are "
                "`{\"detail\": ...}` with 400 (malformed JSON or missing fields), 401 (bearer), 413 (limits), "
                "422 (invalid question), 503 + Retry-After (overloaded or not ready), 500 (internal).",
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


def package_versions(names: tuple[str, ...] = VERSIONED) -> dict[str, str | None]:
    """The installed version of each distribution in `names` (None for one not installed)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def serve_request_path() -> dict[str, bool]:
    """How Ray Serve runs this replica's request path, as its environment set it (the app's runtime_env in
    configs/*.yaml): gRPC calls between deployments, user code and the handle's router on the replica's own
    event loop, direct ingress."""
    c = ray_compat.serve_constants()
    return {"grpc_between_deployments": bool(c.RAY_SERVE_USE_GRPC_BY_DEFAULT),
            "user_code_on_replica_loop": not c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
            "router_on_replica_loop": not c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
            "direct_ingress": bool(c.RAY_SERVE_ENABLE_DIRECT_INGRESS)}


@serve.deployment(name="Ingress", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.5})
@serve.ingress(app)
class Ingress:
    """FastAPI ingress: validates and tokenizes on CPU, scores through the scorer handle, decodes."""

    topology = "split"

    def __init__(self, scorer, checkpoint: str, limits: dict | None = None, api_key_env: str | None = None,
                 docs: bool = True, cpu_threads: int = 2, max_inflight_calls: int = 4,
                 max_call_tokens: int = 65536):
        from .codec import load_codec

        t0 = time.perf_counter()
        ray_compat.check()  # a Ray without the APIs used here fails now, not on the first request
        self._err = ray_compat.errors()  # resolved once: the scorer-call path only reads them
        self.scorer = scorer
        self.limits = Limits.model_validate(limits or {})
        self._expected_auth: bytes | None = None
        if api_key_env:
            key = os.environ.get(api_key_env, "")
            if not key.strip():
                # a configured but missing key must not silently open the service
                raise RuntimeError("api_key_env=%r is set but that environment variable is empty or missing"
                                   % api_key_env)
            self._expected_auth = ("Bearer " + key).encode("utf-8", "surrogateescape")  # the bytes a client sends
        self.docs = bool(docs)
        if not self.docs:
            _hide_docs(app)
        self.codec = load_codec(checkpoint)
        self.model_name = empty_result()["model"]
        self._versions = package_versions()
        self._pool = ThreadPoolExecutor(max(1, int(cpu_threads)), thread_name_prefix="laya-ingress")
        self._calls = CallCoalescer(self._score_many, max_inflight=max_inflight_calls,
                                    max_call_tokens=max_call_tokens)
        self._last_score_ok = 0.0
        self._m = {n: metrics.make(n) for n in ("laya_fleet_requests", "laya_fleet_request_latency_ms",
                                                 "laya_fleet_ingress_warmup_seconds")}
        warm_s = time.perf_counter() - t0
        self._gauges = metrics.Refresher(lambda: self._m["laya_fleet_ingress_warmup_seconds"].set(warm_s))
        self._m["laya_fleet_ingress_warmup_seconds"].set(warm_s)
        log.info("ingress ready in %.2fs (auth %s)", time.perf_counter() - t0,
                 "on" if self._expected_auth else "off")

    # -- plumbing -----------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if self._expected_auth is None:
            return True
        # Starlette decodes header bytes as latin-1, so encoding back to latin-1 recovers exactly the bytes on
        # the wire (never raises); a UTF-8 key sent as UTF-8 matches, anything else is simply unequal.
        supplied = (request.headers.get("authorization") or "").encode("latin-1")
        return hmac.compare_digest(supplied, self._expected_auth)

    def _require_bearer(self, request: Request) -> None:
        """401 with WWW-Authenticate unless the request carries the configured bearer key."""
        if not self._authorized(request):
            raise HTTPError(401, "invalid or missing bearer token", {"WWW-Authenticate": "Bearer"})

    async def _read_json(self, request: Request) -> Any:
        cap = self.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared:
            try:
                if int(declared) > cap:
                    raise HTTPError(413, "request body too large (limit %d bytes)" % cap)
            except ValueError:
                raise HTTPError(400, "invalid Content-Length") from None

        async def collect() -> bytes:
            total, chunks = 0, []
            async for chunk in request.stream():  # chunked or understated lengths are capped here too
                total += len(chunk)
                if total > cap:
                    raise HTTPError(413, "request body too large (limit %d bytes)" % cap)
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(collect(), self.limits.body_read_timeout_s)
        except TimeoutError:
            raise HTTPError(408, "request body was not received in time") from None
        try:
            if len(raw) > 64 * 1024:  # a multi-MiB parse would stall every other request on this loop
                return await self._cpu(json.loads, raw)
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise HTTPError(400, "request body must be valid JSON") from None

    def _record(self, route: str, status: int, t0: float) -> None:
        tags = {"route": route}
        self._m["laya_fleet_requests"].inc(tags={"route": route, "status": str(status)})
        self._m["laya_fleet_request_latency_ms"].observe((time.perf_counter() - t0) * 1000.0, tags=tags)

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

    def _prepare(self, questions, budget):
        """`codec.prepare`: remembered per question set and budget by the Engine itself."""
        return self.codec.prepare(questions, **budget)

    # -- the work (CPU, off the event loop for large requests) --------------------------------
    def _encode_one(self, state, questions, budget):
        try:
            prepared = self._prepare(questions, budget)
            if not prepared:
                return None, None
            return prepared, self.codec.encode(state, prepared)
        except (ValueError, TypeError) as e:
            raise HTTPError(422, str(e)) from None

    def _encode_many(self, states, questions, budget):
        try:
            prepared = self._prepare(questions, budget)
            if not prepared:
                return None, None
            return prepared, self.codec.encode_many(states, prepared)
        except (ValueError, TypeError) as e:
            raise HTTPError(422, str(e)) from None

    def _decode_many(self, prepared, encs, logits, act) -> list[dict]:
        out, pos = [], 0
        for enc in encs:
            n = len(enc.rows)
            out.append(self.codec.decode(prepared, enc, logits[pos:pos + n], act[pos:pos + n]))
            pos += n
        return out

    @staticmethod
    def _object_body(body: Any, required: tuple[str, ...]) -> dict:
        if not isinstance(body, dict) or any(k not in body for k in required):
            raise HTTPError(400, "request body must be an object with %s"
                            % " and ".join("'%s'" % k for k in required))
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise HTTPError(400, "'model' must be a string")
        if _has_lone_surrogate(body):
            raise HTTPError(400, "request body contains an unpaired surrogate escape")
        return body

    # -- routes -------------------------------------------------------------------------------
    @app.post("/v1/systemone", openapi_extra=BODY_DOC, response_model=None,
              responses={200: {"model": SystemOneResponse, "description": "the answer JSON"}, **SCORE_ERRORS},
              summary="Answer questions about one state (upstream Laya/Jev wire format)")
    async def systemone(self, request: Request):
        """`{"state", "questions", "model"?, "max_len"?, "head_max_len"?}` -> `{"model", "answers", "usage"}`."""
        t0 = time.perf_counter()
        status = 500
        try:
            self._require_bearer(request)
            body = await self._read_json(request)
            if not isinstance(body, dict) or "questions" not in body:
                raise HTTPError(400, "request body must be an object with a 'questions' field")
            state, questions = body.get("state"), body["questions"]
            n_chars = check_state(state, self.limits)
            check_questions(questions, self.limits)
            body = self._object_body(body, ("questions",))
            budget = budget_args(body)
            if n_chars <= 4096 and len(questions) <= 16:
                prepared, enc = self._encode_one(state, questions, budget)
            else:
                prepared, enc = await self._cpu(self._encode_one, state, questions, budget)
            if prepared is None:
                result = empty_result()
            else:
                t_inf = time.perf_counter()
                logits, act = await self._score(enc.rows)
                infer_ms = (time.perf_counter() - t_inf) * 1000.0
                result = self.codec.decode(prepared, enc, logits, act)
            status = 200
            headers = {} if prepared is None else {"X-Inference-Time-Ms": "%.2f" % infer_ms}
            return JSONResponse(result, headers=headers)
        except HTTPError as e:
            status = e.status
            raise
        finally:
            self._record(ROUTES[0], status, t0)

    @app.post("/v1/systemone/batch", openapi_extra=BATCH_DOC, response_model=None,
              responses={200: {"model": BatchResponse, "description": "one answer JSON per state"}, **SCORE_ERRORS},
              summary="Answer one question set about many states")
    async def systemone_batch(self, request: Request):
        """`{"states": [...], "questions", "model"?}` -> `{"model", "results": [...], "total_usage"}`."""
        t0 = time.perf_counter()
        status = 500
        try:
            self._require_bearer(request)
            body = await self._read_json(request)
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
            body = self._object_body(body, ("states", "questions"))
            budget = budget_args(body)
            prepared, encs = await self._cpu(self._encode_many, states, questions, budget)
            if prepared is None:
                results = [empty_result() for _ in states]
            else:
                rows = [r for e in encs for r in e.rows]
                logits, act = await self._score(rows)
                results = await self._cpu(self._decode_many, prepared, encs, logits, act)
            total = {"input_tokens": sum(r["usage"]["input_tokens"] for r in results),
                     "output_tokens": sum(r["usage"]["output_tokens"] for r in results)}
            status = 200
            return JSONResponse({"model": self.model_name, "results": results, "total_usage": total})
        except HTTPError as e:
            status = e.status
            raise
        finally:
            self._record(ROUTES[1], status, t0)

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
        self._require_bearer(request)
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
        self._require_bearer(request)
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


# -- topology "fused": the scorer inside the ingress replica ------------------------------------------------
class _LocalMethod:
    """`handle.method.remote(*args)` for an object in this process: an asyncio task on the running loop (it
    can be awaited, given a timeout and cancelled like a DeploymentResponse)."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            out = self.fn(*args)
            return (await out) if asyncio.iscoroutine(out) else out

        return asyncio.get_running_loop().create_task(call())


class LocalScorer:
    """The handle interface the ingress uses (`score_many`, `stats`, `info`), served by a scorer in this process."""

    def __init__(self, scorer):
        self.impl = scorer
        self.score_many = _LocalMethod(scorer.score_many)
        self.stats = _LocalMethod(scorer.stats)
        self.info = _LocalMethod(scorer.info)


@serve.deployment(name="Ingress", max_ongoing_requests=512, health_check_period_s=10,
                  graceful_shutdown_timeout_s=20)
class FusedIngress(Ingress.func_or_class):
    """The ingress with its scorer in the same replica (`topology: fused`): each replica (one per GPU, or
    several sharing one: configs/prod.yaml runs three) serves HTTP, tokenizes, batches and runs the model, so a
    request crosses no process after Serve's HTTP entry (on the CPU machine one request with the forward
    skipped: 1.1 ms fused, 2.6 ms split). The scorer is the same
    `ScorerDeployment` class as in the split topology, built here; this replica takes its `user_config`
    (`reconfigure`), health check and autoscaling metric. The price: tokenizing shares the replica's GIL with
    the forward thread, and HTTP handling scales with GPUs rather than with CPU replicas."""

    topology = "fused"

    async def __init__(self, scorer_kwargs: dict, checkpoint: str, **ingress_kwargs):
        from .scorer_deployment import ScorerDeployment

        ray_compat.check()  # before the scorer's warm-up
        self._local = ScorerDeployment.func_or_class(**scorer_kwargs)
        self._direct = {"scorer_calls": 0, "inflight": 0}
        await super().__init__(LocalScorer(self._local), checkpoint, **ingress_kwargs)

    async def _score(self, rows: list) -> tuple:
        """The in-process scorer's (logits, act) for one request's rows: straight into its token batcher, which
        batches concurrent requests itself (no call slots to share: nothing crosses a process here)."""
        self._direct["scorer_calls"] += 1
        self._direct["inflight"] += 1
        try:
            async with asyncio.timeout(self.limits.scorer_timeout_s):
                out = await self._local.score(rows)
        except TimeoutError:
            raise HTTPError(504, "scoring timed out") from None
        except Exception:  # noqa: BLE001 - this request failed in its batch (the scorer logged why)
            raise HTTPError(500, "inference failed") from None
        finally:
            self._direct["inflight"] -= 1
        self._last_score_ok = time.monotonic()
        return out

    def _call_counters(self) -> dict[str, int]:
        """Requests scored straight into this replica's batcher: each is one call and one request."""
        d = self._direct
        return {"scorer_calls": d["scorer_calls"], "requests": d["scorer_calls"], "waiting": 0,
                "inflight": d["inflight"]}

    def reconfigure(self, user_config: dict | None) -> None:
        """The scorer's batching policy, applied live (see `ScorerDeployment.reconfigure`)."""
        self._local.reconfigure(user_config)

    def check_health(self) -> None:
        """Unhealthy after a fatal device error in the scorer (Serve then replaces the replica)."""
        self._local.check_health()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """The scorer's `pending_requests` (serve_app/autoscale.py)."""
        return self._local.record_autoscaling_stats()

    def info(self) -> dict[str, Any]:
        """This replica's scorer facts, counters and GPU ids (`ScorerDeployment.info`), through its handle."""
        return self._local.info()

    async def __del__(self):  # pragma: no cover - replica shutdown: stop the scorer's batcher and forward thread
        await self._local.__del__()
