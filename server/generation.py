"""Running one HTTP request's generations through the bridge: admission (bridge errors
to HTTP errors), collecting results for a non-streaming reply while watching for the client
to go away, and the usage / speculative statistics every reply carries."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from mtplx.request import (
    FinishEvent,
    GenerationRequest,
    GenerationStats,
    PromptLogprob,
    TokenEvent,
)
from server.bridge_errors import (
    BridgeError,
    EngineNotReady,
    GenerationFailed,
    QueueFull,
    RequestTimeout,
    ShuttingDown,
)
from server.engine_bridge import EngineBridge
from server.errors import APIError, from_value_error
from server.ticket import Ticket

__all__ = [
    "ChoiceResult",
    "ClientDisconnected",
    "collect",
    "error_for",
    "run_until_disconnect",
    "speculative_summary",
    "submit",
    "usage",
]

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the reply was ready."""


async def submit(
    bridge: EngineBridge,
    requests: Sequence[GenerationRequest],
    aliases: Mapping[str, str] | None = None,
) -> Ticket:
    """Prepare the requests (grammars compiled off the event loop) and queue them as one
    ticket, or raise the APIError the client should see."""
    try:
        await bridge.prepare(requests)
        return bridge.submit(requests)
    except QueueFull as exc:
        raise APIError(
            429, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}
        ) from exc
    except ShuttingDown as exc:
        raise APIError(503, str(exc), code="server_shutting_down") from exc
    except EngineNotReady as exc:
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        raise APIError(503, str(exc), code="model_not_ready", headers=headers) from exc
    except ValueError as exc:  # engine.prepare, engine.validate
        raise from_value_error(exc, aliases) from exc


def error_for(exc: BridgeError) -> APIError:
    """The APIError for a failure that happens after admission."""
    if isinstance(exc, RequestTimeout):
        return APIError(504, "The request timed out.", code="timeout")
    if isinstance(exc, ShuttingDown):
        return APIError(503, str(exc), code="server_shutting_down")
    if isinstance(exc, EngineNotReady):
        return APIError(503, str(exc), code="model_not_ready")
    if isinstance(exc, GenerationFailed):
        if isinstance(exc.error, ValueError):  # the engine found a bad value late: still 400
            return from_value_error(exc.error)
        return APIError(500, str(exc), code="generation_failed")
    return APIError(500, str(exc))


@dataclass
class ChoiceResult:
    """Everything one choice produced."""

    index: int
    text: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    stats: GenerationStats | None = None
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None  # when the prompt was scored


async def collect(
    ticket: Ticket, num_choices: int, on_first_token: Callable[[], None] | None = None
) -> list[ChoiceResult]:
    """Read a ticket to the end; raises the ticket's BridgeError."""
    results = [ChoiceResult(index=i) for i in range(num_choices)]
    first = True
    async with ticket:
        async for index, event in ticket:
            result = results[index]
            if isinstance(event, TokenEvent):
                if first and on_first_token is not None:
                    on_first_token()
                first = False
                result.text += event.text
                result.tokens.append(event)
            elif isinstance(event, FinishEvent):
                result.text += event.text  # the tail the detokenizer held back
                result.finish_reason = event.finish_reason
                result.stop_sequence = event.stop_sequence
                result.stats = event.stats
                result.prompt_logprobs = event.prompt_logprobs
    return results


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (or never comes).
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it (which cancels
    its ticket, freeing the engine) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def speculative_summary(stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """The ``"mtplx"`` block: speculative counters and engine seconds (prefill, draft,
    verify) summed over choices."""
    drafts = sum(s.num_drafts for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    width = max((len(s.accepted_per_position) for s in stats), default=0)
    per_position = [
        sum(s.accepted_per_position[i] for s in stats if i < len(s.accepted_per_position))
        for i in range(width)
    ]
    drafted_width = max((len(s.drafted_per_position) for s in stats), default=0)
    drafted_per_position = [
        sum(s.drafted_per_position[i] for s in stats if i < len(s.drafted_per_position))
        for i in range(drafted_width)
    ]
    return {
        "cycles": sum(s.num_cycles for s in stats),
        "drafts": drafts,
        "drafted": drafted,
        "accepted": accepted,
        "recovered": sum(s.num_recovered for s in stats),
        "bonus": sum(s.num_bonus for s in stats),
        "accepted_per_position": per_position,
        "drafted_per_position": drafted_per_position,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": (accepted + drafts) / drafts if drafts else 1.0,
        "prefill_s": round(sum(s.prefill_time for s in stats), 6),
        "draft_s": round(sum(s.draft_time for s in stats), 6),
        "verify_s": round(sum(s.verify_time for s in stats), 6),
    }


def usage(prompt_tokens: int, stats: Sequence[GenerationStats]) -> dict[str, Any]:
    """OpenAI usage: the prompt counted once per prompt, completions summed over choices.
    ``cached_tokens``: the prompt tokens the prefix cache served (with several choices of a
    prompt, their share of the choices' prompt tokens)."""
    completion = sum(s.completion_tokens for s in stats)
    fed = sum(s.prompt_tokens for s in stats)
    cached = round(prompt_tokens * sum(s.cached_tokens for s in stats) / fed) if fed else 0
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def now() -> int:
    """``created`` timestamp."""
    return int(time.time())
