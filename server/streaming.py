"""Server-sent events: turn a ticket's events into an API's stream events as soon as the
engine yields them. ``stream_events`` runs the loop; an ``EventFormat`` per API says what to
send (OpenAI chunks ending with ``data: [DONE]``, Anthropic's and the Responses API's named
events). Chat and completions differ only in chunk shape, supplied by a ``ChunkFormatter``.
When the client disconnects, sse-starlette cancels the body iterator; leaving ``async with
ticket`` then cancels the ticket, so the engine drops the request within one cycle. The
events of what the ticket has ready at once (a speculative step's tokens) leave in one
write: each write is a socket send and a client wake-up, the serving path's largest cost
per token.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from sse_starlette import EventSourceResponse, ServerSentEvent

from mtplx.request import FinishEvent, GenerationStats, TokenEvent
from server.bridge_errors import BridgeError
from server.errors import APIError
from server.generation import error_for, speculative_summary, usage
from server.ticket import Ticket

__all__ = [
    "DONE",
    "SSE",
    "ChunkFormatter",
    "EventFormat",
    "OpenAIChunkEvents",
    "data_event",
    "sse_response",
    "stream_events",
]


Chunks = dict[str, Any] | list[dict[str, Any]] | None


class ChunkFormatter(Protocol):
    """Builds the JSON chunks of one streaming reply. ``token``, ``tail`` and ``finish`` may
    answer several chunks or none (a reply with tools holds text back while it may be a
    tool call)."""

    wants_logprobs: bool

    def begin(self, index: int) -> dict[str, Any] | None:
        """The first chunk of a choice (chat: the role delta; completions: echo), or None."""
        ...

    def token(self, index: int, event: TokenEvent) -> Chunks:
        """A chunk carrying one token's text (and logprobs when asked)."""
        ...

    def tail(self, index: int, text: str) -> Chunks:
        """A chunk carrying text that belongs to no single token: the tail the detokenizer
        (or a possible stop-string prefix) held back until the choice ended."""
        ...

    def finish(self, index: int, reason: str) -> Chunks:
        """The last chunk of a choice, carrying finish_reason."""
        ...

    def usage(self, usage: dict[str, int], mtplx: dict[str, Any]) -> dict[str, Any]:
        """The usage chunk (``choices: []``) sent when ``include_usage`` is set."""
        ...


SSE = dict[str, str]  # one server-sent event: "data", and "event" when the API names them


class EventFormat(Protocol):
    """The SSE events of one streaming reply, per API. Each method returns the events to
    send at that point (possibly none)."""

    def opening(self, index: int) -> list[SSE]:
        """Before a choice's first event."""
        ...

    def token(self, index: int, event: TokenEvent) -> list[SSE]:
        """For one token."""
        ...

    def finish(self, index: int, event: FinishEvent) -> list[SSE]:
        """For a choice's finish (its held-back tail text, its stop reason)."""
        ...

    def closing(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> list[SSE]:
        """After every choice finished: usage and speculative statistics, the end marker."""
        ...

    def failure(self, error: APIError) -> list[SSE]:
        """A failure after the status line went out as 200; the stream ends after these."""
        ...


def data_event(chunk: dict[str, Any], event: str | None = None) -> SSE:
    """One SSE event carrying ``chunk`` as compact JSON (``event:`` line when named)."""
    sse = {"data": json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))}
    if event is not None:
        sse["event"] = event
    return sse


DONE: SSE = {"data": "[DONE]"}


def _all(chunks: Chunks) -> list[SSE]:
    """A formatter may answer one chunk, several (tool-call deltas) or none (text held
    back while it may be a tool call)."""
    if chunks is None:
        return []
    return [data_event(chunk) for chunk in (chunks if isinstance(chunks, list) else [chunks])]


class OpenAIChunkEvents:
    """OpenAI's chunk stream (chat and completions): ``data:`` chunks from a
    ``ChunkFormatter``, the usage chunk when ``include_usage``, then ``data: [DONE]``."""

    def __init__(self, formatter: ChunkFormatter, include_usage: bool) -> None:
        self.formatter = formatter
        self.include_usage = include_usage

    def opening(self, index: int) -> list[SSE]:
        chunk = self.formatter.begin(index)
        return [] if chunk is None else [data_event(chunk)]

    def token(self, index: int, event: TokenEvent) -> list[SSE]:
        # An empty piece is a character still incomplete: nothing to send, unless the
        # client wants this token's logprob.
        if event.text or self.formatter.wants_logprobs:
            return _all(self.formatter.token(index, event))
        return []

    def finish(self, index: int, event: FinishEvent) -> list[SSE]:
        events = _all(self.formatter.tail(index, event.text)) if event.text else []
        return [*events, *_all(self.formatter.finish(index, event.finish_reason))]

    def closing(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> list[SSE]:
        events = [data_event(self.formatter.usage(usage, mtplx))] if self.include_usage else []
        return [*events, DONE]

    def failure(self, error: APIError) -> list[SSE]:
        # The stream still ends the way clients wait for.
        return [data_event(error.body()), DONE]


def encode_event(sse: SSE) -> bytes:
    """One SSE event's bytes, as the response would write it (``\\n`` line endings)."""
    return ServerSentEvent(**sse, sep="\n").encode()


async def stream_events(
    ticket: Ticket,
    fmt: EventFormat,
    *,
    prompt_tokens: int,
    on_first_token: Callable[[], None] | None = None,
    on_token: Callable[[], None] | None = None,
    on_done: Callable[[list[GenerationStats]], None] | None = None,
    on_disconnect: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """The encoded SSE events for one ticket in the API's format, each write carrying what
    the ticket had ready at once (never waiting for more: an event leaves as soon as no
    other is ready behind it). A failure after the headers went out is sent as the
    format's failure events (the status line is already 200) and the stream ends.
    ``on_token`` runs for every token sent; ``on_disconnect`` when the client leaves before
    the end."""
    ended = False
    pending: list[bytes] = []
    try:
        async for event in _stream_events(
            ticket, fmt, prompt_tokens, on_first_token, on_token, on_done
        ):
            pending.append(encode_event(event))
            if not ticket.num_ready or ticket.cancelled:
                yield b"".join(pending)
                pending = []
        if pending:
            yield b"".join(pending)
        ended = True
    finally:
        if not ended and on_disconnect is not None:
            on_disconnect()


async def _stream_events(
    ticket: Ticket,
    fmt: EventFormat,
    prompt_tokens: int,
    on_first_token: Callable[[], None] | None,
    on_token: Callable[[], None] | None,
    on_done: Callable[[list[GenerationStats]], None] | None,
) -> AsyncIterator[SSE]:
    stats: list[GenerationStats] = []
    begun: set[int] = set()
    first = True
    async with ticket:
        try:
            async for index, event in ticket:
                if index not in begun:
                    begun.add(index)
                    for sse in fmt.opening(index):
                        yield sse
                if isinstance(event, TokenEvent):
                    if first and on_first_token is not None:
                        on_first_token()
                    first = False
                    if on_token is not None:  # counted as it is handed to the transport
                        on_token()
                    for sse in fmt.token(index, event):
                        yield sse
                elif isinstance(event, FinishEvent):
                    stats.append(event.stats)
                    for sse in fmt.finish(index, event):
                        yield sse
        except BridgeError as exc:
            for sse in fmt.failure(error_for(exc)):
                yield sse
            return
    if on_done is not None:
        on_done(stats)
    for sse in fmt.closing(usage(prompt_tokens, stats), speculative_summary(stats)):
        yield sse


def let_streams_drain() -> None:
    """Keep sse-starlette from cutting streams the moment uvicorn is told to exit: the
    bridge's drain ends them itself (a finish, or an error event), each with ``[DONE]``."""
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()


def sse_response(events: AsyncIterator[SSE] | AsyncIterator[bytes]) -> EventSourceResponse:
    """The streaming response: ``\\n`` line endings (what most clients expect) and no
    proxy buffering."""
    return EventSourceResponse(
        events,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
