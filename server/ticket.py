"""A ticket: one HTTP request's rows in the engine bridge, and the asyncio side's view of them.

The worker thread writes a ticket's rows and hands it events (``_deliver``); the loop that
submitted it reads them by iterating it. ``_END`` closes the iteration.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mtplx.request import FinishEvent, GenerationRequest, TokenEvent
from server.bridge_errors import RequestTimeout

if TYPE_CHECKING:
    from server.engine_bridge import EngineBridge

__all__ = ["Ticket"]

Event = TokenEvent | FinishEvent

_END = object()  # sentinel: the worker is done with a ticket


@dataclass(eq=False)
class Ticket:
    """One submitted HTTP request. Iterate it (``async for index, event in ticket``) on the
    loop that submitted it; use it as an async context manager so leaving early cancels it.

    Raises ``RequestTimeout`` or ``GenerationFailed`` from iteration.
    """

    requests: tuple[GenerationRequest, ...]
    deadline: float
    _loop: asyncio.AbstractEventLoop
    _bridge: EngineBridge
    _events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _done: bool = False
    # Worker-thread state: the next request to admit, the rows in the batch, and how many
    # requests have not finished yet.
    _next: int = 0
    _rows: list[Any] = field(default_factory=list)
    _unfinished: int = -1
    _started: float = 0.0
    # Events handed to the loop (worker thread) and read (loop): each counter has one writer.
    _sent: int = 0
    _read: int = 0

    def __aiter__(self) -> Ticket:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        if self._done:
            raise StopAsyncIteration
        remaining = self.deadline - time.monotonic()
        try:
            item = await asyncio.wait_for(self._events.get(), timeout=max(remaining, 0.0))
        except asyncio.TimeoutError:
            self.cancel()
            raise RequestTimeout("the request timed out") from None
        self._read += 1
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def cancel(self) -> None:
        """Stop this ticket: dequeue it, or have the worker close its generator."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._bridge._forget(self)
        self._done = True

    @property
    def cancelled(self) -> bool:
        """True once cancelled (by the client side or a timeout)."""
        return self._cancelled.is_set()

    async def __aenter__(self) -> Ticket:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if not self._done:
            self.cancel()

    def _deliver(self, item: Any) -> None:
        """Called on the worker thread: hand one item to the asyncio side."""
        self._sent += 1
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()
