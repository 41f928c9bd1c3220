"""What the generation routes share: ids and the stream-or-collect tail of a request."""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask
from starlette.requests import Request

from mtplx.request import GenerationStats
from server.bridge_errors import BridgeError
from server.context import AppContext
from server.errors import APIError
from server.generation import (
    ChoiceResult,
    ClientDisconnected,
    collect,
    error_for,
    run_until_disconnect,
    speculative_summary,
    submit,
    usage,
)
from server.params import aliases_for, build_requests, check_common
from server.prompts import (
    Prompt,
    chat_prompt,
    check_prompt_size,
    check_template_kwargs,
    in_tokenizer_thread,
)
from server.request_log import endpoint_label
from server.schemas import ChatCompletionRequest
from server.streaming import (
    ChunkFormatter,
    EventFormat,
    OpenAIChunkEvents,
    sse_response,
    stream_events,
)
from server.ticket import Ticket
from server.tools import ToolPlan, call_style, plan_tools, render_conversation, reply_grammar

__all__ = ["chat_prompt_for", "new_id", "respond", "start_chat"]

BuildReply = Callable[[list[ChoiceResult], dict[str, int], dict[str, Any]], dict[str, Any]]


async def chat_prompt_for(
    ctx: AppContext, body: ChatCompletionRequest, *, continue_final: bool = False
) -> tuple[Prompt, ToolPlan | None]:
    """The prompt of a chat request and how it uses tools: the checks that need no
    tokenizer, the tool plan, the conversation rendered for the chat template (tools in it,
    ``chat_template_kwargs`` passed), tokenized off the event loop, and how the reply's
    thinking is told from its answer (``Prompt.reasoning``). count_tokens stops here;
    generation goes on in ``start_chat``.

    ``reasoning_effort`` none / minimal is ``enable_thinking: false`` (unless
    ``chat_template_kwargs`` says otherwise). A constrained reply (a grammar:
    ``response_format``, a required tool call) is all answer: the template is asked not to
    think (``enable_thinking: false``), a thinking block the prompt still opens is closed
    in the prompt, and the reply is not split."""
    engine = ctx.engine()
    check_common(body, ctx.settings, ctx.model_names())
    check_prompt_size(body, engine.context_length)
    plan = plan_tools(body, engine.tokenizer)
    kwargs = check_template_kwargs(body.chat_template_kwargs)
    if body.reasoning_effort in ("none", "minimal"):  # chat_template_kwargs win
        kwargs.setdefault("enable_thinking", False)
    parser = ctx.reasoning_parser()
    constrained = parser is not None and reply_grammar(body, plan) is not None
    if constrained:
        if kwargs.get("enable_thinking") is True:
            raise APIError(
                400,
                "a constrained reply (response_format, a required tool call) cannot think: "
                "send enable_thinking false or no constraint",
                param="chat_template_kwargs.enable_thinking",
                code="invalid_value",
            )
        kwargs["enable_thinking"] = False
    conversation, tools = render_conversation(body.messages, plan, call_style(engine.tokenizer))
    render = functools.partial(chat_prompt, reply_prefix=parser is not None)
    prompt = await in_tokenizer_thread(
        render, engine.tokenizer, body.messages, continue_final, conversation, tools, kwargs
    )
    if parser is not None:
        reply = parser.reply(prompt.reply_prefix or "")
        if not constrained:
            prompt = dataclasses.replace(prompt, reasoning=reply)
        elif reply.opened:  # a template that always thinks: the prompt closes it
            ids = prompt.token_ids + list(parser.close_ids)
            prompt = dataclasses.replace(prompt, token_ids=ids)
    return prompt, plan


async def start_chat(
    ctx: AppContext, body: ChatCompletionRequest, *, continue_final: bool = False
) -> tuple[Prompt, ToolPlan | None, Ticket]:
    """The chat path every chat-shaped API shares (chat completions, Anthropic Messages,
    Responses): the prompt and tool plan, one GenerationRequest per choice constrained by
    the tool plan or the request's own grammar, admission."""
    prompt, plan = await chat_prompt_for(ctx, body, continue_final=continue_final)
    requests = build_requests(body, [prompt], ctx.engine(), ctx.settings, reply_grammar(body, plan))
    return prompt, plan, await submit(ctx.bridge, requests, aliases_for(body))


def new_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` ids."""
    return f"{prefix}-{uuid.uuid4().hex}"


async def respond(
    request: Request,
    ctx: AppContext,
    ticket: Ticket,
    *,
    num_choices: int,
    prompt_tokens: int,
    stream: bool,
    build_reply: BuildReply,
    include_usage: bool = False,
    formatter: ChunkFormatter | None = None,
    events: EventFormat | None = None,
) -> Response:
    """Stream the ticket as SSE, or collect it into one JSON reply. The stream's events come
    from ``events``, or for OpenAI's chunk APIs from ``formatter`` (with the usage chunk when
    ``include_usage``)."""
    endpoint = endpoint_label(request.scope)
    started = getattr(request.state, "started", time.perf_counter())

    def first_token() -> None:
        ctx.metrics.observe_ttft(endpoint, time.perf_counter() - started)

    def done(stats: Sequence[GenerationStats]) -> None:
        ctx.metrics.observe_generation(prompt_tokens, stats)
        request.state.usage = usage(prompt_tokens, stats)

    if stream:
        if events is None:
            assert formatter is not None, "a streaming reply needs a formatter or events"
            events = OpenAIChunkEvents(formatter, include_usage)
        stream_body = stream_events(
            ticket,
            events,
            prompt_tokens=prompt_tokens,
            on_first_token=first_token,
            on_token=ctx.metrics.observe_sent_tokens,
            on_done=done,
            on_disconnect=lambda: setattr(request.state, "disconnected", True),
        )
        response = sse_response(stream_body)
        # If the client leaves before the body iterator starts, its cleanup never runs;
        # this runs after the response either way and frees the engine.
        response.background = BackgroundTask(ticket.cancel)
        return response

    try:
        results = await run_until_disconnect(request, collect(ticket, num_choices, first_token))
    except ClientDisconnected:
        request.state.disconnected = True
        return Response(status_code=499)
    except BridgeError as exc:
        raise error_for(exc) from exc
    stats = [r.stats for r in results if r.stats is not None]
    done(stats)
    ctx.metrics.observe_sent_tokens(sum(s.completion_tokens for s in stats))
    reply = build_reply(results, usage(prompt_tokens, stats), speculative_summary(stats))
    return JSONResponse(reply)
