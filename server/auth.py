"""Optional API key: when set, every request needs ``Authorization: Bearer <key>``, the
OpenAPI document and its viewers (/openapi.json, /docs, /redoc) included. Only /health and
/metrics stay open, for load balancers and scrapers."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError

__all__ = ["OPEN_PATHS", "ApiKeyMiddleware"]

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """401 with OpenAI error JSON when the key is missing or wrong."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key.strip():
            raise ValueError("api_key must not be empty or whitespace")
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        presented = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                presented = value[7:].strip()
        # Constant-time comparison: the time taken reveals nothing about the key.
        if not hmac.compare_digest(presented, self._key):
            error = APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
