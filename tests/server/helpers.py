"""Helpers for in-process server tests: request bodies and a raw ASGI driver for what
httpx's ASGITransport cannot do (it buffers whole responses): reading a stream as it is
produced and disconnecting mid-request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

MODEL = "fake-model"


def chat_body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    """A minimal valid chat request."""
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def completion_body(prompt: Any = "hi", **extra: Any) -> dict[str, Any]:
    """A minimal valid completions request."""
    return {"model": MODEL, "prompt": prompt, **extra}


class ASGICall:
    """One request driven straight through the ASGI interface: see each body chunk as the
    app sends it, and disconnect whenever the test wants."""

    def __init__(self, app: FastAPI, path: str, body: dict[str, Any], method: str = "POST"):
        data = json.dumps(body).encode()
        self._body: bytes | None = data
        self._disconnect = asyncio.Event()
        self._messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
            "client": ("127.0.0.1", 50000),
            "server": ("test", 80),
        }
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self._buffer = ""
        self.finished = False

    async def _receive(self) -> dict[str, Any]:
        if self._body is not None:
            body, self._body = self._body, None
            return {"type": "http.request", "body": body, "more_body": False}
        await self._disconnect.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        await self._messages.put(message)

    async def start(self, timeout: float = 5.0) -> int:
        """Wait for the status line."""
        message = await asyncio.wait_for(self._messages.get(), timeout)
        assert message["type"] == "http.response.start"
        self.status = message["status"]
        self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        return self.status

    async def body(self, timeout: float = 10.0) -> bytes:
        """The rest of the body."""
        parts = [self._buffer.encode()]
        self._buffer = ""
        while not self.finished:
            message = await asyncio.wait_for(self._messages.get(), timeout)
            parts.append(message.get("body", b""))
            self.finished = not message.get("more_body", False)
        return b"".join(parts)

    async def events(self, timeout: float = 10.0) -> AsyncIterator[str]:
        """SSE ``data:`` payloads, each as soon as its chunk arrives."""
        while True:
            while "\n\n" in self._buffer:
                block, self._buffer = self._buffer.split("\n\n", 1)
                for line in block.splitlines():
                    if line.startswith("data: "):
                        yield line[len("data: ") :]
            if self.finished:
                return
            message = await asyncio.wait_for(self._messages.get(), timeout)
            self._buffer += message.get("body", b"").decode()
            self.finished = not message.get("more_body", False)

    async def disconnect(self, timeout: float = 5.0) -> None:
        """The client goes away; wait for the app to wind the request down."""
        self._disconnect.set()
        await asyncio.wait_for(self.task, timeout)


async def stream_text(app: FastAPI, path: str, body: dict[str, Any]) -> tuple[str, list[dict]]:
    """Run one streaming request to the end: (concatenated text, parsed chunks)."""
    call = ASGICall(app, path, body)
    assert await call.start() == 200
    chunks, text = [], ""
    async for data in call.events():
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        chunks.append(chunk)
        for choice in chunk.get("choices", []):
            text += choice.get("delta", {}).get("content", "") or choice.get("text", "")
    await call.body()
    return text, chunks


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` without blocking the loop."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not predicate():
        assert loop.time() < end, "condition not reached in time"
        await asyncio.sleep(0.005)


def named_events(raw: str) -> list[tuple[str | None, Any]]:
    """A whole SSE body as (event name, parsed data) pairs; ``[DONE]`` stays a string."""
    events = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:") :].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:") :].removeprefix(" "))
        if data:
            payload = "\n".join(data)
            events.append((name, payload if payload == "[DONE]" else json.loads(payload)))
    return events
