"""POST /tokenize and /detokenize: the served model's tokenizer, in vLLM's request and
response shapes (llama.cpp's ``content`` is accepted too), so that clients can count and
split tokens exactly as the server will (lm-evaluation-harness's remote tokenizer, token
budgeting before a request)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request

from server.body import parse_json_body
from server.context import get_context
from server.errors import APIError
from server.prompts import (
    CHARS_PER_TOKEN_BOUND,
    chat_prompt,
    check_template_kwargs,
    in_tokenizer_thread,
    message_chars,
)
from server.schemas import ChatMessage, TokenId

router = APIRouter()


class TokenizeRequest(BaseModel):
    """A text (``prompt``, or llama.cpp's ``content``) or a chat conversation (``messages``,
    rendered with the chat template and its generation prompt)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as chat sends them
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        given = [n for n in ("prompt", "content", "messages") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of 'prompt' (or 'content') and 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """Token ids to turn back into text."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1_048_576)


def _check_model(ctx: Any, model: str | None) -> None:
    if model is not None and model not in ctx.model_names():
        raise APIError(
            404, f"The model '{model}' does not exist.", param="model", code="model_not_found"
        )


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens"}`` (+ ``token_strs`` when asked)."""
    ctx = get_context(request)
    body = await parse_json_body(
        request, TokenizeRequest, ctx.item_limits("messages"), ctx.max_json_len()
    )
    engine = ctx.engine()  # 503 while the model loads
    _check_model(ctx, body.model)
    tokenizer = engine.tokenizer
    max_chars = engine.context_length * CHARS_PER_TOKEN_BOUND
    if body.messages is not None:
        if body.add_special_tokens or not body.add_generation_prompt:
            # The template places the special tokens; a conversation without the
            # generation prompt is what the chat APIs never feed.
            raise APIError(
                400,
                "with 'messages' the chat template places special tokens and the generation "
                "prompt: leave 'add_special_tokens' and 'add_generation_prompt' unset",
                param="messages",
                code="invalid_value",
            )
        # Every part the template renders counts, as on the chat route (names, tool calls'
        # arguments), before the tokenizer is held.
        chars = 0
        for message in body.messages:
            chars += CHARS_PER_TOKEN_BOUND + message_chars(message, max_chars - chars)
            if chars > max_chars:
                raise APIError(400, "the messages are too long to tokenize", param="messages")
        kwargs = check_template_kwargs(body.chat_template_kwargs)
        prompt = await in_tokenizer_thread(
            chat_prompt, tokenizer, body.messages, False, None, None, kwargs
        )
        tokens = prompt.token_ids
    else:
        text = body.prompt if body.prompt is not None else body.content
        assert text is not None
        if len(text) > max_chars:
            param = "prompt" if body.prompt is not None else "content"
            raise APIError(400, "the text is too long to tokenize", param=param)
        special = body.add_special_tokens is not False
        tokens = [int(t) for t in await in_tokenizer_thread(_encode, tokenizer, text, special)]
    reply: dict[str, Any] = {
        "count": len(tokens),
        "max_model_len": engine.context_length,
        "tokens": tokens,
    }
    if body.return_token_strs:
        reply["token_strs"] = await in_tokenizer_thread(tokenizer.convert_ids_to_tokens, tokens)
    return reply


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, str]:
    """``{"prompt": text}`` (and llama.cpp's ``content``, the same text)."""
    ctx = get_context(request)
    body = await parse_json_body(request, DetokenizeRequest)
    engine = ctx.engine()
    _check_model(ctx, body.model)
    bad = [t for t in body.tokens if t >= engine.vocab_size]
    if bad:
        raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary", param="tokens")
    text = await in_tokenizer_thread(engine.tokenizer.decode, body.tokens)
    return {"prompt": text, "content": text}


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
