"""A ticket: one HTTP request's rows in the engine bridge, and the asyncio side's view of them.

The worker thread writes a ticket's rows and hands it events (``_deliver``; a step's events
are held and handed over together, ``_hold`` / ``_flush``: one wake-up of the loop a step, and
the reader finds them all queued, ``num_ready``, so a stream can send them in one write); the
loop that submitted it reads them by iterating it. ``_END`` closes the iteration.
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
    # Worker-thread only: this step's items, handed over together by ``_flush``.
    _held: list[Any] = field(default_factory=list)

    def __aiter__(self) -> Ticket:
        return self

    async def __anext__(self) -> tuple[int, Event]:
        if self._done:
            raise StopAsyncIteration
        if not self._events.empty():  # handed over already: no timeout to arm
            item = self._events.get_nowait()
        else:
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
    def num_ready(self) -> int:
        """Items handed over and not read yet (the loop's side: the next ones come without
        waiting)."""
        return self._events.qsize()

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
        """Hand one item to the asyncio side now (any thread; the worker flushes what it
        holds first, ``_flush``)."""
        self._hand_over([item])

    def _hold(self, item: Any) -> None:
        """Called on the worker thread: keep an item of this step for ``_flush``."""
        self._held.append(item)

    def _flush(self) -> None:
        """Called on the worker thread: hand the held items over, all in one callback of the
        loop (one wake-up for a step's tokens, not one per token)."""
        if self._held:
            held, self._held = self._held, []
            self._hand_over(held)

    def _hand_over(self, items: list[Any]) -> None:
        self._sent += len(items)
        try:
            self._loop.call_soon_threadsafe(self._put_all, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()

    def _put_all(self, items: list[Any]) -> None:
        """On the loop: queue the items (the reader then finds them all there)."""
        for item in items:
            self._events.put_nowait(item)
