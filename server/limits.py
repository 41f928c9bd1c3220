"""Request body size limit, enforced before any parsing: a declared Content-Length over the
limit is refused at once, a chunked body as soon as it crosses the limit. The body is read
here and replayed to the app, so the app's later ``receive()`` calls still see the client's
disconnect."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError

__all__ = ["BodyLimitMiddleware"]


class BodyLimitMiddleware:
    """413 with OpenAI error JSON for bodies over ``max_bytes``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nothing to answer
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"Request body is larger than the limit of {self.max_bytes} bytes.",
            code="request_too_large",
        )
        await error.response(scope["path"])(scope, receive, send)
