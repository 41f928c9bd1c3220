"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from mtplx.request import TokenEvent
from server.body import parse_json_body
from server.context import get_context
from server.generation import ChoiceResult, now
from server.logprobs import chat_logprobs
from server.params import check_stop
from server.routes.common import new_id, respond, start_chat
from server.schemas import ChatCompletionRequest
from server.tool_stream import ToolCallStream
from server.tools import parse_tool_calls

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
    check_stop(body.stop)
    engine = ctx.engine()
    prompt, plan, ticket = await start_chat(ctx, body)
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
        num_choices=body.n,
        prompt_tokens=len(prompt.token_ids),
        stream=body.stream,
        include_usage=include_usage,
        formatter=chunks if plan is None else ToolCallStream(chunks, plan),
        build_reply=build_reply,
    )
