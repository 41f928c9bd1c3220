"""Prompts as token ids: the chat template over the messages, or the completions prompt
(strings or token ids), with the checks that must come before any tokenizer work.

Size is checked before tokenizing (a prompt with more characters than the context could
hold at ``CHARS_PER_TOKEN_BOUND`` characters a token cannot fit, whatever the tokenizer;
every part the prompt renders counts: all text parts, names, tool calls' arguments, the
tools' descriptions and parameter schemas),
token ids against the vocabulary before decoding them (a tokenizer overflows on ids past
its integer type), and tokenizing itself runs in a worker thread, one at a time, so a
long prompt never stalls the event loop (and /health with it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

from server.errors import APIError
from server.reasoning import ReplyReasoning
from server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

__all__ = [
    "CHARS_PER_TOKEN_BOUND",
    "Prompt",
    "chat_prompt",
    "check_prompt_size",
    "check_template_kwargs",
    "completion_prompts",
    "count_prompts",
    "in_tokenizer_thread",
    "message_chars",
]

# More characters per token than any tokenizer averages over a whole prompt (English runs
# about 4, code about 3; only long runs of repeated whitespace merge further).
CHARS_PER_TOKEN_BOUND = 16

T = TypeVar("T")

# Tokenizers are not guaranteed thread-safe (the Rust one refuses a concurrent mutable
# borrow); requests tokenize one at a time, off the event loop.
_TOKENIZER_LOCK = threading.Lock()


@dataclass(frozen=True)
class Prompt:
    """One prompt as token ids, and its text (for ``echo``). ``starts_reply``: the output
    begins a chat turn of its own (not a continuation of the prompt's text).
    ``reply_prefix``: the text in front of the reply inside its turn (the generation prompt
    and a prefill), when asked for. ``reasoning``: how a reply's thinking is told from its
    answer (None: all answer)."""

    token_ids: list[int]
    text: str
    starts_reply: bool = False
    reply_prefix: str | None = None
    reasoning: ReplyReasoning | None = None


# apply_chat_template's own arguments (and what would swap the template itself): a
# request's chat_template_kwargs cannot set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "chat_template",
        "continue_final_message",
        "conversation",
        "documents",
        "max_length",
        "messages",
        "padding",
        "return_assistant_tokens_mask",
        "return_dict",
        "return_tensors",
        "tokenize",
        "tokenizer_kwargs",
        "tools",
        "truncation",
    }
)


def check_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's ``chat_template_kwargs`` as the variables to pass the chat template
    (``enable_thinking`` and the like); 400 for a key that is apply_chat_template's own."""
    reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs cannot set {reserved[0]!r}: it is the server's to set",
            param=f"chat_template_kwargs.{reserved[0]}",
            code="invalid_value",
        )
    return dict(kwargs or {})


def count_prompts(prompt: str | list[Any]) -> int:
    """How many prompts a completions ``prompt`` holds (a string or a list of token ids
    is one)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _too_long(param: str, size: str, context_length: int) -> APIError:
    return APIError(
        400,
        f"This model's maximum context length is {context_length} tokens. However, {size}, "
        "more than that context can hold.",
        param=param,
        code="context_length_exceeded",
    )


def _size(value: Any, budget: int) -> int:
    """Characters of the strings (values and keys) in ``value``, numbers and literals as a
    few each; the walk stops once the count passes ``budget``, so a huge value costs no
    more than the limit it is checked against."""
    total = 0
    stack = [value]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(str(key)) for key in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif item is not None:
            total += 4
    return total


def message_chars(message: ChatMessage, budget: int) -> int:
    """Characters of everything in a message the prompt renders: content (every text
    part), name, tool call ids, names and arguments."""
    content = message.content
    parts: list[Any] = [
        content if not isinstance(content, list) else [part.text for part in content],
        message.name,
        message.tool_call_id,
        message.reasoning_content,
    ]
    for call in message.tool_calls or []:
        parts += [call.id, call.function.name, call.function.arguments]
    return _size(parts, budget)


def _tool_chars(body: ChatCompletionRequest, budget: int) -> int:
    """Characters of the tool definitions (names, descriptions, parameter schemas)."""
    definitions = [
        [t.function.name, t.function.description, t.function.parameters] for t in body.tools or []
    ]
    return _size(definitions, budget)


def check_prompt_size(
    body: ChatCompletionRequest | CompletionRequest,
    context_length: int,
    vocab_size: int | None = None,
) -> None:
    """400 for a prompt that cannot fit the context, judged without tokenizing: more than
    ``context_length * CHARS_PER_TOKEN_BOUND`` characters, or at least ``context_length``
    token ids; and for token ids outside the vocabulary (when its size is known)."""
    max_chars = context_length * CHARS_PER_TOKEN_BOUND
    if isinstance(body, ChatCompletionRequest):
        chars = 0
        for message in body.messages:
            # A message renders at least one token of its own (its role header), so that
            # many tiny messages cannot hold the tokenizer for seconds within the bound.
            chars += CHARS_PER_TOKEN_BOUND + message_chars(message, max_chars - chars)
            if chars > max_chars:
                raise _too_long(
                    "messages", f"your messages are over {max_chars} characters", context_length
                )
        tools = _tool_chars(body, max_chars - chars)
        if chars + tools > max_chars:
            raise _too_long(
                "tools",
                f"your messages and tools are over {max_chars} characters",
                context_length,
            )
        return
    prompt = body.prompt
    if not prompt:
        return  # completion_prompts names the empty prompt
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    for i, entry in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(entry, str):
            if len(entry) > max_chars:
                raise _too_long(param, f"the prompt is {len(entry)} characters", context_length)
            continue
        if len(entry) >= context_length:
            raise _too_long(param, f"the prompt is {len(entry)} tokens", context_length)
        if vocab_size is not None:
            bad = [t for t in entry if t >= vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab_size})",
                    param=param,
                    code="invalid_value",
                )


def message_text(message: ChatMessage, index: int) -> str:
    """The text of a message's content (text parts joined by newlines; an assistant's or a
    tool's null is empty). As OpenAI: a user, system or developer message must carry
    content, and a list of parts may not be empty."""
    where = f"messages[{index}].content"
    if message.content is None:
        if message.role in ("user", "system", "developer"):
            raise APIError(
                400,
                f"Missing required parameter: '{where}'.",
                param=where,
                code="missing_required_parameter",
            )
        return ""
    if isinstance(message.content, str):
        return message.content
    if not message.content:
        raise APIError(
            400,
            f"Invalid '{where}': empty array. Expected an array with minimum length 1, but got "
            "an empty array instead.",
            param=where,
            code="empty_array",
        )
    texts = []
    for j, part in enumerate(message.content):
        where = f"messages[{index}].content[{j}]"
        if part.type != "text":
            raise APIError(
                400,
                f"only text content parts are supported, got type {part.type!r}",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
        if part.text is None:
            raise APIError(
                400,
                f"Missing required parameter: '{where}.text'.",
                param=f"{where}.text",
                code="missing_required_parameter",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _as_token_ids(tokenizer: Any, value: Any) -> list[int]:
    """What ``apply_chat_template(..., tokenize=True)`` returned, as token ids. Depending on
    the tokenizer and its version that is a list of ids, a batched list, an array, a
    mapping with ``input_ids`` (transformers 5's BatchEncoding), or the rendered text (a
    template wrapper that ignores ``tokenize``): that is encoded without adding special
    tokens again, since the template already wrote them."""
    if isinstance(value, Mapping):
        value = value["input_ids"]
    if isinstance(value, str):
        return [int(t) for t in tokenizer.encode(value, add_special_tokens=False)]
    if hasattr(value, "tolist"):
        value = value.tolist()
    value = list(value)
    if value and not isinstance(value[0], int) and hasattr(value[0], "__len__"):  # batched
        value = list(value[0])
    return [int(t) for t in value]


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    continue_final: bool = False,
    conversation: list[dict[str, Any]] | None = None,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    *,
    reply_prefix: bool = False,
) -> Prompt:
    """Token ids of the conversation under the model's chat template (generation prompt
    appended). ``developer`` is sent to the template as ``system``.

    With ``continue_final`` a last assistant message is a prefill (Anthropic's rule): the
    reply continues that text, so it follows the generation prompt as plain tokens instead of
    being rendered as a finished turn. ``conversation``: the messages already rendered as
    template dicts (tool calling does that); ``tools``: tool definitions for a template that
    renders them itself; ``template_kwargs``: more variables for the template
    (``enable_thinking``, checked by ``check_template_kwargs``); ``reply_prefix``: also
    work out ``Prompt.reply_prefix`` (the conversation is rendered once more without the
    generation prompt, which is then what the text with it adds)."""
    if continue_final and len(messages) > 1 and messages[-1].role == "assistant":
        # A rendered conversation ends with the prefill's entry (rendering only ever
        # inserts in front, the generic tools' system prompt).
        head_conversation = conversation[:-1] if conversation is not None else None
        head = chat_prompt(
            tokenizer,
            messages[:-1],
            False,
            head_conversation,
            tools,
            template_kwargs,
            reply_prefix=reply_prefix,
        )
        prefill = message_text(messages[-1], len(messages) - 1)
        ids = tokenizer.encode(prefill, add_special_tokens=False) if prefill else []
        prefix = head.reply_prefix + prefill if head.reply_prefix is not None else None
        return Prompt(
            head.token_ids + [int(t) for t in ids], "", starts_reply=not ids, reply_prefix=prefix
        )
    if conversation is None:
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": message_text(m, i)}
            for i, m in enumerate(messages)
        ]
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, **extra
        )
        prefix = _generation_prompt(tokenizer, conversation, extra) if reply_prefix else None
    except (ValueError, TypeError, KeyError) as exc:  # no template, or one rejecting the roles
        raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
    return Prompt(_as_token_ids(tokenizer, ids), "", starts_reply=True, reply_prefix=prefix)


def _generation_prompt(
    tokenizer: Any, conversation: list[dict[str, Any]], extra: Mapping[str, Any]
) -> str:
    """The text the template's generation prompt adds to the conversation (all of the
    text, if the template renders the conversation differently with it)."""
    texts = [
        tokenizer.apply_chat_template(
            conversation, add_generation_prompt=generation, tokenize=False, **extra
        )
        for generation in (False, True)
    ]
    without, with_prompt = (t if isinstance(t, str) else "" for t in texts)
    return with_prompt[len(without) :] if with_prompt.startswith(without) else with_prompt


def completion_prompts(tokenizer: Any, prompt: str | list[Any]) -> list[Prompt]:
    """One Prompt per entry: a string, a list of strings, token ids or lists of token ids."""
    if isinstance(prompt, str):
        return [Prompt(list(tokenizer.encode(prompt)), prompt)]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="invalid_value")
    if isinstance(prompt[0], int):
        return [Prompt(list(prompt), tokenizer.decode(prompt))]
    if isinstance(prompt[0], str):
        return [Prompt(list(tokenizer.encode(text)), text) for text in prompt]
    return [Prompt(list(ids), tokenizer.decode(ids)) for ids in prompt]


def _locked(function: Callable[..., T], *args: Any) -> T:
    with _TOKENIZER_LOCK:
        return function(*args)


async def in_tokenizer_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` in a worker thread, one tokenizing call at a time."""
    return await run_in_threadpool(_locked, function, *args)
