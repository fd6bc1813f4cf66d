"""The HTTP ingress deployment (CPU): upstream Laya/Jev wire format in, answer JSON out.

Per request: bearer check (auth.py), capped body read, JSON, shape and size checks (request_checks.py),
the body's controls and its routing to one of the served checkpoints (answering.py), question validation and
tokenization with that checkpoint's weightless codec (model/codec.py), one call to that checkpoint's scorer
deployment with the rows, shared with concurrent requests (served.py, coalescer.py), then decoding; a large
body is checked and tokenized on a thread pool, off the event loop. Error mapping: malformed JSON / missing fields
400, bad bearer 401, over a size limit 413, a body not declared JSON 415, invalid question or control 422,
overload 503 with Retry-After (also a scaled-to-zero checkpoint still warming up at the deadline), past the
deadline 504, anything else 500 with a fixed message; in a batch, a state the scorer fails on gets an error
entry of its own. No response ever carries a traceback or a file path.
"""

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.codec import Codec

from . import gc_pauses, metrics, ray_compat
from .answering import Answering
from .auth import BearerAuth
from .checkpoints import deployment_name
from .health import LIVENESS_ONLY, ReplicaWatch, health_payload
from .http_limits import HeaderLimits
from .request_checks import HTTPError, read_json
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
from .served import RETRY_AFTER_S, ServedCheckpoint
from .service_info import package_versions, serve_request_path

log = logging.getLogger(__name__)

JEV_STRICT_ENV = "LAYA_JEV_STRICT"
SMALL_BODY_BYTES = 8 * 1024  # bodies up to this are checked and tokenized on the event loop (no thread hop)
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


app.add_middleware(HeaderLimits)  # 431 past 8 KiB or 100 headers, on every path into a replica (http_limits.py)


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


def _timing(infer_ms: float) -> dict[str, str]:
    """Upstream's timing headers for an answer whose scoring took `infer_ms`."""
    return {"Server-Timing": "inference;dur=%.2f" % infer_ms, "X-Inference-Time-Ms": "%.2f" % infer_ms}


def _app_name() -> str | None:
    try:
        return serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - constructed outside a Serve replica
        return None


@serve.deployment(name="Ingress", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.5})
@serve.ingress(app)
class Ingress:
    """FastAPI ingress: validates, routes and tokenizes on CPU, scores through the routed checkpoint's scorer
    handle, decodes. `scorer` / `checkpoint` are the default checkpoint's (served as `default`); `others`
    maps each other served name to `{"checkpoint": directory, "scorer": handle}`; `routing_default` and
    `auto_task` go to the router (answering.py); `scorer_backend` (the scorers' backend, as far as the builder
    can tell) bounds the tokens of a row."""

    topology = "split"

    def __init__(self, scorer, checkpoint: str, limits: dict | None = None, api_key_env: str | None = None,
                 docs: bool = True, cpu_threads: int = 2, max_inflight_calls: int = 4,
                 max_call_tokens: int = 65536, default: str = "english", others: dict | None = None,
                 device_preference: str = "cpu", routing_default: str | None = None, auto_task: bool = False,
                 scorer_backend: str = "eager"):
        ray_compat.loopback_replica_grpc()  # before Serve starts this replica's gRPC server (a loopback Ray)
        t0 = time.perf_counter()
        ray_compat.check()  # a Ray without the APIs used here fails now, not on the first request
        self._err = ray_compat.errors()  # resolved once: the scorer-call path only reads them
        self.limits = Limits.model_validate(limits or {})
        self.auth = BearerAuth(api_key_env)
        self.docs = docs is not False and not self.auth  # as upstream: never behind a key
        if not self.docs:
            _hide_docs(app)
        self._versions = package_versions()
        self._pool = ThreadPoolExecutor(max(1, int(cpu_threads)), thread_name_prefix="laya-ingress")
        self._watch_pool = ThreadPoolExecutor(1, thread_name_prefix="laya-replicas")
        self.watch = ReplicaWatch(_app_name(), lambda fn: asyncio.get_running_loop().run_in_executor(
            self._watch_pool, fn))
        self.deployments = {name: deployment_name(name, default) for name in [default, *(others or {})]}
        self._served_kw = {"backend": scorer_backend, "max_inflight": max_inflight_calls,
                           "max_call_tokens": max_call_tokens}
        served = {default: self._served(default, checkpoint, scorer)}
        for name, o in (others or {}).items():
            served[name] = self._served(name, o["checkpoint"], o["scorer"])
        self.served = served
        self.default = served[default]
        self.scorer, self.codec, self.model_name = self.default.scorer, self.default.codec, self.default.model_name
        # upstream's LAYA_JEV_STRICT, read once at start (upstream reads it per request)
        strict = os.environ.get(JEV_STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        self.answering = Answering(served, self.limits, routing_default=routing_default, auto_task=auto_task,
                                   strict=strict)
        self.answering.router.warm()  # the language classifier (about 2 s), before traffic rather than on it
        self.device_preference = device_preference
        self._devices: dict[str, str] = {}
        self._m = {n: metrics.make(n, checkpoint=metrics.checkpoint_label(checkpoint)) for n in (
            "laya_fleet_requests", "laya_fleet_request_duration_seconds", "laya_fleet_ingress_warmup_seconds")}
        warm_s = time.perf_counter() - t0
        self._gauges = metrics.Refresher(lambda: self._m["laya_fleet_ingress_warmup_seconds"].set(warm_s))
        self._m["laya_fleet_ingress_warmup_seconds"].set(warm_s)
        gc_pauses.watch()
        log.info("ingress ready in %.2fs (checkpoints %s, auth %s)", time.perf_counter() - t0, list(served),
                 self.auth.source or "off")

    def _served(self, name: str, path: str, scorer) -> ServedCheckpoint:
        """The ingress side of served checkpoint `name` (the fused topology scores its default in-process)."""
        async def warm() -> bool:
            n = await self.watch.running(self.deployments[name])
            return n is None or n > 0

        return ServedCheckpoint(name, path, scorer, self.limits, self._err, is_warm=warm, **self._served_kw)

    # -- plumbing -----------------------------------------------------------------------------
    def _record(self, route: str, status: int, t0: float) -> None:
        tags = metrics.request_tags(route, status)
        self._m["laya_fleet_requests"].inc(tags=tags)
        self._m["laya_fleet_request_duration_seconds"].observe(time.perf_counter() - t0, tags=tags)

    async def _cpu(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _handle(self, route: str, request: Request, answer) -> JSONResponse:
        """`answer(body)`'s response for a request that passes the bearer check and whose body reads as JSON;
        the request is counted under `route` with its status."""
        t0 = time.perf_counter()
        status = 500
        metrics.routed_to()  # labelled with the default checkpoint until the body is routed
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

    async def _answer_one(self, body: Any, large: bool) -> JSONResponse:
        """The answer JSON for one state's body, with upstream's timing headers; a `large` body is checked,
        routed and tokenized on the CPU pool, so it does not hold up the small requests beside it."""
        plan = self.answering.plan_one
        controls, routing, served, prepared, enc = await self._cpu(plan, body) if large else plan(body)
        metrics.routed_to(served.path)
        t_inf = time.perf_counter()
        if prepared is None:
            result = Codec.empty_result()
        else:
            logits, act = await served.score(enc.rows)
            result = served.codec.decode(prepared, enc, logits, act)
        infer_ms = (time.perf_counter() - t_inf) * 1000.0
        return JSONResponse(self.answering.finish(result, controls, routing), headers=_timing(infer_ms))

    async def _answer_batch(self, body: Any, large: bool) -> JSONResponse:
        """One answer JSON per state of a batch body (an error entry for a state the scorer failed on), each
        state answered by the checkpoint it routes to, with the answered states' total usage and upstream's
        timing headers; checked, routed and tokenized on the CPU pool whatever its size."""
        states, controls, routes, groups = await self._cpu(self.answering.plan_batch, body)
        metrics.routed_to(*(g.served.path for g in groups))
        t_inf = time.perf_counter()
        results: list = [None] * len(states)
        outs = await asyncio.gather(*(g.served.answer_states(g.prepared, g.encs, self._cpu) for g in groups
                                      if g.prepared is not None))
        for g, out in zip([g for g in groups if g.prepared is not None], outs):
            for i, r in zip(g.index, out):
                results[i] = r
        infer_ms = (time.perf_counter() - t_inf) * 1000.0
        results = [self.answering.finish(Codec.empty_result() if r is None else r, controls, route)
                   for r, route in zip(results, routes)]
        answered = [r for r in results if "usage" in r]
        total = {"input_tokens": sum(r["usage"]["input_tokens"] for r in answered),
                 "output_tokens": sum(r["usage"]["output_tokens"] for r in answered)}
        return JSONResponse({"results": results, "total_usage": total}, headers=_timing(infer_ms))

    # -- routes -------------------------------------------------------------------------------
    @app.post("/v1/systemone", openapi_extra=BODY_DOC, response_model=None,
              responses={200: {"model": SystemOneResponse, "description": "the answer JSON"}, **SCORE_ERRORS},
              summary="Answer questions about one state (upstream Laya/Jev wire format)")
    async def systemone(self, request: Request):
        """`{"state", "questions", "model"?, "max_len"?, "head_max_len"?, "task"?, "lang"?, "lang_guess"?,
        "min_confidence"?}` -> `{"model", "answers", "usage", "routing"}`."""
        return await self._handle(ROUTES[0], request, self._answer_one)

    @app.post("/v1/systemone/batch", openapi_extra=BATCH_DOC, response_model=None,
              responses={200: {"model": BatchResponse, "description": "one answer JSON per state"}, **SCORE_ERRORS},
              summary="Answer one question set about many states")
    async def systemone_batch(self, request: Request):
        """`{"states": [...], "questions", "model"?, ...}` -> `{"results": [...], "total_usage"}`."""
        return await self._handle(ROUTES[1], request, self._answer_batch)

    @app.get("/health", summary="Liveness, and to an authorized caller the loaded checkpoints and devices",
             response_model=None, responses={200: {"model": HealthResponse, "description": "the ingress runs"}})
    async def health(self, request: Request) -> dict:
        """`{"status": "ok"}` to an unauthenticated caller when a key is set; otherwise upstream's full payload
        (health.py): `loaded`, `revisions`, `device`, `device_is_preference`, `checkpoint_devices`,
        `cpu_fallbacks`."""
        if not self.auth.authorized(request):
            return dict(LIVENESS_ONLY)
        return await health_payload(self.served, self.deployments, self.watch, self._devices,
                                    self.device_preference, self._in_process())

    def _in_process(self) -> str | None:
        """The checkpoint this replica scores itself (None: every checkpoint through a handle)."""
        return None

    async def _ask_scorer(self, method, timeout: float = 5.0) -> dict:
        """`method.remote()`'s answer (a scorer replica's stats or info); 503 + Retry-After if none answers in
        `timeout` seconds."""
        resp = method.remote()
        try:
            return await asyncio.wait_for(resp, timeout)
        except Exception:  # noqa: BLE001 - no replica yet, saturated or timed out
            resp.cancel()
            raise HTTPError(503, "scorer unavailable, try again later", {"Retry-After": str(RETRY_AFTER_S)}) from None

    @app.get("/stats", summary="Batching counters of one scorer replica and this ingress replica's coalescing",
             response_model=None, responses={200: {"model": StatsResponse, "description": "the counters"},
                                             **error_docs(401, 503)})
    async def stats(self, request: Request):
        """The counters of whichever replica of the default checkpoint's scorer answers (requests, batches,
        requests-per-batch histogram, waits, forward seconds) and, under `ingress`, this ingress replica's
        scorer calls and the requests they carried, over every checkpoint. Same bearer rule as the scoring
        routes."""
        self.auth.require(request)
        out = await self._ask_scorer(self.scorer.stats)
        out["ingress"] = dict(self._call_counters(), ray_serve=serve_request_path(), gc=gc_pauses.watch().snapshot())
        return out

    @app.get("/info", summary="What this service runs: checkpoints, backend, precision, limits, batching, versions",
             response_model=None, responses={200: {"model": InfoResponse, "description": "the facts"},
                                             **error_docs(401, 503)})
    async def server_info(self, request: Request):
        """Each checkpoint served (served name, directory name, content hash, backend, dtype, device, token
        lengths; a scaled-to-zero one only `served_as` and `loaded: false`), this ingress's limits, the default
        checkpoint's batching policy and budget, and the versions of laya-fleet, torch, ray and tilelang.
        Scorer facts come from whichever replica answers (in-process when fused); 503 if the default's does not
        in 5 s. Same bearer rule as the scoring routes."""
        self.auth.require(request)
        s = await self._ask_scorer(self.scorer.info)
        entries = [self._info_entry(self.default, s)]
        for served in list(self.served.values())[1:]:
            try:
                other = await self._ask_scorer(served.scorer.info, 2.0) if await served.is_warm() else None
            except HTTPError:
                other = None
            entries.append(self._info_entry(served, other))
        return {"topology": self.topology, "checkpoints": entries, "limits": self.limits.model_dump(),
                "batching": dict(s["policy"], budget=s["budget"]), "versions": self._versions}

    @staticmethod
    def _info_entry(served: ServedCheckpoint, s: dict | None) -> dict:
        if s is None:
            return {"served_as": served.name, "loaded": False}
        return {"served_as": served.name, "loaded": True, "name": s["checkpoint"], "hash": s["checkpoint_hash"],
                "model": served.model_name, "backend": s["backend"], "dtype": s["dtype"], "device": s["device"],
                "max_len": s["max_len"], "head_max_len": s["head_max_len"]}

    def _call_counters(self) -> dict[str, int]:
        """This replica's scorer calls, the requests they carried, and requests waiting for or in a call."""
        out: dict[str, int] = {}
        for served in self.served.values():
            for k, v in served.counters().items():
                out[k] = out.get(k, 0) + v
        return out

    @app.get("/ready", summary="Readiness: 200 once a warm replica of the default checkpoint's scorer answers",
             response_model=None, responses={200: {"model": ReadyResponse, "description": "ready"},
                                             503: {"model": ReadyResponse,
                                                   "description": "`{\"ready\": false}`, with Retry-After"}})
    async def ready(self):
        """200 `{"ready": true, ...}` when a replica of the default checkpoint's scorer is warm (a scaled-to-zero
        checkpoint does not make the service unready); 503 `{"ready": false}` otherwise."""
        BackPressureError = self._err.BackPressureError

        resp = self.scorer.stats.remote()
        try:
            stats = await asyncio.wait_for(resp, 2.0)
        except BackPressureError:  # replicas exist and are saturated: still ready
            return {"ready": True, "busy": True}
        except Exception:  # noqa: BLE001 - timeout or no replica yet
            resp.cancel()
            if time.monotonic() - self.default.last_ok < 5.0:
                return {"ready": True, "busy": True}
            return JSONResponse({"ready": False}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"ready": True, "budget": stats.get("budget")}

    # HEAD answers as GET does, without the body (the HTTP server drops it); FastAPI routes take only the
    # methods they name
    for _path, _endpoint in (("/health", health), ("/ready", ready), ("/stats", stats), ("/info", server_info)):
        app.head(_path, include_in_schema=False, response_model=None)(_endpoint)
    del _path, _endpoint
