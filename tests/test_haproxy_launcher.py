"""serve_app/online/haproxy_launcher.py: the launcher Ray's HAProxy ingress runs (RAY_SERVE_HAPROXY_BINARY_PATH).

The config below is the shape Ray 2.60's template writes (global, defaults, the Prometheus frontend, the HTTP
frontend, a backend, the stats listener); the rewritten text is checked by the real HAProxy binary (`-c`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serve_app.online import haproxy_launcher as haproxy

RAY_CONFIG = """global
    stats socket {sock} mode 666 level admin expose-fd listeners
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    timeout http-keep-alive 90s
    balance leastconn
frontend prometheus
    bind :{metrics}
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
    no log
frontend http_frontend
    bind {host}:{http}
    acl is_http-laya path_beg /
    use_backend http-laya if is_http-laya
    default_backend default_backend
backend default_backend
    http-request return status 404
backend http-laya
    http-reuse always
    server SERVE_REPLICA_laya-Ingress-1 127.0.0.1:30000 check
listen stats
  bind *:{stats}
  stats enable
  stats uri /stats
"""


def _config(host: str, tmp_path) -> str:
    return RAY_CONFIG.format(sock=tmp_path / "admin.sock", metrics=19101, http=18000, stats=18404, host=host)


def _binds(text: str) -> list[str]:
    return [line.split()[1] for line in text.splitlines() if line.strip().startswith("bind ")]


def test_a_loopback_frontend_takes_the_stats_and_metrics_listeners_with_it(tmp_path):
    out = haproxy.rewrite(_config("127.0.0.1", tmp_path))
    assert sorted(_binds(out)) == ["127.0.0.1:18000", "127.0.0.1:18404", "127.0.0.1:19101"]
    assert "    timeout http-request %ds" % haproxy.HEADER_TIMEOUT_S in out.split("frontend prometheus")[0]


def test_a_frontend_on_every_interface_leaves_the_listeners_as_ray_wrote_them(tmp_path):
    src = _config("*", tmp_path)
    out = haproxy.rewrite(src)
    assert _binds(out) == _binds(src) == [":19101", "*:18000", "*:18404"]
    assert out.count("timeout http-request") == 1  # the header timeout still goes in
    already = src.replace("    mode http\n    timeout connect", "    mode http\n    timeout http-request 3s\n"
                          "    timeout connect", 1)
    assert haproxy.rewrite(already).count("timeout http-request") == 1  # one Ray set is kept, not doubled


def test_the_real_haproxy_accepts_the_rewritten_config(tmp_path):
    binary = haproxy.real_binary()
    assert os.access(binary, os.X_OK) and os.path.basename(binary) == "haproxy"
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy.rewrite(_config("127.0.0.1", tmp_path)))
    r = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_launcher_runs_haproxy_on_a_rewritten_copy(tmp_path):
    """`laya-fleet-haproxy -c -f CFG` (as Ray would start it, with its variable pointing at the launcher) checks
    CFG.laya: the copy with the listeners moved, not Ray's original, which it leaves untouched."""
    path = tmp_path / "haproxy.cfg"
    original = _config("127.0.0.1", tmp_path)
    path.write_text(original)
    env = dict(os.environ, RAY_SERVE_HAPROXY_BINARY_PATH=os.path.join(os.path.dirname(sys.executable),
                                                                      "laya-fleet-haproxy"))
    r = subprocess.run([sys.executable, "-m", "serve_app.haproxy", "-c", "-f", str(path)], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert path.read_text() == original
    copy = (tmp_path / "haproxy.cfg.laya").read_text()
    assert sorted(_binds(copy)) == ["127.0.0.1:18000", "127.0.0.1:18404", "127.0.0.1:19101"]


def test_a_broken_rewrite_would_be_caught_by_haproxy(tmp_path):
    """The `-c` check above can fail: HAProxy refuses a config with a bad bind line."""
    path = tmp_path / "bad.cfg"
    path.write_text(_config("127.0.0.1", tmp_path).replace("bind *:18404", "bind nonsense-address"))
    r = subprocess.run([haproxy.real_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.1.1", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("*", False), ("10.0.0.5", False), ("", False)])
def test_loopback_addresses(host, loopback):
    assert haproxy._is_loopback(host) is loopback


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_haproxy_dies_with_the_process_that_started_it(tmp_path):
    """Ray's HAProxyManager actor spawns the launcher; when that process dies (a Ray stopped hard, an
    interrupted `serve run`), HAProxy must not stay behind holding the HTTP port."""
    import socket
    import time

    port = _free_port()
    path = tmp_path / "haproxy.cfg"
    path.write_text(RAY_CONFIG.format(sock=tmp_path / "admin.sock", metrics=_free_port(), http=port,
                                      stats=_free_port(), host="127.0.0.1"))
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-m', 'serve_app.haproxy', '-db', '-f', %r])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(120)\n") % str(path)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # HAProxy is up once its frontend accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("HAProxy did not listen on %d" % port)
        with open("/proc/%d/cmdline" % child, "rb") as fh:  # the launcher exec'd HAProxy in place
            assert os.path.basename(fh.read().split(b"\0")[0].decode()) == "haproxy"
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _running(child):
            time.sleep(0.1)
        assert not _running(child), "HAProxy %d outlived its parent" % child
    finally:
        parent.kill()
        if child and _running(child):
            os.kill(child, 9)


def test_an_unreadable_config_is_a_clear_error_not_a_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "serve_app.haproxy", "-db", "-f", str(tmp_path / "missing.cfg")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cannot read the HAProxy config" in r.stderr and "missing.cfg" in r.stderr
    assert "Traceback" not in r.stderr


def test_every_replica_backend_keeps_a_client_on_its_last_replica(tmp_path):
    text = _config("0.0.0.0", tmp_path).replace(
        "listen stats", "backend http-other\n    server r2 127.0.0.1:30001 check\nlisten stats")
    out = haproxy.rewrite(text)
    sections = {s.split("\n", 1)[0]: s for s in ("\n" + out).split("\nbackend ")[1:]}
    assert "option prefer-last-server" in sections["http-laya"]
    assert "option prefer-last-server" in sections["http-other"]
    assert "option prefer-last-server" not in sections["default_backend"]
    assert haproxy.rewrite(out).count("option prefer-last-server") == 2  # rewriting twice adds nothing
    # Ray's pooled server connections replaced, and the backend without a reuse line given one
    assert "http-reuse always" not in out and "http-reuse never" in sections["http-laya"]
    assert "http-reuse never" in sections["http-other"] and "http-reuse" not in sections["default_backend"]
    assert haproxy.rewrite(out) == out


def _answers_as(name: bytes, delay_s: float):
    """A replica that answers every request on its connection with its own name, after `delay_s`."""
    import time

    def handler(conn):
        with conn:
            try:
                while _read_request(conn):
                    time.sleep(delay_s)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nContent-Type: text/plain\r\n\r\n%s"
                                 % (len(name), name))
            except OSError:  # HAProxy stopped at the end of the test
                pass
    return handler


def test_a_lone_client_stays_on_one_replica_and_concurrent_clients_spread(tmp_path):
    """Through the real HAProxy running the rewritten config (Ray's leastconn and `http-reuse always`), three
    replicas: one keep-alive client's requests, one after another, all reach one replica (Ray's config alone
    rotates them over every replica); three clients sending at once reach all three."""
    import threading

    import httpx

    served = [_serve(_answers_as(b"r%d" % i, 0.05)) for i in range(3)]
    port = _free_port()
    config = RAY_CONFIG.format(sock=tmp_path / "admin.sock", metrics=_free_port(), http=port, stats=_free_port(),
                               host="127.0.0.1")
    config = config.replace("    server SERVE_REPLICA_laya-Ingress-1 127.0.0.1:30000 check\n", "".join(
        "    server r%d 127.0.0.1:%d\n" % (i, p) for i, (p, _) in enumerate(served)))
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy.rewrite(config))
    proc = _start_haproxy(path, port)
    try:
        with httpx.Client(base_url="http://127.0.0.1:%d" % port, timeout=30) as client:
            alone = {client.post("/v1/systemone", json={"i": i}).text for i in range(12)}
        assert len(alone) == 1, alone
        together: list[set] = [set() for _ in range(3)]

        def run(k):
            with httpx.Client(base_url="http://127.0.0.1:%d" % port, timeout=30) as client:
                for i in range(6):
                    together[k].add(client.post("/v1/systemone", json={"i": i}).text)

        threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set().union(*together) == {"r0", "r1", "r2"}, together
    finally:
        proc.kill()
        proc.wait(10)
        for _, sock in served:
            sock.close()


def _start_haproxy(path, port: int) -> subprocess.Popen:
    """The real HAProxy running the config at `path`, once its frontend accepts connections on `port`."""
    import socket
    import time

    proc = subprocess.Popen([haproxy.real_binary(), "-db", "-f", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError("HAProxy did not listen on %d" % port) from None
            time.sleep(0.1)


def _serve(handler) -> tuple[int, object]:
    """A thread accepting connections on a free loopback port, each handled by `handler(conn)`."""
    import socket
    import threading

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def loop():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=handler, args=(conn,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return sock.getsockname()[1], sock


def _read_request(conn) -> bool:
    """Read one whole HTTP request (headers and a Content-Length body) from `conn`; False on EOF (HAProxy may
    reset a server connection it no longer needs rather than close it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = conn.recv(65536)
        except ConnectionResetError:
            return False
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(h.split(b":", 1)[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")),
                  0)
    while len(body) < length:
        body += conn.recv(65536)
    return True


def _dies_mid_request(conn):
    """A replica that dies holding the request: it reads it whole and closes without a byte of answer."""
    _read_request(conn)
    conn.close()


def _answers(conn):
    with conn:
        while _read_request(conn):
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok")


@pytest.mark.parametrize("retry_on_set", [False, True])
def test_a_request_a_dying_replica_dropped_goes_to_another(tmp_path, retry_on_set):
    """Through the real HAProxy, POSTs spread over a replica that drops every request unanswered and one that
    answers: with the rewrite each gets the live replica's 200; with Ray's `retry-on conn-failure` kept (as
    when RAY_SERVE_HAPROXY_RETRY_ON is set) some come back without an answer, so the check can fail."""
    import httpx

    dead, dead_sock = _serve(_dies_mid_request)
    live, live_sock = _serve(_answers)
    port = _free_port()
    config = RAY_CONFIG.format(sock=tmp_path / "admin.sock", metrics=_free_port(), http=port, stats=_free_port(),
                               host="127.0.0.1")
    config = config.replace("    balance leastconn\n", "    balance roundrobin\n    option redispatch 1\n"
                            "    retry-on conn-failure\n    timeout server 30s\n")
    config = config.replace("    server SERVE_REPLICA_laya-Ingress-1 127.0.0.1:30000 check\n",
                            "    server r-dead 127.0.0.1:%d\n    server r-live 127.0.0.1:%d\n" % (dead, live))
    path = tmp_path / "haproxy.cfg"
    rewritten = haproxy.rewrite(config, retry_on_set=retry_on_set)
    assert ("retry-on %s" % haproxy.RETRY_ON in rewritten) is not retry_on_set
    path.write_text(rewritten)
    proc = _start_haproxy(path, port)
    statuses = []
    try:
        with httpx.Client(base_url="http://127.0.0.1:%d" % port, timeout=30) as client:
            for i in range(8):
                try:
                    statuses.append(client.post("/v1/systemone", json={"i": i}).status_code)
                except httpx.HTTPError as e:
                    statuses.append(type(e).__name__)
    finally:
        proc.kill()
        proc.wait(10)
        dead_sock.close()
        live_sock.close()
    if retry_on_set:
        assert any(s != 200 for s in statuses), statuses
    else:
        assert statuses == [200] * 8, statuses


def _raw(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Everything HAProxy answers on one connection to `port` after `data` is sent, until it closes."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_haproxys_own_errors_answer_json(tmp_path):
    """Through the real HAProxy on a rewritten config: a request no server can take gets the 500 Ray's config
    normalises it to, with a JSON {"detail"} like the app's errors; malformed HTTP, headers over its buffer and
    trickled headers get HAProxy's own 400 / 408 (HTML on HAProxy 2.8, whose H1 layer bypasses errorfile)."""
    import json

    port = _free_port()
    config = RAY_CONFIG.format(sock=tmp_path / "admin.sock", metrics=_free_port(), http=port, stats=_free_port(),
                               host="127.0.0.1")
    ray_page = tmp_path / "500.http"  # what Ray writes and points 502/503/504 at
    ray_page.write_text("HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n\r\n"
                        "Internal Server Error")
    config = config.replace("    balance leastconn\n", "    balance leastconn\n    timeout http-request 1s\n"
                            + "".join("    errorfile %d %s\n" % (s, ray_page) for s in (502, 503, 504)))
    config = config.replace("127.0.0.1:30000 check", "127.0.0.1:%d" % _free_port())  # nothing listens there
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy.rewrite(config, error_dir=str(tmp_path)))
    haproxy.write_error_files(str(tmp_path))
    proc = _start_haproxy(path, port)
    try:
        cases = [("garbage", b"\x16\x03\x01\x00\xa5garbage\r\n\r\n", 400),
                 ("headers over the buffer", b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 400),
                 ("two content-lengths",
                  b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
                 ("headers never finished", b"GET / HTTP/1.1\r\nHost: x\r\n", 408),
                 ("no server answers", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 500)]
        for name, data, status in cases:
            head, _, body = _raw(port, data).partition(b"\r\n\r\n")
            assert head.split(b"\r\n")[0].split(b" ")[1] == str(status).encode(), (name, head)
            if status in haproxy.ERROR_PAGES:
                assert b"content-type: application/json" in head.lower(), (name, head)
                assert json.loads(body)["detail"] == haproxy.ERROR_PAGES[status][1], (name, body)
    finally:
        proc.kill()
        proc.wait(10)


def test_busy_polling_goes_in_global_only_when_asked(tmp_path, monkeypatch):
    """LAYA_FLEET_HAPROXY_BUSY_POLLING=1 adds `busy-polling` to `global` once (the real HAProxy accepts it);
    unset or 0 leaves it out; a value that is neither stops the launcher with the variable's name."""
    src = _config("*", tmp_path)
    monkeypatch.delenv(haproxy.BUSY_POLLING_ENV, raising=False)
    assert "busy-polling" not in haproxy.rewrite(src)
    monkeypatch.setenv(haproxy.BUSY_POLLING_ENV, "0")
    assert "busy-polling" not in haproxy.rewrite(src)
    monkeypatch.setenv(haproxy.BUSY_POLLING_ENV, "1")
    out = haproxy.rewrite(src)
    assert out.split("defaults")[0].count("\n    busy-polling\n") == 1 and out.count("busy-polling") == 1
    assert haproxy.rewrite(out).count("busy-polling") == 1  # a config that has it keeps one
    path = tmp_path / "busy.cfg"
    path.write_text(out)
    r = subprocess.run([haproxy.real_binary(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    monkeypatch.setenv(haproxy.BUSY_POLLING_ENV, "sometimes")
    with pytest.raises(SystemExit, match=haproxy.BUSY_POLLING_ENV):
        haproxy.rewrite(src)
