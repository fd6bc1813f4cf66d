"""An ASGI middleware bounding a request's headers: past MAX_HEADER_BYTES or MAX_HEADERS it answers
431 with a JSON `{"detail"}` before the app sees the request.

uvicorn (Serve's proxy and the replicas' direct-ingress ports) parses headers of any size; HAProxy in front
refuses only past its 16 KiB buffer, with a 400. The bound here gives both paths one limit and one answer.
"""

from __future__ import annotations

import json

MAX_HEADER_BYTES = 8192  # names and values of every header, summed
MAX_HEADERS = 100


class HeaderLimits:
    """Wraps an ASGI `app`; HTTP requests whose headers exceed `max_bytes` or `max_count` get 431."""

    def __init__(self, app, max_bytes: int = MAX_HEADER_BYTES, max_count: int = MAX_HEADERS):
        self.app = app
        self.max_bytes = max_bytes
        self.max_count = max_count

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            headers = scope.get("headers") or ()
            size = sum(len(k) + len(v) for k, v in headers)
            if size > self.max_bytes or len(headers) > self.max_count:
                await self._refuse(send, size, len(headers))
                return
        await self.app(scope, receive, send)

    async def _refuse(self, send, size: int, count: int) -> None:
        body = json.dumps({"detail": "request headers too large: %d bytes in %d headers (limits: %d bytes, %d "
                                     "headers)" % (size, count, self.max_bytes, self.max_count)}).encode()
        await send({"type": "http.response.start", "status": 431,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
