"""OpenAI request and response models (pydantic v2).

Requests are strict (``"0.5"`` is not a number) and forbid unknown fields, so nothing a
client sends is silently ignored. Fields OpenAI defines that MTPLX does not implement are
declared as ``Any`` and rejected by ``unsupported_fields`` with a message naming them; only
``user`` and ``metadata`` are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from mtplx.request import DRAFTER_NAMES, MAX_DEPTH

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "ContentPart",
    "FunctionDefinition",
    "MtplxOptions",
    "StreamOptions",
    "Tool",
    "ToolCall",
    "unsupported_fields",
]

# No vocabulary comes near 2**31; tokenizers overflow on ids past their integer type, so
# such ids are refused here, before anything decodes them.
MAX_TOKEN_ID = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# logit_bias keys are token ids written as decimal strings ("²" is a digit to str.isdigit).
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
# OpenAI's seed is an int64; the engine seeds numpy.random.default_rng([seed, position]),
# which refuses negative seeds.
MAX_SEED = 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class MtplxOptions(_Strict):
    """The ``"mtplx"`` extension: which drafter and how many draft tokens per cycle."""

    drafter: Literal[DRAFTER_NAMES] | None = None  # type: ignore[valid-type]
    depth: int | None = Field(None, ge=0, le=MAX_DEPTH)
    regex: str | None = None  # constrain the output to this regex (llguidance syntax)
    grammar: str | None = None  # ... or to this Lark grammar
    # Constrained text completes within max_tokens (the budget rule); false: it may be cut.
    close_within_max_tokens: bool = True
    # The calls one reply may make with parallel tool calls (server.tools.MAX_TOOL_CALLS).
    max_tool_calls: int | None = Field(None, ge=1, le=64)


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a final chunk carrying usage."""

    include_usage: bool = False


class ContentPart(BaseModel):
    """One content part. Only ``{"type": "text", "text": ...}`` is supported; other types
    (image_url, input_audio, ...) are rejected when the prompt is built, naming the part."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    type: str
    text: str | None = None


class FunctionCall(_Strict):
    """``function`` of an assistant's tool call: ``arguments`` is a JSON string."""

    name: str
    arguments: str


class ToolCall(_Strict):
    """One tool call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    """A callable function: ``parameters`` is a JSON schema of its arguments object."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        """Arguments are a JSON object, as OpenAI requires: a schema of anything else would
        let ``tool_choice`` required force a reply that is no call. ``{}`` is no
        parameters."""
        if parameters and parameters.get("type") != "object":
            raise ValueError(
                "the parameters must be a JSON schema of type 'object', got type "
                f"{parameters.get('type')!r}"
            )
        return parameters


class Tool(_Strict):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    """A system / developer / user / assistant / tool message. An assistant message may
    carry ``tool_calls`` (content then may be null) and ``reasoning_content``; a tool
    message answers one by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant message's thinking, as a reasoning model's reply carried it: passed to
    # the chat template, which keeps or drops it (Qwen3's keeps it within a tool loop).
    reasoning_content: str | None = None


class _SamplingFields(_Strict):
    """Parameters chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=0)  # 0: score the prompt only (completions)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 and 0 both mean off (vLLM uses -1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[TokenIdKey, float] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    user: str | None = None  # accepted and ignored
    metadata: dict[str, Any] | None = None  # accepted and ignored
    mtplx: MtplxOptions | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # a chat reply has at least one token
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None  # checked by server.structured
    # vLLM's extension: more variables for the chat template (``enable_thinking``).
    chat_template_kwargs: dict[str, Any] | None = None
    # none / minimal: a reasoning model does not think (``enable_thinking: false``); the
    # other efforts leave the chat template's default.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Defined by OpenAI, not implemented here: rejected with a 400 naming the field.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extension: the prompt tokens' logprobs, with this many alternatives each.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    response_format: Any = None  # checked by server.structured
    suffix: Any = None


_UNSUPPORTED = {
    "functions": "the deprecated 'functions' is not supported: use 'tools'",
    "function_call": "the deprecated 'function_call' is not supported: use 'tool_choice'",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "suffix": "suffix (insertion) is not supported",
}


def unsupported_fields(body: BaseModel) -> tuple[str, str] | None:
    """The first field the request sets that MTPLX does not implement: (field, reason)."""
    values = body.__dict__
    for name, reason in _UNSUPPORTED.items():
        value = values.get(name)
        if value is None or value == [] or (name == "modalities" and value == ["text"]):
            continue  # absent, or the value that asks for nothing beyond text
        return name, reason
    best_of = values.get("best_of")
    if best_of is not None and best_of > 1:
        return "best_of", "best_of > 1 is not supported"
    return None
