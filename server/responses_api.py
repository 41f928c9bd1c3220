"""The OpenAI Responses API (``POST /v1/responses``) on the chat path, text only and stateless:
its request model, the translation into the ``ChatCompletionRequest`` the chat route uses,
the ``response`` object, and its typed stream events (each with ``sequence_number``).

Nothing is stored: ``store`` is accepted and ignored, ``previous_response_id`` is a 400.
``tools`` is a 400 for now (``unsupported_fields``, where tool support will plug in).
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mtplx.request import FinishEvent, TokenEvent
from server.errors import APIError
from server.schemas import ChatCompletionRequest, MtplxOptions
from server.streaming import SSE, data_event

__all__ = [
    "ResponseBuilder",
    "ResponsesEvents",
    "ResponsesRequest",
    "renamed_for_responses",
    "to_chat_request",
]


class InputItem(BaseModel):
    """One ``input`` item. Only messages are supported (``type`` "message" or absent) with
    text content; anything else is refused when the prompt is built, naming the item."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str | None = None
    role: str | None = None
    content: Any = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None  # accepted; nothing is kept
    metadata: dict[str, str] | None = None  # echoed in the response
    parallel_tool_calls: bool | None = None  # echoed; there are no tools yet
    truncation: Literal["disabled"] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate
    user: str | None = None  # accepted and ignored
    safety_identifier: str | None = None  # accepted and ignored
    prompt_cache_key: str | None = None  # accepted: prefix caching is automatic
    service_tier: str | None = None  # accepted and ignored
    mtplx: MtplxOptions | None = None
    # Defined by OpenAI, not implemented here: a 400 naming the field.
    previous_response_id: Any = None
    conversation: Any = None
    tools: Any = None
    tool_choice: Any = None
    reasoning: Any = None
    background: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None


_UNSUPPORTED = {
    "previous_response_id": "this server is stateless and keeps no responses; send the whole "
    "conversation in 'input'",
    "conversation": "this server is stateless and keeps no conversations",
    "tools": "tool calling is not supported yet",
    "reasoning": "reasoning options are not supported",
    "prompt": "stored prompts are not supported",
    "top_logprobs": "logprobs are not supported on this API",
    "max_tool_calls": "tool calling is not supported yet",
}


def unsupported_fields(body: ResponsesRequest) -> tuple[str, str] | None:
    """The first field the request sets that MTPLX does not implement: (field, reason)."""
    values = body.__dict__
    for name, reason in _UNSUPPORTED.items():
        if values.get(name) not in (None, [], {}, 0):
            return name, reason
    if body.tool_choice not in (None, "none", "auto"):
        return "tool_choice", "tool calling is not supported yet"
    if body.background:
        return "background", "background responses are not supported"
    if body.include:
        return "include", "no extra output can be included"
    text_format = (body.text or {}).get("format", {"type": "text"})
    if text_format != {"type": "text"}:
        return "text.format", "only the text format {'type': 'text'} is supported"
    return None


def _item_text(item: InputItem, i: int) -> tuple[str, str]:
    """(role, text) of one message item."""
    where = f"input[{i}]"
    if item.type not in (None, "message"):
        raise APIError(
            400,
            f"{where}: items of type {item.type!r} are not supported (only messages)",
            param=f"{where}.type",
            code="unsupported_parameter",
        )
    if item.role not in ("user", "system", "developer", "assistant"):
        raise APIError(
            400,
            f"{where}.role must be one of 'user', 'system', 'developer', 'assistant'",
            param=f"{where}.role",
            code="invalid_value",
        )
    if isinstance(item.content, str):
        return item.role, item.content
    if not isinstance(item.content, list):
        raise APIError(
            400,
            f"{where}.content must be a string or a list of content parts",
            param=f"{where}.content",
            code="invalid_value",
        )
    texts = []
    for j, part in enumerate(item.content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(text, str):
            raise APIError(
                400,
                f"{where}.content[{j}]: only input_text / output_text parts are supported, "
                f"got {kind!r}",
                param=f"{where}.content[{j}]",
                code="unsupported_parameter",
            )
        texts.append(text)
    return item.role, "\n".join(texts)


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response: ``instructions`` as the system
    message, then the input (a string is one user message)."""
    unsupported = unsupported_fields(body)
    if unsupported:
        field, reason = unsupported
        raise APIError(400, f"'{field}': {reason}", param=field, code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        for i, item in enumerate(body.input):
            role, text = _item_text(item, i)
            messages.append({"role": role, "content": text})
    if not messages:
        raise APIError(400, "input must not be empty", param="input", code="invalid_value")
    options = body.mtplx.model_dump(exclude_unset=True) if body.mtplx else None
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "messages": messages,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stream": body.stream,
            "mtplx": options,
        }
    )


_RENAMES = {"max_tokens": "max_output_tokens", "messages": "input"}


def renamed_for_responses(error: APIError) -> APIError:
    """An error the chat path raised, with this API's field names."""
    if error.param is None or error.param.split(".")[0].split("[")[0] not in _RENAMES:
        return error
    message = re.sub(r"\bmax_tokens\b", "max_output_tokens", error.message)
    param = _RENAMES[error.param.split(".")[0].split("[")[0]]
    return APIError(error.status, message, param=param, code=error.code, headers=error.headers)


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        },
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseBuilder:
    """The ``response`` object at each stage, echoing the request's settings."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.body = body
        self.model = model

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        """The assistant message item; ``text`` None: no content part yet."""
        content = [] if text is None else [self.part(text)]
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        """An ``output_text`` content part."""
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        mtplx: dict[str, Any] | None = None,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The whole object; ``incomplete_details`` when status is "incomplete"."""
        body = self.body
        reply: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": (
                True if body.parallel_tool_calls is None else body.parallel_tool_calls
            ),
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,  # nothing is kept, whatever the request asked
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else _usage(usage),
            "user": body.user,
            "metadata": body.metadata or {},
        }
        if status in ("completed", "incomplete"):
            reply["completed_at"] = int(time.time())
        if mtplx is not None:
            reply["mtplx"] = mtplx
        return reply

    def final(
        self, text: str, finish_reason: str | None, usage: dict[str, Any], mtplx: dict[str, Any]
    ) -> dict[str, Any]:
        """The finished response: "incomplete" when max_output_tokens cut it."""
        status = "incomplete" if finish_reason == "length" else "completed"
        return self.response(status, [self.item(text, status)], usage, mtplx)


class ResponsesEvents:
    """The typed stream: ``response.created``, ``response.in_progress``,
    ``response.output_item.added``, ``response.content_part.added``, one
    ``response.output_text.delta`` per piece, ``response.output_text.done``,
    ``response.content_part.done``, ``response.output_item.done``, then
    ``response.completed`` (``response.incomplete`` when max_output_tokens cut it, as OpenAI
    sends). A failure after the start is an ``error`` event and ``response.failed``."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.sequence = 0
        self.text = ""
        self.finish_reason: str | None = None

    def _event(self, kind: str, **fields: Any) -> SSE:
        event = data_event({"type": kind, "sequence_number": self.sequence, **fields}, kind)
        self.sequence += 1
        return event

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.builder.item_id, "output_index": 0, "content_index": 0}

    def opening(self, index: int) -> list[SSE]:
        b = self.builder
        return [
            self._event("response.created", response=b.response("in_progress", [])),
            self._event("response.in_progress", response=b.response("in_progress", [])),
            self._event(
                "response.output_item.added", output_index=0, item=b.item(None, "in_progress")
            ),
            self._event("response.content_part.added", **self._at(), part=b.part("")),
        ]

    def _delta(self, text: str) -> SSE:
        self.text += text
        return self._event("response.output_text.delta", **self._at(), delta=text, logprobs=[])

    def token(self, index: int, event: TokenEvent) -> list[SSE]:
        return [self._delta(event.text)] if event.text else []

    def finish(self, index: int, event: FinishEvent) -> list[SSE]:
        self.finish_reason = event.finish_reason
        tail = [self._delta(event.text)] if event.text else []
        status = "incomplete" if event.finish_reason == "length" else "completed"
        b = self.builder
        return [
            *tail,
            self._event("response.output_text.done", **self._at(), text=self.text, logprobs=[]),
            self._event("response.content_part.done", **self._at(), part=b.part(self.text)),
            self._event(
                "response.output_item.done", output_index=0, item=b.item(self.text, status)
            ),
        ]

    def closing(self, usage: dict[str, Any], mtplx: dict[str, Any]) -> list[SSE]:
        final = self.builder.final(self.text, self.finish_reason, usage, mtplx)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        return [self._event(kind, response=final)]

    def failure(self, error: APIError) -> list[SSE]:
        code = error.code or "server_error"
        failed = self.builder.response("failed", [], error={"code": code, "message": error.message})
        return [
            self._event("error", code=code, message=error.message, param=error.param),
            self._event("response.failed", response=failed),
        ]
