"""serve_app/online/http_limits.py on a real ASGI app (Starlette through httpx's ASGI transport): headers at the
limits pass, one byte or one header past them gets 431 with a JSON detail, and the app never runs for it."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from serve_app.online.http_limits import MAX_HEADER_BYTES, MAX_HEADERS, HeaderLimits

SEEN = []


async def _echo(request):
    SEEN.append(request.url.path)
    raw = request.scope["headers"]
    return JSONResponse({"bytes": sum(len(k) + len(v) for k, v in raw), "count": len(raw)})


def _get(headers: list[tuple[str, str]]) -> httpx.Response:
    app = HeaderLimits(Starlette(routes=[Route("/x", _echo)]))

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/x", headers=headers)

    return asyncio.run(go())


def _base() -> dict:
    """Bytes and count of the headers the client sends on its own (host, accept, ...), as the app sees them."""
    return _get([]).json()


def test_headers_at_the_byte_limit_pass_and_one_byte_more_is_431():
    room = MAX_HEADER_BYTES - _base()["bytes"] - len("x-pad")
    SEEN.clear()
    assert _get([("x-pad", "p" * room)]).json()["bytes"] == MAX_HEADER_BYTES and SEEN == ["/x"]
    r = _get([("x-pad", "p" * (room + 1))])
    assert r.status_code == 431 and r.headers["content-type"] == "application/json"
    assert "request headers too large: %d bytes" % (MAX_HEADER_BYTES + 1) in r.json()["detail"]
    assert SEEN == ["/x"]  # the app did not run for the refused request


def test_one_header_past_the_count_is_431():
    base = _base()["count"]
    assert _get([("x-%d" % i, "1") for i in range(MAX_HEADERS - base)]).status_code == 200
    r = _get([("x-%d" % i, "1") for i in range(MAX_HEADERS - base + 1)])
    assert r.status_code == 431 and "%d headers" % (MAX_HEADERS + 1) in r.json()["detail"]
