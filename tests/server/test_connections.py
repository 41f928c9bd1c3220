"""Connection limits (``server.connections``) on a real uvicorn server in a thread: a head
that does not arrive in time is answered 408 and closed, a stalled body is closed (the app
sees the disconnect), past the cap the connection waiting longest for a head gives way, and
a new connection is refused with 503 only when every connection is busy."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry, generate_latest

from server.connections import (
    FD_RESERVE,
    ConnectionGuard,
    ConnectionLimits,
    connection_cap,
    guarded_protocol,
    raise_fd_limit,
)
from tests.server.live import free_port


class _App:
    """``/health`` answers at once; ``/slow`` holds its request until released; ``/body``
    reads the whole body and notes a disconnect."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.disconnects = 0
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.loop = asyncio.get_running_loop()
        if scope["path"] == "/body":
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnects += 1
                    return
                if not message.get("more_body"):
                    break
        if scope["path"] == "/slow":
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _serve(limits: ConnectionLimits) -> Iterator[tuple[int, ConnectionGuard, _App]]:
    app = _App()
    guard = ConnectionGuard(limits)
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=guarded_protocol(guard),
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield port, guard, app
    finally:
        if app.loop is not None:
            app.loop.call_soon_threadsafe(app.release.set)
        server.should_exit = True
        thread.join(10)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _wait_for(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_partial_head_is_answered_408_and_closed() -> None:
    with _serve(ConnectionLimits(header_timeout=0.3)) as (port, guard, _):
        with _connect(port) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # no blank line
            reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408 ")
        error = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
        assert guard.closed["header_timeout"] == 1
        _wait_for(lambda: guard.open == 0)
        registry = CollectorRegistry()
        registry.register(guard)
        text = generate_latest(registry).decode()
        assert 'mtplx_connections_closed_total{reason="header_timeout"} 1.0' in text
        assert "mtplx_open_connections 0.0" in text and "mtplx_max_connections 1024.0" in text


def test_dripping_bytes_does_not_extend_the_head_deadline() -> None:
    with _serve(ConnectionLimits(header_timeout=0.5)) as (port, guard, _):
        with _connect(port) as sock:
            closed = False
            for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200:
                try:
                    sock.sendall(bytes([byte]))
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                time.sleep(0.02)
            assert closed or _read_all(sock).startswith(b"HTTP/1.1 408 ")
        assert guard.closed["header_timeout"] == 1


def test_a_whole_request_is_not_timed_out_and_keep_alive_works() -> None:
    with _serve(ConnectionLimits(header_timeout=0.3)) as (port, guard, _):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for _ in range(3):
                assert client.get("/health").text == "ok"
        assert guard.closed["header_timeout"] == 0


def test_a_stalled_body_is_closed_and_the_app_sees_the_disconnect() -> None:
    with _serve(ConnectionLimits(body_timeout=0.3)) as (port, guard, app):
        with _connect(port) as sock:
            sock.sendall(
                b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10
            )
            assert _read_all(sock) == b""
        _wait_for(lambda: app.disconnects == 1)
        assert guard.closed["body_timeout"] == 1


def test_a_dripping_body_is_closed_and_a_steady_one_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte now and then never stalls a body for ``body_timeout``, but arrives slower
    than the minimum rate over a window: closed (a cap's worth of such connections would
    refuse every new client). A body that keeps the rate completes."""
    import server.connections

    monkeypatch.setattr(server.connections, "MIN_BODY_RATE", 200)
    with _serve(ConnectionLimits(body_timeout=0.4)) as (port, guard, app):
        with _connect(port) as sock:
            sock.sendall(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            closed = False
            for _ in range(40):  # a byte every 0.1 s: never idle for 0.4 s, 10 bytes/s
                try:
                    sock.sendall(b"x")
                except (BrokenPipeError, ConnectionResetError):
                    closed = True
                    break
                time.sleep(0.1)
            assert closed or _read_all(sock) == b""
        _wait_for(lambda: app.disconnects == 1)
        assert guard.closed["body_timeout"] == 1
        with _connect(port) as sock:
            sock.sendall(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
            for _ in range(10):  # 100 bytes every 0.1 s: 1,000 bytes/s
                sock.sendall(b"x" * 100)
                time.sleep(0.1)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert guard.closed["body_timeout"] == 1


def test_past_the_cap_the_oldest_waiting_connection_gives_way() -> None:
    limits = ConnectionLimits(max_connections=4, header_timeout=60)
    with _serve(limits) as (port, guard, _):
        idle = [_connect(port) for _ in range(4)]
        for sock in idle:
            sock.sendall(b"GET /health HTTP/1.1\r\n")  # heads that never end
        _wait_for(lambda: len(guard.waiting) == 4)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            assert client.get("/health").text == "ok"
        assert guard.closed["evicted"] == 1
        assert _read_all(idle[0]) == b""  # the oldest one was closed
        for sock in idle:
            sock.close()


def test_a_new_connection_is_refused_when_every_connection_is_busy() -> None:
    limits = ConnectionLimits(max_connections=2, header_timeout=60)
    with _serve(limits) as (port, guard, app):
        busy = [_connect(port) for _ in range(2)]
        for sock in busy:
            sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        _wait_for(lambda: app.loop is not None and not guard.waiting)
        with _connect(port) as sock:
            reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 503 ")
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == (
            "too_many_connections"
        )
        assert guard.closed["refused"] == 1
        assert app.loop is not None
        app.loop.call_soon_threadsafe(app.release.set)
        for sock in busy:
            assert b"200 OK" in sock.recv(65536)
            sock.close()


def test_the_cap_leaves_descriptors_for_the_listener() -> None:
    assert connection_cap(1024, 20000) == 1024
    assert connection_cap(1024, 1024) == 1024 - FD_RESERVE
    assert connection_cap(1024, 10) == 1
    assert connection_cap(1024, 2048, 256) == 1024
    assert connection_cap(4096, 2048, 256) == 2048 - 256 - FD_RESERVE
    assert raise_fd_limit() >= 1


@pytest.mark.parametrize("timeout", ["inf", "nan"])
def test_timeouts_must_be_finite(timeout: str) -> None:
    from pydantic import ValidationError

    from server.settings import ServerSettings

    for name in ("shutdown_timeout", "header_timeout", "body_timeout", "request_timeout"):
        with pytest.raises(ValidationError, match="finite"):
            ServerSettings(**{name: timeout})
