"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from mtplx.request import TokenEvent
from server.body import parse_json_body
from server.context import get_context
from server.errors import APIError
from server.generation import ChoiceResult, now, submit
from server.logprobs import chat_logprobs
from server.params import aliases_for, build_requests, check_common
from server.prompts import chat_prompt, check_prompt_size, in_tokenizer_thread
from server.routes.common import new_id, respond
from server.schemas import ChatCompletionRequest
from server.structured import grammar_for
from server.tool_stream import ToolCallStream
from server.tools import call_style, parse_tool_calls, plan_tools, render_conversation

router = APIRouter()


class ChatChunks:
    """``chat.completion.chunk`` objects: role delta first, content deltas, finish last."""

    def __init__(self, model: str, token_text: Any, logprobs: bool, include_usage: bool) -> None:
        self.id = new_id("chatcmpl")
        self.created = now()
        self.model = model
        self.token_text = token_text
        self.wants_logprobs = logprobs
        self.include_usage = include_usage

    def _chunk(self, index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def begin(self, index: int) -> dict[str, Any]:
        return self._chunk(index, {"role": "assistant", "content": ""})

    def token(self, index: int, event: TokenEvent) -> dict[str, Any]:
        logprobs = chat_logprobs(self.token_text, [event]) if self.wants_logprobs else None
        return self._chunk(index, {"content": event.text}, logprobs=logprobs)

    def tail(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(index, {"content": text})

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk(index, {}, finish_reason=reason)

    def usage(self, usage: dict[str, int], mtplx: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
            "mtplx": mtplx,
        }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streaming or not."""
    ctx = get_context(request)
    body = await parse_json_body(request, ChatCompletionRequest)
    engine = ctx.engine()
    check_common(body, ctx.settings, ctx.model_names())
    check_prompt_size(body, engine.context_length)
    plan = plan_tools(body, engine.tokenizer)
    conversation, tools = render_conversation(body.messages, plan, call_style(engine.tokenizer))
    prompt = await in_tokenizer_thread(
        chat_prompt, engine.tokenizer, body.messages, False, conversation, tools
    )
    grammar = plan.grammar() if plan is not None else None
    options = body.mtplx
    # The request's own constraint, validated whatever the tools say (never silently dropped).
    own = grammar_for(
        body.response_format,
        options.regex if options else None,
        options.grammar if options else None,
    )
    if own is not None and plan is not None:
        if plan.choice != "auto":
            field = "response_format" if own.param.startswith("response_format") else own.param
            raise APIError(
                400,
                f"tool_choice {plan.choice!r} constrains the reply to tool calls: send no "
                f"{field} with it",
                param=field,
                code="invalid_value",
            )
        grammar = None  # the request's own constraint shapes a reply that calls no tool
    requests = build_requests(body, [prompt], engine, ctx.settings, grammar)
    ticket = submit(ctx.scheduler, requests, aliases_for(body))
    model = ctx.model_id()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = ChatChunks(model, engine.token_text, body.logprobs, include_usage)

    def message(result: ChoiceResult) -> tuple[dict[str, Any], str | None]:
        if plan is None:
            return {"role": "assistant", "content": result.text}, result.finish_reason
        content, calls = parse_tool_calls(result.text, plan)
        if not calls:
            return {"role": "assistant", "content": result.text}, result.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"

    def build_reply(
        results: list[ChoiceResult], usage: dict[str, int], mtplx: dict[str, Any]
    ) -> dict[str, Any]:
        choices = []
        for r in results:
            reply, finish_reason = message(r)
            choices.append(
                {
                    "index": r.index,
                    "message": reply,
                    "logprobs": (
                        chat_logprobs(engine.token_text, r.tokens) if body.logprobs else None
                    ),
                    "finish_reason": finish_reason,
                }
            )
        return {
            "id": chunks.id,
            "object": "chat.completion",
            "created": chunks.created,
            "model": model,
            "choices": choices,
            "usage": usage,
            "mtplx": mtplx,
        }

    return await respond(
        request,
        ctx,
        ticket,
        num_choices=len(requests),
        prompt_tokens=len(prompt.token_ids),
        stream=body.stream,
        include_usage=include_usage,
        formatter=chunks if plan is None else ToolCallStream(chunks, plan),
        build_reply=build_reply,
    )
