"""The Anthropic Messages API (``POST /v1/messages``) on the chat path: its request models,
their translation into the ``ChatCompletionRequest`` the OpenAI chat route uses (same chat
template, SamplerConfig, tool machinery, limits and bridge), and the reply. The stream
events are in ``server.anthropic_stream``.

Tools map onto chat's: ``tools`` (``name``, ``description``, ``input_schema``) become
functions, ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` become ``auto`` /
``required`` / a named function / ``none`` (``disable_parallel_tool_use`` is
``parallel_tool_calls: false``), assistant ``tool_use`` blocks become ``tool_calls`` and user
``tool_result`` blocks ``tool`` messages. Calls the model makes come back as ``tool_use``
blocks with ``stop_reason: "tool_use"``. Anthropic's server tools (web search, bash, ...)
are a 400.

A reasoning model's thinking (``server.reasoning``) comes back as a ``thinking`` block
before the text (its ``signature`` empty: nothing is signed here). ``thinking``
``{"type": "enabled" | "disabled"}`` is the chat template's ``enable_thinking``
(``budget_tokens`` is accepted, not enforced: ``max_tokens`` bounds thinking and answer
together); ``thinking`` blocks of earlier assistant turns are passed to the chat template
as the turn's ``reasoning_content`` (the template keeps or drops it), ``redacted_thinking``
blocks are dropped.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from server.body import validate_part
from server.errors import APIError
from server.params import check_stop
from server.schemas import ChatCompletionRequest, MtplxOptions

__all__ = [
    "CountTokensRequest",
    "MessagesRequest",
    "anthropic_usage",
    "message_reply",
    "new_message_id",
    "stop_reason",
    "thinking_block",
    "to_chat_request",
    "tool_use_block",
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class ContentBlockParam(BaseModel):
    """One content block: ``text`` (its ``cache_control`` and ``citations`` are accepted and
    ignored), ``tool_use`` in assistant turns, ``tool_result`` in user turns. Tool blocks are
    validated by their own models when the prompt is built; other types are refused there,
    naming the block."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    type: str
    text: str | None = None


class ToolUseBlockParam(_Strict):
    """An assistant's call of a tool, in the history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None  # accepted: prefix caching is automatic


class ToolResultBlockParam(_Strict):
    """A tool's result, answering a ``tool_use`` of the previous assistant turn."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ContentBlockParam] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None


class AnthropicTool(_Strict):
    """A client tool: the model may call it with an ``input`` following ``input_schema``."""

    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    # Accepted: with tool_choice any / tool the input is always constrained to the schema.
    strict: bool | None = None


class AnthropicToolChoice(_Strict):
    """``{"type": "auto" | "any" | "tool" | "none"}``; ``name`` with ``tool``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Strict):
    """``thinking``: ``enabled`` (with Anthropic's ``budget_tokens``) or ``disabled``."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)


class MessageParam(_Strict):
    """A user or assistant turn."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class _Prompted(_Strict):
    """What both the messages and the count_tokens requests carry."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[ContentBlockParam] | None = None
    # Each tool is validated once its type is known: a server tool gets a message saying
    # it is not supported, not a schema error.
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    # Defined by Anthropic, not implemented here: a 400 naming the field.
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


# Stop sequences a Messages request may send (each of at most params.MAX_STOP_CHARS).
MAX_STOP_SEQUENCES = 16

_UNSUPPORTED = {
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
    return None


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _missing_text(at: str) -> APIError:
    return APIError(
        400,
        f"Missing required parameter: '{at}.text'.",
        param=f"{at}.text",
        code="missing_required_parameter",
    )


def _texts(blocks: list[ContentBlockParam], where: str) -> str:
    """Text blocks joined with a newline, as the chat route joins content parts."""
    texts = []
    for i, block in enumerate(blocks):
        if block.type == "text" and block.text is None:
            raise _missing_text(f"{where}[{i}]")
        if block.type != "text" or block.text is None:
            raise _bad(
                f"{where}[{i}]: only text content blocks are supported here, got type "
                f"{block.type!r}",
                f"{where}[{i}]",
            )
        texts.append(block.text)
    return "\n".join(texts)


def _raw(block: ContentBlockParam) -> dict[str, Any]:
    """A block as the client sent it (``text`` only when it had one)."""
    return block.model_dump(exclude=set() if block.text is not None else {"text"})


def _turn(message: MessageParam, i: int, previous_calls: set[str]) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: an assistant turn is one message (its
    ``tool_use`` blocks as ``tool_calls``); a user turn is a ``tool`` message per
    ``tool_result`` (each answering a ``tool_use`` of ``previous_calls``, the ids of the
    turn before), then its text as a user message."""
    where = f"messages[{i}].content"
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_use" and message.role == "assistant":
            use = validate_part(ToolUseBlockParam, _raw(block), ("messages", i, "content", j))
            arguments = json.dumps(use.input, ensure_ascii=False)
            calls.append(
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": arguments},
                }
            )
        elif block.type == "tool_result" and message.role == "user":
            result = validate_part(ToolResultBlockParam, _raw(block), ("messages", i, "content", j))
            if result.tool_use_id not in previous_calls:
                raise _bad(
                    f"{at}: unexpected tool_use_id {result.tool_use_id!r} in a tool_result "
                    "block: each tool_result must answer a tool_use block of the previous "
                    "message",
                    f"{at}.tool_use_id",
                )
            content = result.content or ""
            text = content if isinstance(content, str) else _texts(content, f"{at}.content")
            # Chat templates know no error flag on a tool message: the text says it.
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": result.tool_use_id,
                    "content": f"Error: {text}" if result.is_error else text,
                }
            )
        elif block.type == "thinking" and message.role == "assistant":
            thinking = getattr(block, "thinking", None)
            if isinstance(thinking, str):  # to the template, which keeps or drops it
                thoughts.append(thinking)
        elif block.type == "redacted_thinking" and message.role == "assistant":
            continue  # nothing readable in it
        elif block.type == "text":
            raise _missing_text(at)
        elif block.type in ("tool_use", "tool_result"):
            side = "assistant" if block.type == "tool_use" else "user"
            raise _bad(f"{at}: {block.type} blocks belong in {side} turns", f"{at}.type")
        else:
            raise _bad(
                f"{at}: only text, tool_use and tool_result content blocks are supported, got "
                f"type {block.type!r}",
                at,
            )
    if message.role == "assistant":
        entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
        if thoughts:
            entry["reasoning_content"] = "\n".join(thoughts)
        return [{**entry, "tool_calls": calls}] if calls else [entry]
    return (
        [*results, {"role": "user", "content": "\n".join(texts)}]
        if texts or not results
        else results
    )


def _append(messages: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Add a chat message; consecutive user or assistant turns merge (Anthropic combines
    them), except into a turn that made calls (its results come next)."""
    last = messages[-1] if messages else None
    if (
        last is None
        or last["role"] != entry["role"]
        or entry["role"] == "tool"
        or last.get("tool_calls")
    ):
        messages.append(entry)
        return
    last["content"] = "\n\n".join(part for part in (last["content"], entry["content"]) if part)
    if entry.get("reasoning_content"):
        thoughts = (last.get("reasoning_content"), entry["reasoning_content"])
        last["reasoning_content"] = "\n\n".join(part for part in thoughts if part)
    if entry.get("tool_calls"):
        last["tool_calls"] = entry["tool_calls"]


def _tool_fields(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat's shape."""
    fields: dict[str, Any] = {}
    functions = []
    for i, raw in enumerate(body.tools or []):
        kind = raw.get("type")
        if kind not in (None, "custom"):
            raise _bad(
                f"tools[{i}]: tool type {kind!r} is not supported: only client tools (name, "
                "description, input_schema) are; server tools run on Anthropic's servers",
                f"tools[{i}].type",
            )
        tool = validate_part(AnthropicTool, raw, ("tools", i))
        if tool.input_schema.get("type") != "object":
            raise _bad(
                f"tools[{i}].input_schema must be a JSON schema of type 'object'",
                f"tools[{i}].input_schema",
            )
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        functions.append({"type": "function", "function": function})
    if functions:
        fields["tools"] = functions
    choice = body.tool_choice
    if choice is None or (choice.type == "auto" and not functions):
        return fields  # auto without tools: nothing to choose from, as without tool_choice
    if (choice.type == "tool") != (choice.name is not None):
        raise _bad(
            "tool_choice.name is required with type 'tool', and only with it",
            "tool_choice.name",
        )
    fields["tool_choice"] = (
        {"type": "function", "function": {"name": choice.name}}
        if choice.type == "tool"
        else {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    )
    if choice.disable_parallel_tool_use is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return fields


def to_chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that generates this Messages request's reply: ``system`` first,
    consecutive turns of one role merged, tool blocks in chat's tool form, tools and
    ``tool_choice`` in chat's shape, ``stop_sequences`` as ``stop``. A last assistant turn
    is a prefill (``chat_prompt(continue_final=True)``); it cannot hold ``tool_use``."""
    unsupported = unsupported_fields(body)
    if unsupported:
        field, reason = unsupported
        raise APIError(400, f"'{field}': {reason}", param=field, code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else _texts(body.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    calls: set[str] = set()
    last = len(body.messages) - 1
    for i, message in enumerate(body.messages):
        if message.content == [] and not (i == last and message.role == "assistant"):
            raise _bad(
                f"messages[{i}]: all messages must have non-empty content except for the "
                "optional final assistant message",
                f"messages[{i}].content",
            )
        entries = _turn(message, i, calls)
        calls = {c["id"] for e in entries for c in e.get("tool_calls", [])}
        for entry in entries:
            _append(messages, entry)
    if calls and body.messages[-1].role == "assistant":
        raise _bad(
            "the last assistant turn cannot hold tool_use blocks (a prefill is text): send "
            "their tool_result blocks in a user turn",
            f"messages[{len(body.messages) - 1}].content",
        )
    chat: dict[str, Any] = {"model": body.model, "messages": messages, **_tool_fields(body)}
    if body.thinking is not None:
        enabled = body.thinking.type == "enabled"
        if enabled and body.tool_choice is not None and body.tool_choice.type in ("any", "tool"):
            raise _bad("Thinking may not be enabled when tool_choice forces tool use.", "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": enabled}
    if isinstance(body, MessagesRequest):
        stop = body.stop_sequences or []
        check_stop(stop, "stop_sequences", MAX_STOP_SEQUENCES)
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


def stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool = False) -> str:
    """Anthropic's stop_reason for an engine finish (``called``: the reply calls tools)."""
    if called:
        return "tool_use"
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


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A ``tool_use`` content block from a parsed call (OpenAI's shape, as
    ``server.tools.parse_tool_calls`` makes them): the same id, ``toolu_`` instead of
    ``call_``."""
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": json.loads(call["function"]["arguments"]),
    }


def thinking_block(thinking: str) -> dict[str, Any]:
    """A ``thinking`` content block (unsigned)."""
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def message_reply(
    message_id: str,
    model: str,
    reply: tuple[str, list[dict[str, Any]]],
    finish: tuple[str | None, str | None],
    usage: dict[str, Any],
    mtplx: dict[str, Any],
    thinking: str | None = None,
) -> dict[str, Any]:
    """The whole ``message`` object. ``reply`` is (text, calls): a ``thinking`` block when
    the model thought, a text block (unless it is empty and there are calls or thinking),
    then a ``tool_use`` block per call; ``finish`` is (finish_reason, stop_sequence)."""
    text, calls = reply
    reason, sequence = finish
    content = [thinking_block(thinking)] if thinking else []
    if text or not (calls or thinking):
        content.append({"type": "text", "text": text})
    content += [tool_use_block(call) for call in calls]
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(reason, sequence, bool(calls)),
        "stop_sequence": None if calls else sequence,
        "usage": anthropic_usage(usage),
        "mtplx": mtplx,
    }
