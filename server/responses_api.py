"""The OpenAI Responses API (``POST /v1/responses``) on the chat path, stateless: its request
model and the translation into the ``ChatCompletionRequest`` the chat route uses (same chat
template, tool machinery, limits and bridge). The ``response`` object and the typed
stream events are in ``server.responses_output``.

Function tools map onto chat's: ``tools`` items ``{"type": "function", "name", "description",
"parameters", "strict"}`` become chat functions, ``tool_choice`` passes through (a named
function as chat's ``{"type": "function", "function": {"name"}}``), input ``function_call``
items become an assistant message's ``tool_calls`` and ``function_call_output`` items ``tool``
messages. Built-in tools (web search, file search, ...) are a 400. ``reasoning`` input items
(a reasoning model's earlier thinking, sent back) are dropped, as the chat templates of
thinking models drop earlier thinking.

Nothing is stored: ``store`` is accepted and ignored, ``previous_response_id`` is a 400.

``reasoning``: ``effort`` ``none`` or ``minimal`` turns a reasoning model's thinking off
(the chat template's ``enable_thinking: false``); other efforts leave it as the template
has it (on, for a thinking model); no summaries are written (``summary`` is accepted).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.body import validate_part
from server.errors import APIError
from server.schemas import ChatCompletionRequest, FunctionDefinition, MtplxOptions

__all__ = [
    "ResponsesRequest",
    "renamed_for_responses",
    "to_chat_request",
]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class InputItem(BaseModel):
    """One ``input`` item: a message (``type`` "message" or absent) with text content, a
    ``function_call`` or a ``function_call_output``. Function items are validated by their
    own models when the prompt is built; other types are refused there, naming the item."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    type: str | None = None
    role: str | None = None
    content: Any = None


class FunctionTool(FunctionDefinition):
    """``{"type": "function", "name", "description", "parameters", "strict"}``: chat's
    function definition, flat."""

    type: Literal["function"]


class FunctionToolChoice(_Strict):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    name: str


_ItemStatus = Literal["in_progress", "completed", "incomplete"]


class FunctionCallItem(_Strict):
    """A call the model made, sent back in ``input``."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _ItemStatus | None = None


class FunctionCallOutputItem(_Strict):
    """The output of a call: a string, or ``input_text`` parts."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: _ItemStatus | None = None


class ReasoningOptions(_Strict):
    """``reasoning``: the effort (``none`` / ``minimal``: no thinking) and summaries (none
    are written)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None  # accepted; nothing is kept
    metadata: dict[str, str] | None = None  # echoed in the response
    # Each tool is validated once its type is known: a built-in tool gets a message saying
    # it is not supported, not a schema error.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Accepted and echoed: it limits calls of built-in tools, which this server has none of.
    max_tool_calls: int | None = Field(None, ge=1)
    truncation: Literal["disabled"] | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing to obfuscate
    user: str | None = None  # accepted and ignored
    safety_identifier: str | None = None  # accepted and ignored
    prompt_cache_key: str | None = None  # accepted: prefix caching is automatic
    service_tier: str | None = None  # accepted and ignored
    mtplx: MtplxOptions | None = None
    reasoning: ReasoningOptions | None = None
    # Defined by OpenAI, not implemented here: a 400 naming the field.
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    top_logprobs: Any = None


_UNSUPPORTED = {
    "previous_response_id": "this server is stateless and keeps no responses; send the whole "
    "conversation in 'input'",
    "conversation": "this server is stateless and keeps no conversations",
    "prompt": "stored prompts are not supported",
    "top_logprobs": "logprobs are not supported on this API",
}


def unsupported_fields(body: ResponsesRequest) -> tuple[str, str] | None:
    """The first field the request sets that MTPLX does not implement: (field, reason)."""
    values = body.__dict__
    for name, reason in _UNSUPPORTED.items():
        if values.get(name) not in (None, [], {}, 0):
            return name, reason
    if body.background:
        return "background", "background responses are not supported"
    if body.include:
        return "include", "no extra output can be included"
    text_format = (body.text or {}).get("format", {"type": "text"})
    if text_format != {"type": "text"}:
        return "text.format", "only the text format {'type': 'text'} is supported"
    return None


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _parts_text(parts: list[Any], where: str, kinds: tuple[str, ...]) -> str:
    """The text of content parts of ``kinds``, joined by newlines."""
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("text") if isinstance(part, dict) else None
        if kind in kinds and "text" not in part:
            raise _bad(
                f"Missing required parameter: '{where}[{j}].text'.",
                f"{where}[{j}].text",
                "missing_required_parameter",
            )
        if kind in kinds and not isinstance(text, str):
            raise _bad(
                f"Invalid value for '{where}[{j}].text': expected a string",
                f"{where}[{j}].text",
            )
        if kind not in kinds:
            raise _bad(
                f"{where}[{j}]: only {' / '.join(kinds)} parts are supported, got {kind!r}",
                f"{where}[{j}]",
                "unsupported_parameter",
            )
        texts.append(text)
    return "\n".join(texts)


def _message(item: InputItem, i: int) -> dict[str, Any]:
    """The chat message of one message item."""
    where = f"input[{i}]"
    if item.role not in ("user", "system", "developer", "assistant"):
        raise _bad(
            f"{where}.role must be one of 'user', 'system', 'developer', 'assistant'",
            f"{where}.role",
        )
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    if not isinstance(item.content, list):
        raise _bad(
            f"{where}.content must be a string or a list of content parts", f"{where}.content"
        )
    text = _parts_text(item.content, f"{where}.content", ("input_text", "output_text"))
    return {"role": item.role, "content": text}


def _input_messages(items: list[InputItem]) -> list[dict[str, Any]]:
    """The input items as chat messages: calls join the assistant message before them (or
    start one), each output becomes a ``tool`` message answering an earlier call."""
    messages: list[dict[str, Any]] = []
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        raw = item.model_dump(exclude_unset=True)
        if item.type == "function_call":
            call = validate_part(FunctionCallItem, raw, ("input", i))
            function = {"name": call.name, "arguments": call.arguments}
            entry = {"id": call.call_id, "type": "function", "function": function}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(entry)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})
            call_ids.add(call.call_id)
        elif item.type == "function_call_output":
            output = validate_part(FunctionCallOutputItem, raw, ("input", i))
            if output.call_id not in call_ids:
                raise _bad(
                    f"No tool call found for function call output with call_id "
                    f"{output.call_id!r} (input[{i}]): send its function_call item before it",
                    f"input[{i}].call_id",
                )
            text = output.output
            if not isinstance(text, str):
                text = _parts_text(text, f"input[{i}].output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": output.call_id, "content": text})
        elif item.type in (None, "message"):
            messages.append(_message(item, i))
        elif item.type == "reasoning":
            continue  # earlier thinking: thinking models' templates drop it too
        else:
            raise _bad(
                f"input[{i}]: items of type {item.type!r} are not supported (only messages, "
                "function_call, function_call_output and reasoning)",
                f"input[{i}].type",
                "unsupported_parameter",
            )
    return messages


def _tool_fields(body: ResponsesRequest) -> dict[str, Any]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` in chat's shape."""
    functions = []
    for i, raw in enumerate(body.tools or []):
        kind = raw.get("type")
        if kind != "function":
            raise _bad(
                f"tools[{i}]: tool type {kind!r} is not supported: only function tools are "
                "(built-in tools such as web_search or file_search run on OpenAI's servers)",
                f"tools[{i}].type",
                "unsupported_parameter",
            )
        tool = validate_part(FunctionTool, raw, ("tools", i))
        function = {"name": tool.name, "parameters": tool.parameters}
        if tool.description is not None:
            function["description"] = tool.description
        functions.append({"type": "function", "function": function})
    choice: Any = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _bad(
                f"tool_choice of type {choice.get('type')!r} is not supported: send 'none', "
                "'auto', 'required' or {'type': 'function', 'name': ...}",
                "tool_choice",
                "unsupported_parameter",
            )
        named = validate_part(FunctionToolChoice, choice, ("tool_choice",))
        choice = {"type": "function", "function": {"name": named.name}}
    if not functions and choice == "auto":
        choice = None  # the default, which clients send with or without tools
    return {
        "tools": functions or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
    }


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that generates this response: ``instructions`` as the system
    message, then the input (a string is one user message; function calls and their
    outputs in chat's tool form), and the function tools."""
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
        messages += _input_messages(body.input)
    if not messages:
        raise APIError(400, "input must not be empty", param="input", code="invalid_value")
    options = body.mtplx.model_dump(exclude_unset=True) if body.mtplx else None
    return ChatCompletionRequest.model_validate(
        {
            "model": body.model,
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
            "messages": messages,
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "stream": body.stream,
            "mtplx": options,
            **_tool_fields(body),
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
