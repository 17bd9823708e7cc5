"""Who may call: API keys checked in constant time, by the tier server and the gateway alike.

A client is known by its key (as a short hash, so no key ever reaches a log or a metric) or,
when the API is open, by its address.
"""

import hashlib
import hmac
from collections.abc import Iterable

from starlette.types import ASGIApp, Receive, Scope, Send

from serving.api_server.serving_engine import APIError

# Probes and scrapers carry no API key.
OPEN_PATHS = frozenset({"/health", "/metrics"})


def key_id(key: bytes) -> str:
    """A key's name in logs: a prefix of its hash, which does not reveal it."""
    return "key-" + hashlib.sha256(key).hexdigest()[:12]


class APIKeyAuth:
    """Requires `Authorization: Bearer <key>` with one of the keys on every path but the open
    ones. Every key is compared, each in constant time, so timing tells nothing about which
    key or how much of one matched. Pure ASGI (not BaseHTTPMiddleware), so streaming and
    disconnect detection pass through untouched. Sets `client_id` in the request state."""

    def __init__(
        self, app: ASGIApp, api_keys: Iterable[str], open_prefixes: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self._keys = [k.encode() for k in api_keys]
        self._open_prefixes = open_prefixes

    def _client(self, scope: Scope) -> str | None:
        value = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = value.partition(b" ")
        token = token.strip()
        matched = None
        for key in self._keys:
            if hmac.compare_digest(token, key):
                matched = key
        return key_id(matched) if matched is not None and scheme.lower() == b"bearer" else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or path in OPEN_PATHS
            or path.startswith(self._open_prefixes)
            or scope.get("method") == "OPTIONS"  # a CORS preflight carries no credentials
        ):
            await self.app(scope, receive, send)
            return
        client = self._client(scope)
        if client is None:
            error = APIError(401, "Incorrect or missing API key.", code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        scope.setdefault("state", {})["client_id"] = client
        await self.app(scope, receive, send)
