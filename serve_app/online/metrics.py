"""Application metrics in Prometheus base units (seconds, totals), exported through Ray Serve's metrics API.

`NAMES` declares every metric: kind, description, label keys and histogram buckets. Ray exports a metric as
`ray_<name>`: counters as `ray_<name>_total`, histograms as `ray_<name>_bucket` / `_sum` / `_count`, gauges
as `ray_<name>`; `exported` gives those names. Serve adds the `deployment`, `replica` and `application` labels
itself. Labels: `checkpoint` (the checkpoint directory's basename, as `/info` names it), `backend` (the
forward the scorer replica resolved: eager, fast, compile, aot), and on request metrics `route` and `status`.

A request metric's `checkpoint` is the checkpoint the request was routed to, which the ingress learns only
mid-request: `routed_to` notes it in the handling asyncio task's context and `request_tags` reads it back when
the request is recorded. A batch whose states went to several checkpoints is labelled with their labels joined
by "," in sorted order; a request refused before it was routed carries the replica's default checkpoint.
"""

from __future__ import annotations

import functools
import os
from contextvars import ContextVar

DURATION_S = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]
WAIT_S = [0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 5]
BATCH_REQUESTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
BATCH_ROWS = [1, 4, 16, 64, 256, 1024, 4096]
BATCH_TOKENS = [64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072]

REQUEST = ("checkpoint", "route", "status")
SCORER = ("checkpoint", "backend")
SERVE_LABELS = ("deployment", "replica", "application")  # added by Serve to every metric

# name -> (kind, description, label keys, histogram buckets)
NAMES = {
    "laya_fleet_requests": ("counter", "HTTP requests by checkpoint routed to, route and status code", REQUEST,
                            None),
    "laya_fleet_request_duration_seconds": ("histogram", "HTTP request duration inside the ingress",
                                            REQUEST, DURATION_S),
    "laya_fleet_ingress_warmup_seconds": ("gauge", "Seconds the ingress spent loading its tokenizers and "
                                          "language classifier", ("checkpoint",), None),
    "laya_fleet_queue_wait_seconds": ("histogram", "Time a request waited in the scorer queue before its batch ran",
                                      SCORER, WAIT_S),
    "laya_fleet_batch_requests": ("histogram", "Requests per scorer batch", SCORER, BATCH_REQUESTS),
    "laya_fleet_batch_rows": ("histogram", "Rows per scorer batch", SCORER, BATCH_ROWS),
    "laya_fleet_batch_tokens": ("histogram", "Tokens per scorer batch", SCORER, BATCH_TOKENS),
    "laya_fleet_forward_seconds": ("histogram", "Scorer batch forward time", SCORER, DURATION_S),
    "laya_fleet_batch_fallbacks": ("counter", "Batches that failed and were retried one request at a time",
                                   SCORER, None),
    "laya_fleet_scorer_errors": ("counter", "Scorer requests that failed after retries", SCORER, None),
    "laya_fleet_oom_retries": ("counter", "Out-of-memory micro-batches that halved the token budget", SCORER, None),
    "laya_fleet_queue_depth": ("gauge", "Requests waiting in the scorer queue", SCORER, None),
    "laya_fleet_token_budget": ("gauge", "The scorer's current token budget per micro-batch", SCORER, None),
    "laya_fleet_warmup_seconds": ("gauge", "Seconds the scorer spent loading and warming up", SCORER, None),
}

_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported(name: str) -> tuple[str, ...]:
    """The series names Ray's Prometheus endpoint exports for one of `NAMES` (`ray_` prefix, kind's suffixes)."""
    return tuple("ray_" + name + s for s in _SUFFIXES[NAMES[name][0]])


@functools.lru_cache(maxsize=256)
def checkpoint_label(path: str) -> str:
    """The `checkpoint` label of a checkpoint directory: its basename (what `/info` calls its name)."""
    return os.path.basename(os.path.normpath(path))


# the `checkpoint` label of the request the current asyncio task handles, once routed (None: not routed)
_ROUTED: ContextVar[str | None] = ContextVar("laya_fleet_routed_checkpoint", default=None)


def routed_to(*paths: str) -> None:
    """Note the checkpoint directories the current request's states were routed to, for `request_tags`; no
    paths clears the note (a request starting)."""
    _ROUTED.set(",".join(sorted({checkpoint_label(p) for p in paths})) or None)


def request_tags(route: str, status: int) -> dict[str, str]:
    """The per-record tags of a request metric: `route`, `status` and, once `routed_to` named it, the
    `checkpoint` the request went to (else the metric's default tag, the replica's default checkpoint)."""
    tags = {"route": route, "status": str(status)}
    routed = _ROUTED.get()
    if routed:
        tags["checkpoint"] = routed
    return tags


def make(name: str, **labels: str):
    """The Serve metric object for one of `NAMES`, with `labels` as its default tags (created in the replica
    process that records it; the remaining label keys are given per record)."""
    from ray.serve import metrics

    kind, desc, keys, bounds = NAMES[name]
    if kind == "counter":
        m = metrics.Counter(name, description=desc, tag_keys=keys)
    elif kind == "gauge":
        m = metrics.Gauge(name, description=desc, tag_keys=keys)
    else:
        m = metrics.Histogram(name, description=desc, boundaries=bounds, tag_keys=keys)
    if labels:
        m.set_default_tags(labels)
    return m


class Refresher:
    """Re-sets gauges every `interval_s` on a daemon thread.

    Ray's metrics agent drops a gauge series that has not been reported for a few export intervals, so
    a value set once (warm-up seconds) or rarely (token budget when idle) would vanish from Prometheus
    while the replica is alive.
    """

    def __init__(self, fn, interval_s: float = 5.0):
        import threading

        self._fn, self._interval = fn, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="laya-gauges", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import logging

        while not self._stop.wait(self._interval):
            try:
                self._fn()
            except Exception:  # noqa: BLE001 - metrics must never take a replica down
                logging.getLogger(__name__).debug("gauge refresh failed", exc_info=True)

    def stop(self) -> None:
        """Stop refreshing."""
        self._stop.set()
