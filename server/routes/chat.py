"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
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
from server.reasoning import ReasoningSplitter, ReplyReasoning
from server.routes.common import new_id, respond, start_chat
from server.schemas import ChatCompletionRequest
from server.streaming import ChunkFormatter
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


def _listed(chunks: Any) -> list[dict[str, Any]]:
    if chunks is None:
        return []
    return chunks if isinstance(chunks, list) else [chunks]


class ReasoningChunks:
    """Wraps a chat chunk formatter (``ChatChunks``, or ``ToolCallStream`` with tools) for
    a reasoning model's reply: the thinking streams as ``delta.reasoning_content``, the
    answer goes on to the wrapped formatter as content (so tool calls are parsed from the
    answer only)."""

    def __init__(self, inner: ChunkFormatter, chunks: ChatChunks, reasoning: ReplyReasoning):
        self.inner = inner
        self.chunks = chunks
        self.reasoning = reasoning
        self.wants_logprobs = inner.wants_logprobs
        self.splitters: dict[int, ReasoningSplitter] = {}

    def _splitter(self, index: int) -> ReasoningSplitter:
        if index not in self.splitters:
            self.splitters[index] = self.reasoning.splitter()
        return self.splitters[index]

    def _thought(self, index: int, text: str, event: TokenEvent | None = None) -> dict[str, Any]:
        """A reasoning delta (with the token's logprobs when ``event`` is given)."""
        chunk = (
            self.chunks.token(index, event) if event is not None else self.chunks._chunk(index, {})
        )
        chunk["choices"][0]["delta"] = {"reasoning_content": text}
        return chunk

    def begin(self, index: int) -> dict[str, Any] | None:
        """The role delta."""
        return self.inner.begin(index)

    def token(self, index: int, event: TokenEvent) -> list[dict[str, Any]] | None:
        """The token's reasoning and content deltas (its logprobs on the first of them)."""
        reasoning, content = self._splitter(index).add(event.text)
        out = []
        if reasoning:
            with_logprobs = event if self.wants_logprobs and not content else None
            out.append(self._thought(index, reasoning, with_logprobs))
        if content or (self.wants_logprobs and not reasoning):
            out += _listed(self.inner.token(index, dataclasses.replace(event, text=content)))
        return out or None

    def tail(self, index: int, text: str) -> list[dict[str, Any]] | None:
        """The detokenizer's tail, split like any text."""
        reasoning, content = self._splitter(index).add(text)
        out = [self._thought(index, reasoning)] if reasoning else []
        if content:
            out += _listed(self.inner.tail(index, content))
        return out or None

    def finish(self, index: int, reason: str) -> list[dict[str, Any]]:
        """What the splitter held back, then the wrapped formatter's finish."""
        reasoning, content = self._splitter(index).finish()
        out = [self._thought(index, reasoning)] if reasoning else []
        if content:
            out += _listed(self.inner.tail(index, content))
        return [*out, *_listed(self.inner.finish(index, reason))]

    def usage(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> dict[str, Any]:
        """The usage chunk, with the tokens the choices spent thinking."""
        thinking = sum(s.reasoning_pieces for s in self.splitters.values())
        details = {"reasoning_tokens": thinking}
        return self.inner.usage({**usage, "completion_tokens_details": details}, mtplx)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streaming or not."""
    ctx = get_context(request)
    limits = ctx.item_limits("messages", "tools")
    body = await parse_json_body(request, ChatCompletionRequest, limits, ctx.max_json_len())
    check_stop(body.stop)
    engine = ctx.engine()
    prompt, plan, ticket = await start_chat(ctx, body)
    model = ctx.model_id()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = ChatChunks(model, engine.token_text, body.logprobs, include_usage)

    reasoning = prompt.reasoning
    # A reasoning model's messages all carry reasoning_content (null in a constrained one).
    thinks = ctx.reasoning_parser() is not None

    thinking_tokens: list[int] = []  # per choice, for usage

    def message(result: ChoiceResult) -> tuple[dict[str, Any], str | None]:
        text, thought = result.text, None
        if reasoning is not None:  # the thinking apart; tool calls are in the answer
            split = reasoning.split_tokens([t.text for t in result.tokens], result.text)
            thought, text = split.reasoning, split.content
            thinking_tokens.append(split.reasoning_pieces)
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if thinks:
            reply["reasoning_content"] = thought
            if thought is not None and not text:
                reply["content"] = None  # all thinking (it never closed, or said nothing)
        if plan is None:
            return reply, result.finish_reason
        content, calls = parse_tool_calls(text, plan)
        if not calls:
            return reply, result.finish_reason
        return {**reply, "content": content, "tool_calls": calls}, "tool_calls"

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
        if reasoning is not None:
            usage = {
                **usage,
                "completion_tokens_details": {"reasoning_tokens": sum(thinking_tokens)},
            }
        return {
            "id": chunks.id,
            "object": "chat.completion",
            "created": chunks.created,
            "model": model,
            "choices": choices,
            "usage": usage,
            "mtplx": mtplx,
        }

    formatter: ChunkFormatter = chunks if plan is None else ToolCallStream(chunks, plan)
    if reasoning is not None:
        formatter = ReasoningChunks(formatter, chunks, reasoning)
    return await respond(
        request,
        ctx,
        ticket,
        num_choices=body.n,
        prompt_tokens=len(prompt.token_ids),
        stream=body.stream,
        include_usage=include_usage,
        formatter=formatter,
        build_reply=build_reply,
    )
