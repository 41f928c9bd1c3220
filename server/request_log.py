"""One structured log line per request (id, method, endpoint, status, tokens, latency) and
the request counters / latency histogram. Pure ASGI, so streaming replies are timed to
their last byte.

What the client controls (the path of an unmatched route, the request id) is logged through
``printable``: control and line-separator characters are escaped, so a ``%0A`` in a URL
cannot forge a log line."""

from __future__ import annotations

import logging
import time
import unicodedata
import uuid
from collections.abc import Iterator
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics import ServerMetrics

__all__ = ["RequestLogMiddleware", "endpoint_label", "printable"]

log = logging.getLogger("mtplx.access")

# Control (Cc), format (Cf: bidi overrides, zero-width), line and paragraph separators.
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
MAX_LOGGED_CHARS = 256


def _escape(char: str) -> str:
    if char == "\\":
        return "\\\\"
    if char.isprintable() and unicodedata.category(char) not in _UNSAFE_CATEGORIES:
        return char
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str, limit: int = MAX_LOGGED_CHARS) -> str:
    """``text`` safe for a one-line log record: backslashes doubled, control characters
    as ``\\xNN`` / ``\\uNNNN`` / ``\\UNNNNNNNN``, cut to ``limit`` characters (then ``...``)."""
    cut = len(text) > limit
    escaped = "".join(_escape(char) for char in text[:limit])
    return escaped + "..." if cut else escaped


def _routes(routes: Any, depth: int = 0) -> Iterator[Any]:
    """Routes with a path template, through included routers (FastAPI wraps each)."""
    for route in routes or ():
        if isinstance(getattr(route, "path", None), str) and hasattr(route, "matches"):
            yield route
        nested = getattr(route, "routes", None)
        if nested is None:
            nested = getattr(getattr(route, "original_router", None), "routes", None)
        if nested is not None and depth < 4:
            yield from _routes(nested, depth + 1)


def endpoint_label(scope: Scope) -> str:
    """The route template (bounded label values), or "unmatched". A request refused
    before routing (by a middleware, or because the client left while sending its body)
    is labelled with the route its path would have reached."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    router = getattr(scope.get("app"), "router", None)
    for candidate in _routes(getattr(router, "routes", None)):
        try:
            match, _ = candidate.matches(scope)
        except (KeyError, TypeError, ValueError):
            continue
        if match is not Match.NONE:
            return candidate.path
    return "unmatched"


class RequestLogMiddleware:
    """Assigns ``x-request-id`` (the client's if sent), logs, and counts every request. A
    request whose client left before any response went out (in the middle of sending its
    body, say) is logged and counted as 499, not as an error of the server."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = printable(value.decode("latin-1"), 64)
        request_id = request_id or uuid.uuid4().hex[:16]
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["started"] = started
        status = 500
        responded = False
        client_left = False

        async def receive_watching() -> Message:
            nonlocal client_left
            message = await receive()
            if message["type"] == "http.disconnect":
                client_left = True
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status = message["status"]
                responded = True
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive_watching, send_with_id)
        finally:
            seconds = time.perf_counter() - started
            endpoint = endpoint_label(scope)
            usage = scope.get("state", {}).get("usage") or {}
            if state.get("disconnected") or (client_left and not responded):
                status = 499  # nginx's "client closed request"
            self.metrics.observe_request(endpoint, status, seconds)
            log.info(
                "request id=%s method=%s endpoint=%s status=%d prompt_tokens=%s "
                "completion_tokens=%s latency_ms=%.1f",
                request_id,
                printable(scope["method"]),
                endpoint if endpoint != "unmatched" else printable(scope["path"]),
                status,
                usage.get("prompt_tokens", 0),
                usage.get("completion_tokens", 0),
                seconds * 1000,
            )
