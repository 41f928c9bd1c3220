"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API (errors in
Anthropic's shape, by path: ``server.errors``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from server.anthropic_api import (
    CountTokensRequest,
    MessagesRequest,
    message_reply,
    new_message_id,
    to_chat_request,
)
from server.anthropic_stream import AnthropicEvents
from server.body import parse_json_body
from server.context import get_context
from server.generation import ChoiceResult
from server.routes.common import chat_prompt_for, respond, start_chat
from server.tools import split_reply

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    """Anthropic Messages, streaming or not, with or without tools. The
    ``anthropic-version`` header is accepted whatever its value: there is one version of
    this API here."""
    ctx = get_context(request)
    body = await parse_json_body(
        request, MessagesRequest, ctx.item_limits("messages", "tools"), ctx.max_json_len()
    )
    ctx.engine()  # 503 while the model loads, before any other check
    chat = to_chat_request(body)
    prompt, plan, ticket = await start_chat(ctx, chat, continue_final=True)
    model = ctx.model_id()
    message_id = new_message_id()
    input_tokens = len(prompt.token_ids)

    def build_reply(
        results: list[ChoiceResult], usage: dict[str, Any], mtplx: dict[str, Any]
    ) -> dict[str, Any]:
        result = results[0]
        finish = (result.finish_reason, result.stop_sequence)
        text, thinking = result.text, None
        if prompt.reasoning is not None:  # the thinking apart; tool calls are in the answer
            split = prompt.reasoning.split([result.text])
            thinking, text = split.reasoning, split.content
        reply = split_reply(text, plan)
        return message_reply(message_id, model, reply, finish, usage, mtplx, thinking)

    return await respond(
        request,
        ctx,
        ticket,
        num_choices=1,
        prompt_tokens=input_tokens,
        stream=body.stream,
        build_reply=build_reply,
        events=AnthropicEvents(message_id, model, input_tokens, plan, prompt.reasoning),
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """``{"input_tokens": N}``: the prompt's length under the chat template, tools
    included, as /v1/messages would feed it."""
    ctx = get_context(request)
    limits = ctx.item_limits("messages", "tools")
    body = await parse_json_body(request, CountTokensRequest, limits, ctx.max_json_len())
    ctx.engine()  # 503 while the model loads, before any other check
    prompt, _ = await chat_prompt_for(ctx, to_chat_request(body), continue_final=True)
    return {"input_tokens": len(prompt.token_ids)}
