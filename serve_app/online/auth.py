"""Bearer-key authentication of the HTTP routes: the key comes from an environment variable named in the
app's args, and a request must carry exactly `Authorization: Bearer <key>`."""

import hmac
import os

from fastapi import Request

from .request_checks import HTTPError


class BearerAuth:
    """The configured bearer key (None: no auth), checked in constant time."""

    def __init__(self, api_key_env: str | None = None):
        self.expected: bytes | None = None
        if api_key_env:
            key = os.environ.get(api_key_env, "")
            if not key.strip():
                # a configured but missing key must not silently open the service
                raise RuntimeError("api_key_env=%r is set but that environment variable is empty or missing"
                                   % api_key_env)
            self.expected = ("Bearer " + key).encode("utf-8", "surrogateescape")  # the bytes a client sends

    def __bool__(self) -> bool:
        return self.expected is not None

    def authorized(self, request: Request) -> bool:
        """Whether `request` carries the key (always, with no key configured)."""
        if self.expected is None:
            return True
        # Starlette decodes header bytes as latin-1, so encoding back to latin-1 recovers exactly the bytes on
        # the wire (never raises); a UTF-8 key sent as UTF-8 matches, anything else is simply unequal.
        supplied = (request.headers.get("authorization") or "").encode("latin-1")
        return hmac.compare_digest(supplied, self.expected)

    def require(self, request: Request) -> None:
        """401 with WWW-Authenticate unless the request carries the configured bearer key."""
        if not self.authorized(request):
            raise HTTPError(401, "invalid or missing bearer token", {"WWW-Authenticate": "Bearer"})
