"""POST /v1/responses: the OpenAI Responses API, stateless, with function tools."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from server.body import parse_json_body
from server.context import get_context
from server.errors import APIError
from server.generation import ChoiceResult
from server.responses_api import ResponsesRequest, renamed_for_responses, to_chat_request
from server.responses_output import ResponseBuilder, ResponsesEvents
from server.routes.common import respond, start_chat
from server.tools import split_reply

router = APIRouter()


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    """A model response to ``input`` (and ``instructions``), streamed as typed events or
    returned whole; with ``tools``, its function calls as ``function_call`` items."""
    ctx = get_context(request)
    body = await parse_json_body(
        request, ResponsesRequest, ctx.item_limits("input", "tools"), ctx.max_json_len()
    )
    ctx.engine()  # 503 while the model loads, before any other check
    chat = to_chat_request(body)
    try:
        prompt, plan, ticket = await start_chat(ctx, chat)
    except APIError as exc:  # the chat path names chat fields: say this API's names
        raise renamed_for_responses(exc) from exc
    builder = ResponseBuilder(body, ctx.model_id())

    def build_reply(
        results: list[ChoiceResult], usage: dict[str, Any], mtplx: dict[str, Any]
    ) -> dict[str, Any]:
        result = results[0]
        text, split = result.text, None
        if prompt.reasoning is not None:  # the thinking apart; calls are in the answer
            split = prompt.reasoning.split_tokens([t.text for t in result.tokens], result.text)
            text = split.content
        reply = split_reply(text, plan)
        return builder.final(reply, result.finish_reason, usage, mtplx, split)

    return await respond(
        request,
        ctx,
        ticket,
        num_choices=1,
        prompt_tokens=len(prompt.token_ids),
        stream=body.stream,
        build_reply=build_reply,
        events=ResponsesEvents(builder, plan, prompt.reasoning),
    )
