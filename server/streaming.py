"""Server-sent events: turn a ticket's events into OpenAI chunks as soon as the engine yields
them, end with the finish chunk(s), the optional usage chunk and ``data: [DONE]``.

Chat and completions differ only in chunk shape, supplied by a ``ChunkFormatter``. When the
client disconnects, sse-starlette cancels the body iterator; leaving ``async with ticket``
then cancels the ticket, so the engine drops the request within one cycle.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from sse_starlette import EventSourceResponse

from mtplx.request import FinishEvent, GenerationStats, TokenEvent
from mtplx.scheduler import SchedulerError, Ticket
from server.generation import error_for, speculative_summary, usage

__all__ = ["ChunkFormatter", "sse_response", "stream_chunks"]


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


def _data(chunk: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))}


def _all(chunks: Chunks) -> list[dict[str, str]]:
    """A formatter may answer one chunk, several (tool-call deltas) or none (text held
    back while it may be a tool call)."""
    if chunks is None:
        return []
    return [_data(chunk) for chunk in (chunks if isinstance(chunks, list) else [chunks])]


async def stream_chunks(
    ticket: Ticket,
    formatter: ChunkFormatter,
    *,
    prompt_tokens: int,
    include_usage: bool,
    on_first_token: Callable[[], None] | None = None,
    on_token: Callable[[], None] | None = None,
    on_done: Callable[[list[GenerationStats]], None] | None = None,
    on_disconnect: Callable[[], None] | None = None,
) -> AsyncIterator[dict[str, str]]:
    """SSE events for one ticket. A failure after the headers went out is sent as an
    ``{"error": ...}`` event (the status line is already 200) and the stream ends.
    ``on_token`` runs for every token sent; ``on_disconnect`` when the client leaves before
    the end."""
    ended = False
    try:
        async for event in _stream_chunks(
            ticket, formatter, prompt_tokens, include_usage, on_first_token, on_token, on_done
        ):
            yield event
        ended = True
    finally:
        if not ended and on_disconnect is not None:
            on_disconnect()


async def _stream_chunks(
    ticket: Ticket,
    formatter: ChunkFormatter,
    prompt_tokens: int,
    include_usage: bool,
    on_first_token: Callable[[], None] | None,
    on_token: Callable[[], None] | None,
    on_done: Callable[[list[GenerationStats]], None] | None,
) -> AsyncIterator[dict[str, str]]:
    stats: list[GenerationStats] = []
    begun: set[int] = set()
    first = True
    async with ticket:
        try:
            async for index, event in ticket:
                if index not in begun:
                    begun.add(index)
                    opening = formatter.begin(index)
                    if opening is not None:
                        yield _data(opening)
                if isinstance(event, TokenEvent):
                    if first and on_first_token is not None:
                        on_first_token()
                    first = False
                    # An empty piece is a character still incomplete: nothing to send,
                    # unless the client wants this token's logprob.
                    if on_token is not None:  # counted as it is handed to the transport
                        on_token()
                    if event.text or formatter.wants_logprobs:
                        for data in _all(formatter.token(index, event)):
                            yield data
                elif isinstance(event, FinishEvent):
                    stats.append(event.stats)
                    if event.text:
                        for data in _all(formatter.tail(index, event.text)):
                            yield data
                    for data in _all(formatter.finish(index, event.finish_reason)):
                        yield data
        except SchedulerError as exc:
            # The status line went out as 200: the error is an event, and the stream still
            # ends the way clients wait for.
            yield _data(error_for(exc).body())
            yield {"data": "[DONE]"}
            return
    if on_done is not None:
        on_done(stats)
    if include_usage:
        yield _data(formatter.usage(usage(prompt_tokens, stats), speculative_summary(stats)))
    yield {"data": "[DONE]"}


def let_streams_drain() -> None:
    """Keep sse-starlette from cutting streams the moment uvicorn is told to exit: the
    scheduler's drain ends them itself (a finish, or an error event), each with ``[DONE]``."""
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()


def sse_response(events: AsyncIterator[dict[str, str]]) -> EventSourceResponse:
    """The streaming response: ``\\n`` line endings (what most clients expect) and no
    proxy buffering."""
    return EventSourceResponse(
        events,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
