"""Application metrics, exported through Ray Serve's metrics API (Prometheus names get a `ray_` prefix).

Serve adds the `deployment`, `replica` and `application` tags itself. Counters are exported as
`<name>_total`; histograms as `<name>_bucket` / `_sum` / `_count`.
"""

from __future__ import annotations

LATENCY_MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
WAIT_MS = [0.1, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000]
BATCH_REQUESTS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
BATCH_ROWS = [1, 4, 16, 64, 256, 1024, 4096]
BATCH_TOKENS = [64, 256, 1024, 4096, 8192, 16384, 32768, 65536, 131072]

# name -> (kind, description, tag keys, boundaries)
NAMES = {
    "laya_fleet_requests": ("counter", "HTTP requests by route and status code", ("route", "status"), None),
    "laya_fleet_request_latency_ms": ("histogram", "HTTP request latency inside the ingress (ms)",
                                      ("route",), LATENCY_MS),
    "laya_fleet_ingress_warmup_seconds": ("gauge", "Seconds the ingress spent loading its tokenizer", (), None),
    "laya_fleet_queue_wait_ms": ("histogram", "Time a request waited in the scorer queue before its batch ran (ms)",
                                 (), WAIT_MS),
    "laya_fleet_batch_requests": ("histogram", "Requests per scorer batch", (), BATCH_REQUESTS),
    "laya_fleet_batch_rows": ("histogram", "Rows per scorer batch", (), BATCH_ROWS),
    "laya_fleet_batch_tokens": ("histogram", "Tokens per scorer batch", (), BATCH_TOKENS),
    "laya_fleet_forward_ms": ("histogram", "Scorer batch forward time (ms)", (), LATENCY_MS),
    "laya_fleet_batch_fallbacks": ("counter", "Batches that failed and were retried one request at a time", (), None),
    "laya_fleet_scorer_errors": ("counter", "Scorer requests that failed after retries", (), None),
    "laya_fleet_oom_retries": ("counter", "Out-of-memory micro-batches that halved the token budget", (), None),
    "laya_fleet_queue_depth": ("gauge", "Requests waiting in the scorer queue", (), None),
    "laya_fleet_token_budget": ("gauge", "The scorer's current token budget per micro-batch", (), None),
    "laya_fleet_warmup_seconds": ("gauge", "Seconds the scorer spent loading and warming up", (), None),
}


def make(name: str):
    """The Serve metric object for one of `NAMES` (created in the replica process that records it)."""
    from ray.serve import metrics

    kind, desc, tags, bounds = NAMES[name]
    if kind == "counter":
        return metrics.Counter(name, description=desc, tag_keys=tags)
    if kind == "gauge":
        return metrics.Gauge(name, description=desc, tag_keys=tags)
    return metrics.Histogram(name, description=desc, boundaries=bounds, tag_keys=tags)


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
