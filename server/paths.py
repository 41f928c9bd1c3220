"""One spelling per route: a trailing slash is dropped before routing, so ``/v1/models/``
is ``/v1/models`` (Open WebUI asks for that) and ``POST /v1/chat/completions/`` is served,
not redirected (a 307 makes many clients drop the body or the Authorization header).

It runs outside every other middleware, so the API key's open paths, the error shape of a
path and the route all see the same path."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = ["TrailingSlashMiddleware", "without_trailing_slash"]


def without_trailing_slash(path: str) -> str:
    """``/v1/models/`` -> ``/v1/models``; ``/`` stays ``/``."""
    stripped = path.rstrip("/")
    return stripped or "/"


class TrailingSlashMiddleware:
    """Rewrites the ASGI scope's ``path`` and ``raw_path`` without trailing slashes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            stripped = without_trailing_slash(path)
            if stripped != path:
                scope = dict(scope, path=stripped)
                raw = scope.get("raw_path")
                if raw:
                    scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
