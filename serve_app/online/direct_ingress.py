"""Ray Serve direct ingress: each Ingress replica serves HTTP itself, no proxy hop.

With `RAY_SERVE_ENABLE_DIRECT_INGRESS=1` in the Ingress replicas' environment (the app's
`runtime_env.env_vars`, or every node's `ray start` environment; Ray 2.60, experimental), every Ingress
replica, once constructed, listens on a port of its own taken from `RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT`..
`MAX` (30000..31000 by default; the controller's environment decides) and runs this app's FastAPI
routes in its own process: a request skips the proxy actor and the proxy -> replica call (with its second
call back for the body; see BENCHMARKS.md, "HTTP with direct ingress"). The proxy on `http_options.port`
keeps working beside them. Backpressure (`max_queued_requests` -> 503 + Retry-After),
auth, limits and errors are the app's own and behave the same on either path.

A load balancer in front (Ray's HAProxy mode, `RAY_SERVE_ENABLE_HA_PROXY=1`, or any L4/L7 balancer)
spreads clients over the replicas' ports; `ingress_ports` finds them for a balancer's config or a
benchmark. Replicas draining on scale-down keep answering for
`RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S` (30 s) so balancers can take them out first.
"""

from __future__ import annotations

import http.client
import os
import time
import urllib.request

ENABLE_ENV = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"
MAX_PORT_ENV = "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"


def port_range() -> tuple[int, int]:
    """The HTTP port range Serve allocates direct-ingress ports from (this process's environment)."""
    return int(os.environ.get(MIN_PORT_ENV, "30000")), int(os.environ.get(MAX_PORT_ENV, "31000"))


def _answers(host: str, port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen("http://%s:%d%s" % (host, port, path), timeout=2) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):  # not listening, or another server (gRPC) on that port
        return False


def ingress_ports(expect: int, host: str = "127.0.0.1", timeout: float = 120.0, scan: int = 64,
                  path: str = "/ready", ports: tuple[int, int] | None = None) -> list[int]:
    """The direct-ingress ports on `host` whose replica answers `path` with 200, once `expect` of them do.

    Scans the first `scan` ports of the range (`ports`, else this process's environment; Serve hands them
    out from the bottom). Another Serve instance on the same host with the same range answers there too:
    give each instance its own range. Raises TimeoutError naming what it found if fewer than `expect`
    answer within `timeout` seconds.
    """
    lo, hi = ports or port_range()
    ports = range(lo, min(hi, lo + scan - 1) + 1)
    found: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in ports if _answers(host, p, path)]
        if len(found) >= expect:
            return found
        time.sleep(1.0)
    raise TimeoutError("%d direct-ingress port(s) answered %s on %s in %d..%d within %.0fs (expected %d): %s"
                       % (len(found), path, host, ports[0], ports[-1], timeout, expect, found))


__all__ = ["ENABLE_ENV", "MIN_PORT_ENV", "MAX_PORT_ENV", "port_range", "ingress_ports"]
