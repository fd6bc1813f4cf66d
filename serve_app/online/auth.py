"""Bearer-key authentication of the HTTP routes: a request must carry exactly `Authorization: Bearer <key>`.

The key comes from the environment variable the app's `api_key_env` names (it must then be set); with no
`api_key_env`, from `LAYA_API_KEY` as upstream `laya-serve` reads it (set and non-empty: a bearer is required;
unset or empty: no auth)."""

import hmac
import os

from fastapi import Request

from .request_checks import HTTPError

UPSTREAM_KEY_ENV = "LAYA_API_KEY"


class BearerAuth:
    """The configured bearer key (None: no auth), checked in constant time. `source` names the variable it came
    from (None with no key)."""

    def __init__(self, api_key_env: str | None = None):
        self.source = api_key_env or (UPSTREAM_KEY_ENV if os.environ.get(UPSTREAM_KEY_ENV) else None)
        key = os.environ.get(self.source, "") if self.source else ""
        if api_key_env and not key.strip():
            # a configured but missing key must not silently open the service
            raise RuntimeError("api_key_env=%r is set but that environment variable is empty or missing"
                               % api_key_env)
        # the bytes a client sends
        self.expected = ("Bearer " + key).encode("utf-8", "surrogateescape") if self.source else None

    def __bool__(self) -> bool:
        return self.expected is not None

    def authorized(self, request: Request) -> bool:
        """Whether `request` carries the key (always, with no key configured): sent as UTF-8 bytes, or as
        upstream's clients send a non-ASCII key (urllib writes a header as latin-1), which upstream accepts."""
        if self.expected is None:
            return True
        # Starlette decodes header bytes as latin-1: encoding back to latin-1 recovers the bytes on the wire
        # (a UTF-8 key sent as UTF-8), to UTF-8 what upstream compares (the same key sent as latin-1)
        header = request.headers.get("authorization") or ""
        wire = hmac.compare_digest(header.encode("latin-1"), self.expected)
        text = hmac.compare_digest(header.encode("utf-8", "surrogateescape"), self.expected)
        return wire | text

    def require(self, request: Request) -> None:
        """401 with WWW-Authenticate unless the request carries the configured bearer key."""
        if not self.authorized(request):
            raise HTTPError(401, "invalid or missing bearer token", {"WWW-Authenticate": "Bearer"})
