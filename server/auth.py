"""Optional API key: when set, every request needs ``Authorization: Bearer <key>`` or
``x-api-key: <key>`` (how Anthropic's clients send it), the OpenAPI document and its viewers
(/openapi.json, /docs, /redoc) included. /health and /metrics stay open, for load balancers
and scrapers, and so do the chat page and its static files: a browser opening the page
cannot send a header, and the page holds no data (it asks for the key and sends it)."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import APIError

__all__ = ["OPEN_PATHS", "OPEN_PREFIXES", "ApiKeyMiddleware"]

OPEN_PATHS = frozenset({"/health", "/metrics", "/"})
OPEN_PREFIXES = ("/static/",)  # the chat page's files (server/static/)


class ApiKeyMiddleware:
    """401 (error JSON in the shape of the path's API) when the key is missing or wrong."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key.strip():
            raise ValueError("api_key must not be empty or whitespace")
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if scope["type"] != "http" or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            await self.app(scope, receive, send)
            return
        presented: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                presented.append(value[7:].strip())
            elif name == b"x-api-key":
                presented.append(value.strip())
        # Constant-time comparison: the time taken reveals nothing about the key. Every
        # header sent must hold the key: one right and one wrong is a client error.
        if not presented or not all(hmac.compare_digest(p, self._key) for p in presented):
            error = APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>' "
                "or 'x-api-key: <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)
