"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API (errors in
Anthropic's shape, by path: ``server.errors``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from server.anthropic_api import (
    AnthropicEvents,
    CountTokensRequest,
    MessagesRequest,
    message_reply,
    new_message_id,
    to_chat_request,
)
from server.body import parse_json_body
from server.context import get_context
from server.generation import ChoiceResult
from server.params import check_common
from server.prompts import chat_prompt, check_prompt_size, in_tokenizer_thread
from server.routes.common import respond, start_chat

router = APIRouter()


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    """Anthropic Messages, streaming or not. The ``anthropic-version`` header is accepted
    whatever its value: there is one version of this API here."""
    ctx = get_context(request)
    body = await parse_json_body(request, MessagesRequest)
    ctx.engine()  # 503 while the model loads, before any other check
    chat = to_chat_request(body)
    prompt, ticket = await start_chat(ctx, chat, continue_final=True)
    model = ctx.model_id()
    message_id = new_message_id()
    input_tokens = len(prompt.token_ids)

    def build_reply(
        results: list[ChoiceResult], usage: dict[str, Any], mtplx: dict[str, Any]
    ) -> dict[str, Any]:
        result = results[0]
        finish = (result.finish_reason, result.stop_sequence)
        return message_reply(message_id, model, result.text, finish, usage, mtplx)

    return await respond(
        request,
        ctx,
        ticket,
        num_choices=1,
        prompt_tokens=input_tokens,
        stream=body.stream,
        build_reply=build_reply,
        events=AnthropicEvents(message_id, model, input_tokens),
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> dict[str, int]:
    """``{"input_tokens": N}``: the prompt's length under the chat template, as
    /v1/messages would feed it."""
    ctx = get_context(request)
    body = await parse_json_body(request, CountTokensRequest)
    engine = ctx.engine()
    chat = to_chat_request(body)
    check_common(chat, ctx.settings, ctx.model_names())
    check_prompt_size(chat, engine.context_length)
    prompt = await in_tokenizer_thread(chat_prompt, engine.tokenizer, chat.messages, True)
    return {"input_tokens": len(prompt.token_ids)}
