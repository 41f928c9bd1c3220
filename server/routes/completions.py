"""POST /v1/completions."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from mtplx.request import TokenEvent
from server.body import parse_json_body
from server.context import get_context
from server.generation import ChoiceResult, now, submit
from server.logprobs import completion_logprobs, echoed_logprobs, vllm_prompt_logprobs
from server.params import aliases_for, build_requests, check_common, check_stop
from server.prompts import Prompt, check_prompt_size, completion_prompts, in_tokenizer_thread
from server.routes.common import new_id, respond
from server.schemas import CompletionRequest

router = APIRouter()


class CompletionChunks:
    """``text_completion`` chunks; with ``echo`` a choice starts with its prompt text."""

    def __init__(
        self,
        model: str,
        token_text: Any,
        logprobs: bool,
        include_usage: bool,
        echo_texts: list[str] | None,
    ) -> None:
        self.id = new_id("cmpl")
        self.created = now()
        self.model = model
        self.token_text = token_text
        self.wants_logprobs = logprobs
        self.include_usage = include_usage
        self.echo_texts = echo_texts
        self._offsets: dict[int, int] = {}

    def _chunk(self, index: int, text: str, **extra: Any) -> dict[str, Any]:
        choice = {"text": text, "index": index, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        chunk = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def begin(self, index: int) -> dict[str, Any] | None:
        if self.echo_texts is None:
            self._offsets[index] = 0
            return None
        text = self.echo_texts[index]
        self._offsets[index] = len(text)
        return self._chunk(index, text)

    def token(self, index: int, event: TokenEvent) -> dict[str, Any]:
        offset = self._offsets.get(index, 0)
        self._offsets[index] = offset + len(event.text)
        logprobs = (
            completion_logprobs(self.token_text, [event], offset) if self.wants_logprobs else None
        )
        return self._chunk(index, event.text, logprobs=logprobs)

    def tail(self, index: int, text: str) -> dict[str, Any]:
        self._offsets[index] = self._offsets.get(index, 0) + len(text)
        return self._chunk(index, text)

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk(index, "", finish_reason=reason)

    def usage(self, usage: dict[str, int], mtplx: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
            "mtplx": mtplx,
        }


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI (legacy) completions: one choice set per prompt, streaming or not."""
    ctx = get_context(request)
    body = await parse_json_body(request, CompletionRequest, None, ctx.max_json_len())
    check_stop(body.stop)
    engine = ctx.engine()
    check_common(body, ctx.settings, ctx.model_names())
    # The real engine has vocab_size; EngineLike does not promise it.
    check_prompt_size(body, engine.context_length, getattr(engine, "vocab_size", None))
    prompts: list[Prompt] = await in_tokenizer_thread(
        completion_prompts, engine.tokenizer, body.prompt
    )
    requests = build_requests(body, prompts, engine, ctx.settings)
    ticket = await submit(ctx.bridge, requests, aliases_for(body))
    model = ctx.model_id()
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # Choice k answers prompt k // n; echo repeats that prompt's text.
    echo = [prompts[k // body.n].text for k in range(len(requests))] if body.echo else None
    chunks = CompletionChunks(
        model, engine.token_text, body.logprobs is not None, include_usage, echo
    )

    def build_reply(
        results: list[ChoiceResult], usage: dict[str, int], mtplx: dict[str, Any]
    ) -> dict[str, Any]:
        choices = []
        for r in results:
            prefix = echo[r.index] if echo else ""
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(engine.token_text, r.tokens, len(prefix))
                if echo and r.prompt_logprobs is not None:
                    logprobs = echoed_logprobs(engine.token_text, r.prompt_logprobs, logprobs)
            choice = {
                "text": prefix + r.text,
                "index": r.index,
                "logprobs": logprobs,
                "finish_reason": r.finish_reason,
            }
            if body.prompt_logprobs is not None and r.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(
                    engine.token_text, r.prompt_logprobs
                )
            choices.append(choice)
        return {
            "id": chunks.id,
            "object": "text_completion",
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
        prompt_tokens=sum(len(p.token_ids) for p in prompts),
        stream=body.stream,
        include_usage=include_usage,
        formatter=chunks,
        build_reply=build_reply,
    )
