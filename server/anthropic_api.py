"""The Anthropic Messages API (``POST /v1/messages``) on the chat path: its request models,
their translation into the ``ChatCompletionRequest`` the OpenAI chat route uses (same chat
template, SamplerConfig, limits and scheduler), the reply, and its named stream events.

Text only for now: a request with ``tools`` (or a ``tool_use`` / ``tool_result`` block) is a
400 ``invalid_request_error`` from ``unsupported_fields``/``_block_text``, the places where
tool support will plug in.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mtplx.request import FinishEvent, TokenEvent
from server.errors import APIError
from server.schemas import ChatCompletionRequest, MtplxOptions
from server.streaming import SSE, data_event

__all__ = [
    "AnthropicEvents",
    "CountTokensRequest",
    "MessagesRequest",
    "anthropic_usage",
    "message_reply",
    "new_message_id",
    "stop_reason",
    "to_chat_request",
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class ContentBlockParam(BaseModel):
    """One content block. Only ``{"type": "text", "text": ...}`` is supported (its
    ``cache_control`` and ``citations`` are accepted and ignored); other types are refused
    when the prompt is built, naming the block."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class MessageParam(_Strict):
    """A user or assistant turn."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class _Prompted(_Strict):
    """What both the messages and the count_tokens requests carry."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    # Defined by Anthropic, not implemented here: a 400 naming the field.
    tools: Any = None
    tool_choice: Any = None
    thinking: Any = None
    mcp_servers: Any = None


class MessagesRequest(_Prompted):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted and ignored (user_id)
    service_tier: str | None = None  # accepted and ignored: there is one tier
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic
    mtplx: MtplxOptions | None = None
    container: Any = None
    context_management: Any = None


class CountTokensRequest(_Prompted):
    """POST /v1/messages/count_tokens."""


_UNSUPPORTED = {
    "tools": "tool use is not supported yet",
    "tool_choice": "tool use is not supported yet",
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
    "context_management": "context management is not supported",
}


def unsupported_fields(body: _Prompted) -> tuple[str, str] | None:
    """The first field the request sets that MTPLX does not implement: (field, reason)."""
    values = body.__dict__
    for name, reason in _UNSUPPORTED.items():
        if values.get(name) not in (None, []):
            return name, reason
    thinking = body.thinking
    if thinking is not None and thinking != {"type": "disabled"}:
        return "thinking", "extended thinking is not supported"
    return None


def _block_text(content: str | list[ContentBlockParam], where: str) -> str:
    """The text of a message's (or the system prompt's) content; blocks are joined with a
    newline, as the chat route joins content parts."""
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if block.type in ("tool_use", "tool_result"):
            raise APIError(400, f"{where}[{i}]: tool use is not supported yet", param=where)
        if block.type != "text" or block.text is None:
            raise APIError(
                400,
                f"{where}[{i}]: only text content blocks are supported, got type {block.type!r}",
                param=f"{where}[{i}]",
            )
        texts.append(block.text)
    return "\n".join(texts)


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates this Messages request's reply: ``system`` first,
    consecutive turns of one role merged (Anthropic combines them), ``stop_sequences`` as
    ``stop``. A last assistant turn is a prefill (``chat_prompt(continue_final=True)``)."""
    unsupported = unsupported_fields(body)
    if unsupported:
        field, reason = unsupported
        raise APIError(400, f"'{field}': {reason}", param=field, code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = _block_text(body.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        text = _block_text(message.content, f"messages[{i}].content")
        if messages and messages[-1]["role"] == message.role:
            messages[-1]["content"] += "\n\n" + text
        else:
            messages.append({"role": message.role, "content": text})
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if isinstance(body, MessagesRequest):
        stop = body.stop_sequences or []
        if any(not s for s in stop):
            raise APIError(400, "stop_sequences must not contain empty strings")
        options = body.mtplx.model_dump(exclude_unset=True) if body.mtplx else None
        chat.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=stop or None,
            stream=body.stream,
            mtplx=options,
        )
    return ChatCompletionRequest.model_validate(chat)


def new_message_id() -> str:
    """``msg_…`` ids."""
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    """Anthropic's stop_reason for an engine finish."""
    if finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def anthropic_usage(usage: dict[str, Any]) -> dict[str, int]:
    """Anthropic's usage from the OpenAI-style one. As Anthropic counts them,
    ``input_tokens`` are the prompt tokens computed for this request and
    ``cache_read_input_tokens`` those the prefix cache served: their sum is the prompt."""
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
    }


def message_reply(
    message_id: str,
    model: str,
    text: str,
    finish: tuple[str | None, str | None],
    usage: dict[str, Any],
    mtplx: dict[str, Any],
) -> dict[str, Any]:
    """The whole ``message`` object; ``finish`` is (finish_reason, stop_sequence)."""
    reason, sequence = finish
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason(reason, sequence),
        "stop_sequence": sequence,
        "usage": anthropic_usage(usage),
        "mtplx": mtplx,
    }


class AnthropicEvents:
    """The stream: ``message_start``, ``content_block_start``, ``ping``, one
    ``content_block_delta`` per piece of text, ``content_block_stop``, ``message_delta``
    (stop reason, usage, and MTPLX's ``mtplx`` statistics), ``message_stop``; a failure
    after the start is an ``error`` event. Every event is named (``event: <type>``)."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.ended: tuple[str | None, str | None] = (None, None)

    @staticmethod
    def _event(kind: str, **fields: Any) -> SSE:
        return data_event({"type": kind, **fields}, event=kind)

    def _delta(self, text: str) -> SSE:
        delta = {"type": "text_delta", "text": text}
        return self._event("content_block_delta", index=0, delta=delta)

    def opening(self, index: int) -> list[SSE]:
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return [
            self._event("message_start", message=message),
            self._event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            self._event("ping"),
        ]

    def token(self, index: int, event: TokenEvent) -> list[SSE]:
        return [self._delta(event.text)] if event.text else []

    def finish(self, index: int, event: FinishEvent) -> list[SSE]:
        self.ended = (event.finish_reason, event.stop_sequence)
        tail = [self._delta(event.text)] if event.text else []
        return [*tail, self._event("content_block_stop", index=0)]

    def closing(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> list[SSE]:
        reason, sequence = self.ended
        delta = {"stop_reason": stop_reason(reason, sequence), "stop_sequence": sequence}
        counts = anthropic_usage(usage)
        return [
            self._event("message_delta", delta=delta, usage=counts, mtplx=mtplx),
            self._event("message_stop"),
        ]

    def failure(self, error: APIError) -> list[SSE]:
        return [data_event(error.anthropic_body(), event="error")]
