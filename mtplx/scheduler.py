"""Async facade over the one engine thread.

MLX work must stay on one thread (DESIGN.md), so a dedicated worker thread owns the engine:
it builds it (``engine_factory`` runs on that thread, so loading and generating share it),
then takes tickets from a bounded FIFO and runs ``engine.generate`` for one request at a time.
The asyncio side submits tickets and reads their events from a per-ticket ``asyncio.Queue``
that the worker feeds with ``loop.call_soon_threadsafe``.

A ticket is one HTTP request: one or more ``GenerationRequest`` run back to back (``n``
choices, several prompts) without other tickets in between. Cancelling a ticket (client
gone, timeout) removes it from the queue, or makes the worker close the running generator at
the next event, which stops the engine within one cycle; the worker then moves on. An
exception inside ``generate`` fails that ticket alone.

Batching seam: ``_take_tickets`` hands the worker a list; today it holds one ticket. A
batched engine would take several and interleave their events.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mtplx.request import FinishEvent, GenerationRequest, TokenEvent

__all__ = [
    "EngineLike",
    "EngineNotReady",
    "GenerationFailed",
    "QueueFull",
    "RequestTimeout",
    "Scheduler",
    "SchedulerError",
    "SchedulerStats",
    "Ticket",
]

log = logging.getLogger(__name__)

Event = TokenEvent | FinishEvent


class EngineLike(Protocol):
    """The part of ``mtplx.engine.Engine`` the scheduler and the server use."""

    tokenizer: Any
    model_name: str
    context_length: int
    default_drafter: str
    default_depth: int | None
    available_drafters: tuple[str, ...]

    def validate(self, request: GenerationRequest) -> None: ...

    def generate(self, request: GenerationRequest) -> Iterator[Event]: ...

    def token_text(self, token_id: int) -> str: ...


class SchedulerError(Exception):
    """Base of the errors a ticket can raise on the asyncio side."""


class QueueFull(SchedulerError):
    """The waiting queue is at capacity; ``retry_after`` is a hint in whole seconds."""

    def __init__(self, depth: int, retry_after: int) -> None:
        super().__init__(f"the request queue is full ({depth} waiting); retry later")
        self.retry_after = retry_after


class EngineNotReady(SchedulerError):
    """The engine is still loading, failed to load, or the scheduler has stopped."""

    def __init__(self, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(SchedulerError):
    """The ticket ran past its deadline (waiting plus generating)."""


class GenerationFailed(SchedulerError):
    """``engine.generate`` raised; the original exception is ``__cause__``."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"generation failed: {type(error).__name__}: {error}")
        self.index = index
        self.error = error


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for /health and /metrics."""

    state: str
    queue_depth: int
    active: int
    max_queue: int
    completed: int
    failed: int
    cancelled: int


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
    _scheduler: Scheduler
    _events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _done: bool = False

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
            self._scheduler._forget(self)
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
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()


class Scheduler:
    """Runs an engine on its own thread and serves tickets from a bounded FIFO queue."""

    def __init__(
        self,
        engine_factory: Callable[[], EngineLike],
        *,
        max_queue: int = 64,
        request_timeout: float = 600.0,
        name: str = "mtplx-engine",
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self._factory = engine_factory
        self._name = name
        self._pending: collections.deque[Ticket] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._engine: EngineLike | None = None
        self._state = "created"
        self._stopping = False
        self._active: Ticket | None = None
        self.load_error: BaseException | None = None
        self._ready = threading.Event()
        self._completed = self._failed = self._cancelled = 0
        self._mean_seconds = 5.0  # running mean of ticket durations, for Retry-After

    @classmethod
    def from_engine(cls, engine: EngineLike, **kwargs: Any) -> Scheduler:
        """A scheduler around an engine built already; from now on the worker thread is its
        only user."""
        return cls(lambda: engine, **kwargs)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker thread; it loads the engine, then serves. Idempotent."""
        with self._cond:
            if self._thread is not None:
                return
            self._state = "loading"
            # Daemon: a stuck model load must not keep the process alive at exit.
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel waiting tickets, stop the running one at its next event, join the thread."""
        with self._cond:
            self._stopping = True
            pending, self._pending = list(self._pending), collections.deque()
            if self._active is not None:
                self._active._cancelled.set()
            self._cond.notify_all()
        for ticket in pending:
            ticket._deliver(EngineNotReady("the server is shutting down"))
        if self._thread is not None:
            self._thread.join(timeout)
        self._state = "stopped"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is loaded (True) or loading failed / timed out (False)."""
        self._ready.wait(timeout)
        return self._state == "ready"

    @property
    def state(self) -> str:
        """created | loading | ready | failed | stopped."""
        return self._state

    @property
    def engine(self) -> EngineLike:
        """The loaded engine (read-only attributes are safe to use from any thread)."""
        if self._engine is None:
            raise self._not_ready()
        return self._engine

    # -- introspection --------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        """Tickets waiting for the engine."""
        return len(self._pending)

    @property
    def active(self) -> int:
        """Tickets the engine is running now (0 or 1 until batching lands)."""
        return 0 if self._active is None else 1

    def stats(self) -> SchedulerStats:
        """Counters for /health and /metrics."""
        with self._cond:
            return SchedulerStats(
                state=self._state,
                queue_depth=len(self._pending),
                active=self.active,
                max_queue=self.max_queue,
                completed=self._completed,
                failed=self._failed,
                cancelled=self._cancelled,
            )

    # -- asyncio side ---------------------------------------------------------------------

    def submit(
        self,
        requests: GenerationRequest | Sequence[GenerationRequest],
        *,
        timeout: float | None = None,
    ) -> Ticket:
        """Queue one ticket; call from the event loop that will iterate it.

        Each request is checked with ``engine.validate`` first (ValueError propagates, before
        any queueing). Raises ``EngineNotReady`` while loading and ``QueueFull`` at capacity.
        """
        if isinstance(requests, GenerationRequest):
            requests = (requests,)
        requests = tuple(requests)
        if not requests:
            raise ValueError("a ticket needs at least one request")
        engine = self.engine
        for request in requests:
            # validate is a pure check (no MLX work), so it is safe off the engine thread.
            engine.validate(request)
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + (timeout or self.request_timeout)
        ticket = Ticket(requests=requests, deadline=deadline, _loop=loop, _scheduler=self)
        with self._cond:
            if self._stopping:
                raise EngineNotReady("the server is shutting down")
            # While the engine is idle the head of the queue is about to run, not waiting.
            capacity = self.max_queue + (1 if self._active is None else 0)
            if len(self._pending) >= capacity:
                raise QueueFull(len(self._pending), self._retry_after())
            self._pending.append(ticket)
            self._cond.notify()
        return ticket

    def _retry_after(self) -> int:
        return max(1, min(60, math.ceil(self._mean_seconds * (len(self._pending) + 1))))

    def _not_ready(self) -> EngineNotReady:
        if self._state == "failed":
            return EngineNotReady(f"the model failed to load: {self.load_error}")
        if self._state == "stopped" or self._stopping:
            return EngineNotReady("the server is shutting down")
        return EngineNotReady("the model is loading", retry_after=5)

    def _forget(self, ticket: Ticket) -> None:
        """A cancelled ticket leaves the queue at once, so queue depth stays honest."""
        with self._cond:
            try:
                self._pending.remove(ticket)
                self._cancelled += 1
            except ValueError:
                pass  # running (the worker will see the flag) or already finished

    # -- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            engine = self._factory()
        except BaseException as exc:  # report any load failure through /health
            log.exception("engine failed to load")
            self.load_error = exc
            self._state = "failed"
            self._ready.set()
            return
        self._engine = engine
        self._state = "ready"
        self._ready.set()
        while True:
            tickets = self._take_tickets()
            if not tickets:
                return
            for ticket in tickets:
                self._serve(engine, ticket)

    def _take_tickets(self) -> list[Ticket]:
        """Block for the next ticket(s); [] when stopping. The batching seam."""
        with self._cond:
            while not self._pending and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return []
            ticket = self._pending.popleft()
            self._active = ticket
            return [ticket]

    def _serve(self, engine: EngineLike, ticket: Ticket) -> None:
        started = time.monotonic()
        outcome = "completed"
        try:
            for index, request in enumerate(ticket.requests):
                outcome = self._serve_one(engine, ticket, index, request)
                if outcome != "completed":
                    break
        finally:
            elapsed = time.monotonic() - started
            with self._cond:
                self._active = None
                if outcome == "completed":
                    self._completed += 1
                    self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * elapsed
                elif outcome == "failed":
                    self._failed += 1
                else:
                    self._cancelled += 1
            ticket._deliver(_END)

    def _serve_one(
        self, engine: EngineLike, ticket: Ticket, index: int, request: GenerationRequest
    ) -> str:
        """Run one request of a ticket; returns completed | cancelled | failed."""
        if ticket._cancelled.is_set():
            return "cancelled"
        generator = None
        try:
            generator = engine.generate(request)
            for event in generator:
                # Checked between events: the engine yields at least once a cycle, so a
                # cancelled or late request stops within one cycle.
                if ticket._cancelled.is_set():
                    return "cancelled"
                if time.monotonic() > ticket.deadline:
                    ticket._deliver(RequestTimeout("the request timed out"))
                    return "cancelled"
                ticket._deliver((index, event))
                if isinstance(event, FinishEvent):
                    return "completed"
            ticket._deliver(GenerationFailed(index, RuntimeError("engine ended without finish")))
            return "failed"
        except Exception as exc:  # one request's failure must not take the worker down
            log.exception("generation failed")
            failure = GenerationFailed(index, exc)
            failure.__cause__ = exc
            ticket._deliver(failure)
            return "failed"
        finally:
            if generator is not None and hasattr(generator, "close"):
                try:
                    generator.close()  # the engine releases this sequence's state
                except Exception:
                    log.exception("closing the generator failed")
