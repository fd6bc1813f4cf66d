"""The serving floor: our topology (proxy -> FastAPI ingress -> DeploymentHandle -> scorer) doing no work.

`bench/serve_load.py --floor` runs it on the same machine, same ports and same load as the real service,
so the table shows what Ray Serve itself costs per request there: the real service can only be slower.
The ingress parses the JSON body and makes one `score_many` handle call per request (no coalescing, no
tokenizer); the scorer answers a zero logit per row of a fixed three-row request.

    serve run with import_path bench.serve_floor_app:build_floor  (serve_load.py writes the config)
"""


import json

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve

floor_app = FastAPI()


@serve.deployment(name="Scorer", max_ongoing_requests=512)
class NullScorer:
    """Answers every request with zeros at once."""

    async def score_many(self, requests: list) -> list:
        return [(np.zeros((len(r), 4), np.float32), np.zeros(len(r), np.float32)) for r in requests]

    def stats(self) -> dict:
        return {"budget": 0}


@serve.deployment(name="Ingress", max_ongoing_requests=256)
@serve.ingress(floor_app)
class NullIngress:
    """Reads and parses the body, makes one scorer call, answers a small JSON object."""

    def __init__(self, scorer):
        self.scorer = scorer

    @floor_app.post("/v1/systemone")
    async def systemone(self, request: Request):
        body = json.loads(await request.body())
        rows = [[0] * 8 for _ in body.get("questions", {}) or [0]]
        (logits, _act), = await self.scorer.score_many.remote([rows])
        return JSONResponse({"answers": {}, "rows": int(logits.shape[0])})

    @floor_app.get("/ready")
    async def ready(self):
        return {"ready": True}


def build_floor(args: dict | None = None):
    """The floor application (ingress replicas are set in the config's deployments block)."""
    return NullIngress.bind(NullScorer.bind())


class SkipForward:
    """A scorer backend wrapper that returns zeros instead of running the model (app arg
    `backend_wrapper: bench.serve_floor_app:SkipForward`): the whole laya-fleet request path minus the
    forward, to split a request's time into serving overhead and model time. Diagnostic only."""

    def __init__(self, backend, engine):
        self.inner = backend

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, rows):
        k = max(len(r.markers) for r in rows)
        return np.zeros((len(rows), k), np.float32), np.full(len(rows), 0.5, np.float32)
