"""The engine bridge: the asyncio facade over the one engine thread, with continuous batching.

MLX work stays on one thread (docs/architecture.md): a dedicated worker thread owns the engine:
it builds it (``engine_factory`` runs on that thread, so loading and generating share it),
then runs the engine's step loop. Every step it admits waiting tickets' requests into the
running batch while the engine has room (``max_num_seqs``), drops the rows of cancelled or
late tickets, runs one ``engine.step()`` and hands each event to its ticket. The asyncio side
submits tickets and reads their events from a per-ticket ``asyncio.Queue`` that the worker
feeds with ``loop.call_soon_threadsafe``.

A ticket is one HTTP request: one or more ``GenerationRequest`` (``n`` choices, several
prompts), each a row of the batch, admitted in order as rows free up; tickets are admitted
first come, first served. Cancelling a ticket (client gone, timeout) removes it from the
queue, or drops its rows before the next step. An exception in one row fails that ticket
alone; the other rows of the batch go on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mtplx.grammar import grammar_thread
from mtplx.prefix_cache import PrefixCacheStats
from mtplx.request import FinishEvent, GenerationRequest, TokenEvent
from server.bridge_errors import (
    EngineNotReady,
    GenerationFailed,
    QueueFull,
    RequestTimeout,
    ShuttingDown,
)
from server.ticket import _END, Ticket

__all__ = ["BridgeStats", "EngineBridge", "EngineLike", "KVUsage"]

log = logging.getLogger(__name__)

Event = TokenEvent | FinishEvent


class EngineLike(Protocol):
    """The part of ``mtplx.engine.Engine`` the bridge and the server use."""

    tokenizer: Any
    model_name: str
    vocab_size: int
    context_length: int
    default_drafter: str
    default_depth: int | None
    available_drafters: tuple[str, ...]

    max_num_seqs: int
    running: Sequence[Any]  # the sequences in the batch

    @property
    def has_room(self) -> bool: ...

    def has_room_for(self, request: GenerationRequest) -> bool: ...

    def validate(self, request: GenerationRequest) -> None: ...

    def prepare(self, request: GenerationRequest) -> None: ...

    @property
    def num_orphan_rows(self) -> int: ...

    def add(self, request: GenerationRequest, tag: object = None) -> Any: ...

    def step(self) -> list[tuple[Any, Event | BaseException]]: ...

    def abort(self, sequence: Any) -> None: ...

    def token_text(self, token_id: int) -> str: ...


@dataclass(frozen=True)
class BridgeStats:
    """A snapshot for /health and /metrics."""

    state: str
    queue_depth: int
    active: int  # tickets with rows in the batch
    running: int  # sequences (rows) in the batch
    max_queue: int
    completed: int
    failed: int
    cancelled: int


@dataclass(frozen=True)
class KVUsage:
    """The engine's KV memory, published by the worker thread after each admission and
    step (the stores change under a reader on another thread): ``bytes`` held by the
    running rows' stores, ``max_bytes`` the admission bound (None: no bound)."""

    bytes: int
    max_bytes: int | None


class EngineBridge:
    """Runs an engine on its own thread and serves tickets from a bounded FIFO queue."""

    def __init__(
        self,
        engine_factory: Callable[[], EngineLike],
        *,
        max_queue: int = 64,
        request_timeout: float = 600.0,
        max_backlog: int = 4096,
        name: str = "mtplx-engine",
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        # A ticket whose reader falls this many events behind is cancelled: its events would
        # otherwise pile up in memory without bound (a client that stopped reading).
        self.max_backlog = max_backlog
        self.slow_readers = 0  # tickets cancelled for it, for /metrics
        self._factory = engine_factory
        self._name = name
        self._pending: collections.deque[Ticket] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._engine: EngineLike | None = None
        self._state = "created"
        self._stopping = False
        self._draining = False
        self._active: list[Ticket] = []  # tickets with rows in the batch (worker thread)
        self.load_error: BaseException | None = None
        self.failure: EngineNotReady | None = None  # set by ``fail``
        self._ready = threading.Event()
        self._completed = self._failed = self._cancelled = 0
        self._mean_seconds = 5.0  # running mean of ticket durations, for Retry-After
        self.num_steps = 0  # engine steps run, for /metrics
        self.step_rows_total = 0  # rows over all steps (mean batch size = this / num_steps)
        self.last_step_seconds = 0.0
        # Rows the engine holds for no request, read on the worker thread after each admission
        # and step: non-zero means requests cannot be admitted as they should (/health).
        self.orphan_rows = 0
        # The engine's KV memory (None: not loaded, or an engine that does not say), for
        # /health and /metrics; written by the worker thread only.
        self.kv: KVUsage | None = None
        self._preparing = 0  # requests waiting for the grammar thread (event loop only)
        # Called on the worker thread after each step with (rows, tokens, seconds): metrics.
        self.step_observer: Callable[[int, int, float], None] | None = None

    @classmethod
    def from_engine(cls, engine: EngineLike, **kwargs: Any) -> EngineBridge:
        """A bridge around an engine built already; from now on the worker thread is its
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
        """End every ticket with ``ShuttingDown`` now (waiting and running: a step can run
        for seconds, and a reader left waiting for it past uvicorn's graceful shutdown is
        cut without its error event), stop the running ones' rows at the next step, join
        the thread (unless the model is still loading: a load cannot be interrupted). Safe
        from any thread."""
        with self._cond:
            self._stopping = True
            tickets = self._every_ticket()
            self._pending = collections.deque()
            for ticket in self._active:
                ticket._cancelled.set()
            self._cond.notify_all()
        for ticket in tickets:
            # The worker's own ShuttingDown for a running ticket comes later, to a reader
            # that has ended (an error ends the iteration).
            ticket._deliver(ShuttingDown())
        # A model still loading cannot be interrupted: its thread (a daemon) sees the stop
        # once loaded; waiting for it would hold a stopping server for the whole load.
        if self._thread is not None and self._engine is not None:
            self._thread.join(timeout)
        if self.failure is None:
            self._state = "stopped"

    def drain(self, timeout: float) -> threading.Thread:
        """Graceful shutdown: refuse new tickets now, let running and waiting ones finish for
        up to ``timeout`` seconds, then ``stop`` (the rest end with an error). Returns the
        thread that waits; it stops the bridge when all tickets are done or time is up."""

        def wait_then_stop() -> None:
            deadline = time.monotonic() + timeout
            with self._cond:
                while (self._active or self._pending) and time.monotonic() < deadline:
                    self._cond.wait(min(0.1, max(deadline - time.monotonic(), 0.0)))
            self.stop()

        with self._cond:
            self._draining = True
            if self._state == "ready":
                self._state = "draining"
        thread = threading.Thread(target=wait_then_stop, name="mtplx-drain", daemon=True)
        thread.start()
        return thread

    def fail(self, error: EngineNotReady) -> None:
        """The engine can no longer run (a pipeline rank was lost): every ticket ends with
        ``error`` now, new ones are refused with it, the worker thread stops. Safe from any
        thread, also while the worker thread is blocked inside a step."""
        with self._cond:
            self.failure = error
            self._state = "failed"
            self._stopping = True
            tickets = self._every_ticket()
            self._active.clear()
            self._pending.clear()
            self._failed += len(tickets)
            self._cond.notify_all()
        for ticket in tickets:
            ticket._deliver(error)
            ticket._deliver(_END)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is loaded (True) or loading failed / timed out (False)."""
        self._ready.wait(timeout)
        return self._state == "ready"

    @property
    def state(self) -> str:
        """created | loading | ready | draining | failed | stopped."""
        return self._state

    @property
    def engine(self) -> EngineLike:
        """The loaded engine (read-only attributes are safe to use from any thread)."""
        if self._engine is None:
            raise self._not_ready()
        return self._engine

    # -- introspection --------------------------------------------------------------------

    @property
    def prefix_cache(self) -> PrefixCacheStats | None:
        """The engine's prefix-cache counters (None: no cache, or not loaded yet)."""
        cache = getattr(self._engine, "prefix_cache", None)
        return None if cache is None else cache.stats

    @property
    def queue_depth(self) -> int:
        """Tickets waiting for the engine."""
        return len(self._pending)

    @property
    def active(self) -> int:
        """Tickets with rows in the running batch."""
        return len(self._active)

    @property
    def running(self) -> int:
        """Sequences (rows) in the running batch."""
        engine = self._engine
        return 0 if engine is None else len(engine.running)

    def stats(self) -> BridgeStats:
        """Counters for /health and /metrics."""
        with self._cond:
            return BridgeStats(
                state=self._state,
                queue_depth=len(self._pending),
                active=self.active,
                running=self.running,
                max_queue=self.max_queue,
                completed=self._completed,
                failed=self._failed,
                cancelled=self._cancelled,
            )

    # -- asyncio side ---------------------------------------------------------------------

    async def prepare(self, requests: Sequence[GenerationRequest]) -> None:
        """The admission work that must hold up neither the event loop nor the batch
        (grammars checked and compiled), on the grammar thread; call before ``submit``.
        Raises what ``engine.prepare`` raises (ValueError for a bad grammar)."""
        engine = self.engine
        specs = {request.grammar: request for request in requests if request.grammar is not None}
        if not specs:
            return
        # Requests waiting for the grammar thread count against the queue like waiting
        # tickets: a flood of slow grammars is refused, not piled up.
        if self._preparing >= self.max_queue:
            raise QueueFull(self._preparing, self._retry_after())
        self._preparing += 1
        try:
            for request in specs.values():
                await asyncio.wrap_future(grammar_thread().submit(engine.prepare, request))
        finally:
            self._preparing -= 1

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
        ticket = Ticket(requests=requests, deadline=deadline, _loop=loop, _bridge=self)
        with self._cond:
            if self.failure is not None:
                raise self.failure
            if self._stopping or self._draining:
                raise ShuttingDown()
            # Tickets the batch has room for start at the next step: they are not waiting.
            room = max(engine.max_num_seqs - len(engine.running), 0)
            if len(self._pending) - room >= self.max_queue:
                raise QueueFull(len(self._pending), self._retry_after())
            self._pending.append(ticket)
            self._cond.notify()
        return ticket

    def _retry_after(self) -> int:
        """Seconds until the waiting tickets have run: they start ``max_num_seqs`` at a
        time, each batch taking the mean ticket's duration (1 to 60)."""
        engine = self._engine
        rows = max(1, getattr(engine, "max_num_seqs", 1) if engine is not None else 1)
        batches = math.ceil((len(self._pending) + 1) / rows)
        return max(1, min(60, math.ceil(self._mean_seconds * batches)))

    def _not_ready(self) -> EngineNotReady:
        if self.failure is not None:
            return self.failure
        if self._state == "failed":
            return EngineNotReady(f"the model failed to load: {self.load_error}")
        if self._state in ("stopped", "draining") or self._stopping or self._draining:
            return ShuttingDown()
        return EngineNotReady("the model is loading", retry_after=5)

    def _every_ticket(self) -> list[Ticket]:
        """The running tickets, then the waiting ones not yet running, each once (a ticket
        with rows in the batch stays queued until its last request is admitted). The
        caller holds ``_cond``."""
        return list(self._active) + [t for t in self._pending if t not in self._active]

    def _forget(self, ticket: Ticket) -> None:
        """A cancelled ticket that has not started leaves the queue at once, so queue depth
        stays honest; one with rows in the batch is ended by the worker before its next
        step."""
        with self._cond:
            if ticket._unfinished < 0 and ticket in self._pending:
                self._pending.remove(ticket)
                self._cancelled += 1

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
        self._publish_kv(engine)  # the idle engine's, before any request
        with self._cond:
            if not self._stopping:  # stopped while loading: "stopped" stays
                self._state = "ready"
        self._ready.set()
        while self._admit(engine):
            self._drop_finished_tickets(engine)
            self.orphan_rows = engine.num_orphan_rows
            self._publish_kv(engine)
            if not engine.running:
                continue
            started = time.monotonic()
            try:
                events = engine.step()
            except Exception as exc:  # a bug in the step itself: fail what was running
                log.exception("engine step failed")
                events = [(sequence, exc) for sequence in list(engine.running)]
                for sequence, _ in events:
                    engine.abort(sequence)
            self.last_step_seconds = time.monotonic() - started
            self.num_steps += 1
            rows = len(engine.running) + sum(isinstance(e, FinishEvent) for _, e in events)
            self.step_rows_total += rows
            if self.step_observer is not None:
                tokens = sum(isinstance(e, TokenEvent) for _, e in events)
                self.step_observer(rows, tokens, self.last_step_seconds)
            for sequence, event in events:
                self._deliver(engine, sequence, event)
            for ticket in {sequence.tag[0]: None for sequence, _ in events}:
                ticket._flush()  # the step's events, in one hand-over per ticket
            self._publish_kv(engine)

    def _publish_kv(self, engine: EngineLike) -> None:
        """Read the engine's KV memory on its own thread for the readers of ``kv``."""
        held = getattr(engine, "kv_nbytes", None)
        if isinstance(held, int):
            self.kv = KVUsage(held, getattr(engine, "max_kv_bytes", None))

    def _admit(self, engine: EngineLike) -> bool:
        """Block while there is nothing to do; move waiting tickets' requests into the
        batch while it has room. False when stopping."""
        with self._cond:
            while not self._pending and not engine.running and not self._stopping:
                self._cond.wait()
            stopping = self._stopping
        if stopping:
            for ticket in list(self._active):
                self._finish(engine, ticket, "cancelled", ShuttingDown())
            return False
        with self._cond:
            # First come, first served: a request whose prompt's KV does not fit yet waits
            # at the head of the queue, and those behind it wait for it.
            while self._pending and engine.has_room_for(
                self._pending[0].requests[self._pending[0]._next]
            ):
                ticket = self._pending[0]
                if ticket._unfinished < 0:
                    ticket._unfinished = len(ticket.requests)
                    ticket._started = time.monotonic()
                    self._active.append(ticket)
                index = ticket._next
                try:
                    ticket._rows.append(engine.add(ticket.requests[index], (ticket, index)))
                except Exception as exc:  # a request the engine cannot start fails its ticket
                    log.exception("admission failed")
                    self._pending.popleft()
                    self._finish(engine, ticket, "failed", GenerationFailed(index, exc))
                    continue
                ticket._next += 1
                if ticket._next == len(ticket.requests):
                    self._pending.popleft()
        return True

    def _drop_finished_tickets(self, engine: EngineLike) -> None:
        """Drop the rows of cancelled tickets and of tickets past their deadline."""
        now = time.monotonic()
        for ticket in list(self._active):
            if ticket._sent - ticket._read > self.max_backlog:
                self.slow_readers += 1
                ticket._cancelled.set()
                log.warning("cancelled a request whose client stopped reading")
            if ticket._cancelled.is_set():
                self._finish(engine, ticket, "cancelled")
            elif now > ticket.deadline:
                self._finish(engine, ticket, "cancelled", RequestTimeout("the request timed out"))

    def _deliver(self, engine: EngineLike, sequence: Any, event: Event | BaseException) -> None:
        """Hand one step event to its ticket; finish the ticket with its last request."""
        ticket, index = sequence.tag
        if ticket not in self._active:
            return  # its ticket has ended (cancelled, failed) in this very step
        if isinstance(event, BaseException):
            failure = GenerationFailed(index, event)
            failure.__cause__ = event
            self._finish(engine, ticket, "failed", failure)
            return
        ticket._hold((index, event))  # handed over with the step's others (``_run``)
        if isinstance(event, FinishEvent):
            ticket._rows.remove(sequence)
            ticket._unfinished -= 1
            if ticket._unfinished == 0:
                self._finish(engine, ticket, "completed")

    def _abort_rows(self, engine: EngineLike, ticket: Ticket) -> None:
        for sequence in ticket._rows:
            engine.abort(sequence)
        ticket._rows.clear()

    def _finish(
        self,
        engine: EngineLike,
        ticket: Ticket,
        outcome: str,
        error: BaseException | None = None,
    ) -> None:
        """End a ticket: drop its rows and queue slot, count it, tell its reader."""
        ticket._flush()  # what it holds of this step goes first
        self._abort_rows(engine, ticket)
        with self._cond:
            if ticket in self._active:
                self._active.remove(ticket)
            if ticket in self._pending:
                self._pending.remove(ticket)
            if outcome == "completed":
                self._completed += 1
                elapsed = time.monotonic() - ticket._started
                self._mean_seconds = 0.8 * self._mean_seconds + 0.2 * elapsed
            elif outcome == "failed":
                self._failed += 1
            else:
                self._cancelled += 1
            self._cond.notify_all()
        if error is not None:
            ticket._deliver(error)
        ticket._deliver(_END)
