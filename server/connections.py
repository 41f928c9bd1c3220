"""Connection limits under uvicorn: what one client's idle or slow sockets may hold.

uvicorn's HTTP/1.1 protocol has a keep-alive timeout but no deadline for a request's head
or body, and it accepts connections until the process runs out of file descriptors (then
asyncio's accept loop logs an error per attempt). ``guarded_protocol`` wraps uvicorn's h11
protocol with:

- a **head deadline**: a request's head (request line and headers) must arrive within
  ``header_timeout`` seconds of the connection opening (or of the previous response on a
  keep-alive connection); else the server answers 408 and closes. It is a deadline, not an
  idle timeout, so dripping one byte at a time does not extend it.
- a **body idle timeout**: while a request's body is incomplete, ``body_timeout`` seconds
  without a byte close the connection (the app sees the client's disconnect), and so does a
  body that arrives slower than ``MIN_BODY_RATE`` bytes a second over a ``body_timeout``
  window (Apache's mod_reqtimeout rule: a byte every few seconds would otherwise hold a
  connection for days, and a cap's worth of them would refuse every new client). Time while
  the server itself stopped reading (flow control) does not count.
- a **connection cap**: past ``max_connections`` open connections, the one that has waited
  longest for a request head is closed to make room (an idle or slow socket gives way to a
  client that is about to send); when every connection is busy with a request, the new one
  gets 503 and is closed. The cap stays below the file-descriptor limit by a reserve and
  the listen backlog (``connection_cap``), so accepting never runs out of descriptors.

``raise_fd_limit`` lifts the soft descriptor limit to the hard one at start-up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h11
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.errors import error_body

__all__ = [
    "ACCEPT_BACKLOG",
    "FD_RESERVE",
    "MIN_BODY_RATE",
    "ConnectionGuard",
    "ConnectionLimits",
    "connection_cap",
    "guarded_protocol",
    "raise_fd_limit",
]

log = logging.getLogger("mtplx.connections")

# Descriptors kept out of the connection cap: the listener, log files, the model's files,
# pipes and whatever libraries open.
FD_RESERVE = 128
# The listen backlog: also how many connections asyncio accepts in one go.
ACCEPT_BACKLOG = 256
# A hard limit of "unlimited" is raised this far.
_UNLIMITED_FDS = 1 << 16
# The slowest a request body may arrive, in bytes a second over each body_timeout window.
MIN_BODY_RATE = 500


@dataclass(frozen=True)
class ConnectionLimits:
    """What a connection may take: the cap on open connections, the seconds a request's
    head may take to arrive, the idle seconds allowed inside a body, and the keep-alive
    timeout between requests."""

    max_connections: int = 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 8.0


def raise_fd_limit() -> int:
    """Lift the soft limit on open file descriptors to the hard limit (what an unprivileged
    process may do); the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _UNLIMITED_FDS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit from %d to %d", soft, target)
    return _UNLIMITED_FDS if soft == resource.RLIM_INFINITY else soft


def connection_cap(max_connections: int, fd_limit: int, backlog: int = 0) -> int:
    """``max_connections``, lowered so that ``FD_RESERVE`` descriptors stay free besides
    ``backlog`` more: asyncio accepts up to the listen backlog in one go before any new
    connection is admitted (and may be closed)."""
    return max(1, min(max_connections, fd_limit - backlog - FD_RESERVE))


def _raw_response(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, with OpenAI error JSON."""
    body = json.dumps(error_body(status, message, code=code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass(eq=False)
class ConnectionGuard:
    """State the connections of one server share: those waiting for a request head (oldest
    first) and counts of the connections the limits closed, by reason."""

    limits: ConnectionLimits
    waiting: OrderedDict[Any, None] = field(default_factory=OrderedDict)
    closed: dict[str, int] = field(
        default_factory=lambda: {
            "header_timeout": 0,
            "body_timeout": 0,
            "evicted": 0,
            "refused": 0,
        }
    )
    open: int = 0

    def count(self, reason: str) -> None:
        """One connection closed by the limits for ``reason``."""
        self.closed[reason] += 1

    def collect(self) -> Iterator[Metric]:
        """Prometheus metrics (a collector's ``collect``): open connections, the cap, and
        the connections the limits closed, by reason."""
        yield GaugeMetricFamily("mtplx_open_connections", "Open HTTP connections", self.open)
        yield GaugeMetricFamily(
            "mtplx_max_connections", "The cap on open connections", self.limits.max_connections
        )
        closed = CounterMetricFamily(
            "mtplx_connections_closed",
            "Connections closed by the limits (header_timeout, body_timeout, evicted, refused)",
            labels=["reason"],
        )
        for reason, count in self.closed.items():
            closed.add_metric([reason], count)
        yield closed


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the head deadline, the body idle timeout and the
    connection cap of ``guard`` (a class attribute: uvicorn builds one protocol per
    connection from the class)."""

    guard: ClassVar[ConnectionGuard]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Admit the connection (making room, or refusing it) and start its head deadline."""
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._last_data = time.monotonic()
        self._window_start = self._last_data  # the body rate's window and its bytes
        self._window_bytes = 0
        super().connection_made(transport)
        guard = self.guard
        guard.open += 1
        if len(self.connections) > guard.limits.max_connections:
            if guard.waiting:
                oldest, _ = guard.waiting.popitem(last=False)
                guard.count("evicted")
                log.warning(
                    "at the limit of %d connections: closed the one waiting longest for a "
                    "request head",
                    guard.limits.max_connections,
                )
                oldest._close()
            else:
                guard.count("refused")
                log.warning(
                    "at the limit of %d connections, all busy: refused a new connection",
                    guard.limits.max_connections,
                )
                self._answer_and_close(
                    _raw_response(
                        503,
                        "Service Unavailable",
                        "The server has too many open connections; retry later.",
                        "too_many_connections",
                    )
                )
                return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        """Forget the connection and its timers."""
        self.guard.open -= 1
        self.guard.waiting.pop(self, None)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Note the time (for the body idle timeout), then let h11 parse; a head that
        arrived ends the head deadline."""
        self._last_data = time.monotonic()
        self._window_bytes += len(data)
        super().data_received(data)
        self._follow_phase()

    def on_response_complete(self) -> None:
        """After a response a keep-alive connection waits for the next head: a new deadline."""
        super().on_response_complete()
        if not self.transport.is_closing():
            self._follow_phase(new_head=True)

    # -- phases -------------------------------------------------------------------------

    def _follow_phase(self, new_head: bool = False) -> None:
        """Arm the timer of the phase the connection is in: waiting for a head (IDLE on
        the client's side), or reading a body (SEND_BODY)."""
        state = self.conn.their_state
        if state is h11.IDLE:
            if new_head or self not in self.guard.waiting:
                self._await_head()
            return
        if self in self.guard.waiting:
            del self.guard.waiting[self]
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        if state is h11.SEND_BODY and self._body_timer is None:
            self._window_start, self._window_bytes = time.monotonic(), 0
            self._body_timer = self.loop.call_later(
                self.guard.limits.body_timeout, self._check_body
            )

    def _await_head(self) -> None:
        self.guard.waiting[self] = None
        self.guard.waiting.move_to_end(self)
        if self._head_timer is not None:
            self._head_timer.cancel()
        self._head_timer = self.loop.call_later(
            self.guard.limits.header_timeout, self._head_timed_out
        )

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self.guard.waiting.pop(self, None)
        self.guard.count("header_timeout")
        log.info("closed a connection whose request head did not arrive in time")
        self._answer_and_close(
            _raw_response(
                408,
                "Request Timeout",
                f"The request head did not arrive within {self.guard.limits.header_timeout:g} "
                "seconds.",
                "request_timeout",
            )
        )

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        timeout = self.guard.limits.body_timeout
        now = time.monotonic()
        if self.flow.read_paused:  # the server stopped reading: the client is not idle
            self._last_data = self._window_start = now
            self._window_bytes = 0
        idle = now - self._last_data
        if idle >= timeout:
            self.guard.count("body_timeout")
            log.info("closed a connection whose request body stalled for %gs", timeout)
            self._close()
            return
        window = now - self._window_start
        if window >= timeout:
            if self._window_bytes < MIN_BODY_RATE * window:
                self.guard.count("body_timeout")
                log.info(
                    "closed a connection whose request body arrived slower than %d bytes/s",
                    MIN_BODY_RATE,
                )
                self._close()
                return
            self._window_start, self._window_bytes, window = now, 0, 0.0
        self._body_timer = self.loop.call_later(
            min(timeout - idle, timeout - window), self._check_body
        )

    # -- closing ------------------------------------------------------------------------

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _answer_and_close(self, response: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(response)
        self._close()

    def _close(self) -> None:
        self._cancel_timers()
        self.guard.waiting.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(guard: ConnectionGuard) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` whose connections share ``guard``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})
