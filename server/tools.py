"""Tool calling in OpenAI's shape: ``tools``, ``tool_choice``, ``parallel_tool_calls``, the
history's assistant ``tool_calls`` and ``tool`` messages, and the model's calls parsed back
into ``message.tool_calls``.

Two ways to put tools in the prompt:

- native: a chat template that renders tools itself (Qwen3 / Qwen3.5 / Hermes ``<tool_call>``,
  Llama 3.x, DeepSeek) gets them through ``apply_chat_template(tools=...)``, and the model's
  own call syntax is parsed.
- generic (a template without tools, such as the default model's SmolLM2): the definitions
  go into the system prompt with an instruction to answer with one JSON object
  ``{"tool_calls": [{"name": ..., "arguments": {...}}]}``.

With ``tool_choice`` ``required`` or a named function the output is constrained by a grammar
of exactly that call format (the function names and each function's parameter schema), so it
always parses. With ``auto`` the model chooses; output that does not parse as calls to the
given functions is returned as content, never an error.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtplx.grammar import GrammarSpec
from server.errors import APIError
from server.prompts import message_text
from server.schemas import ChatCompletionRequest, ChatMessage, Tool
from server.structured import JSON_OPTIONS, declared_properties_only, grammar_for

__all__ = [
    "ToolPlan",
    "call_style",
    "hoist_definitions",
    "parse_tool_calls",
    "plan_tools",
    "render_conversation",
    "reply_grammar",
    "split_reply",
]

HERMES, LLAMA, DEEPSEEK, GENERIC = "hermes", "llama", "deepseek", "generic"
DS_CALLS = "<｜tool▁calls▁begin｜>"
DS_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*?)\n```",
    re.DOTALL,
)
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
# Where a tool call may begin in the middle of the text (a streamed reply holds text back
# from here on); a JSON call must begin the reply.
CALL_MARKERS = ("<tool_call>", "<|python_tag|>", DS_CALLS)
# Calls one reply may make when parallel calls are on, unless the request says otherwise
# (``mtplx.max_tool_calls``): a small model that repeats a call is not asked for more.
MAX_TOOL_CALLS = 8


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools: ``choice`` is ``auto``, ``required`` or ``function``
    (then ``name`` is the function); ``style`` the call syntax (native or generic);
    ``max_calls`` the calls one reply may make with parallel calls (None: MAX_TOOL_CALLS);
    ``call_limit`` what holds."""

    tools: tuple[Tool, ...]
    choice: str
    name: str | None
    parallel: bool
    style: str
    max_calls: int | None = None

    @property
    def call_limit(self) -> int:
        """Calls one reply may make: one for a named function or without parallel calls."""
        if self.choice == "function" or not self.parallel:
            return 1
        return self.max_calls or MAX_TOOL_CALLS

    @property
    def native(self) -> bool:
        """Whether the chat template renders the tools."""
        return self.style != GENERIC

    def definitions(self) -> list[dict[str, Any]]:
        """The tools as the chat template expects them (OpenAI's shape)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def grammar(self) -> GrammarSpec | None:
        """The constraint for ``required`` / a named function. For ``auto``: in the generic
        format, text that does not open with ``{``, or a well-formed call (so a reply that
        starts a call always parses); native formats are left free."""
        if self.choice == "auto" and self.native:
            return None
        tools = [t for t in self.tools if self.choice != "function" or t.function.name == self.name]
        key = "parameters" if self.style == LLAMA else "arguments"
        definitions: dict[str, Any] = {}
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    # Only the declared arguments, unless the schema allows others.
                    key: hoist_definitions(
                        declared_properties_only(t.function.parameters or {"type": "object"}),
                        f"tool{i}",
                        definitions,
                    ),
                },
                "required": ["name", key],
                "additionalProperties": False,
            }
            for i, t in enumerate(tools)
        ]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        root = {"$defs": definitions} if definitions else {}
        if self.style == HERMES:
            schema = json.dumps({**call, **root, "x-guidance": JSON_OPTIONS})
            one = f'"<tool_call>\\n" %json {schema} "\\n</tool_call>"'
            limit = self.call_limit
            more = f' ("\\n" call){{0,{limit - 1}}}' if limit > 1 else ""
            rule = f"call: {one}\nstart: call{more}"
            return GrammarSpec("lark", rule, param="tool_choice")
        if self.style == GENERIC:
            items: dict[str, Any] = {
                "type": "array",
                "items": call,
                "minItems": 1,
                "maxItems": self.call_limit,
            }
            call = {
                "type": "object",
                "properties": {"tool_calls": items},
                "required": ["tool_calls"],
                "additionalProperties": False,
            }
        call = {**call, **root, "x-guidance": JSON_OPTIONS}
        if self.choice == "auto":
            # Leading whitespace is text's: a JSON call starts the reply at once.
            text = r"TEXT: /\s*[^{\s][\s\S]*/"
            rule = f"start: TEXT | call\n{text}\ncall: %json {json.dumps(call)}"
            return GrammarSpec("lark", rule, param="tools")
        return GrammarSpec.json_schema(call, param="tool_choice")


# Keywords whose values are data, not schemas: a "$ref" key inside them is left alone.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
# Keywords whose values map names to schemas (a property may be called "default").
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def _is_local_ref(key: str, item: Any) -> bool:
    return key == "$ref" and isinstance(item, str) and item.startswith("#")


def _rewrite_refs(value: Any, rename: Callable[[str], str], names: bool = False) -> Any:
    """``value`` (a schema, or with ``names`` a map of names to schemas) with every local
    ``$ref`` (one starting with ``#``) passed through ``rename``; data is left alone."""
    if isinstance(value, list):
        return [_rewrite_refs(item, rename) for item in value]
    if not isinstance(value, dict):
        return value
    out: dict[str, Any] = {}
    for key, item in value.items():
        if names:
            out[key] = _rewrite_refs(item, rename)
        elif _is_local_ref(key, item):
            out[key] = rename(item)
        elif key in _DATA_KEYWORDS:
            out[key] = item
        else:
            out[key] = _rewrite_refs(item, rename, key in _SCHEMA_MAPS)
    return out


def _has_local_ref(value: Any, names: bool = False) -> bool:
    if isinstance(value, list):
        return any(_has_local_ref(item) for item in value)
    if not isinstance(value, dict):
        return False
    for key, item in value.items():
        if names:
            found = _has_local_ref(item)
        else:
            found = _is_local_ref(key, item) or (
                key not in _DATA_KEYWORDS and _has_local_ref(item, key in _SCHEMA_MAPS)
            )
        if found:
            return True
    return False


def hoist_definitions(schema: dict[str, Any], name: str, definitions: dict[str, Any]) -> Any:
    """``schema`` (a tool's parameters), ready to be nested inside a larger schema: its
    ``$defs`` / ``definitions`` move into ``definitions`` (the larger schema's root
    ``$defs``) as ``{name}.defs.X`` / ``{name}.definitions.X``, and the schema itself as
    ``name``; every local ``$ref`` (``#/$defs/X``, ``#/definitions/X``, ``#``,
    ``#/properties/...``) is rewritten to point there. The schema is returned as it is
    when it has no local references."""
    if not _has_local_ref(schema):
        return {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rename(ref: str) -> str:
        pointer = ref[1:]
        for keyword, group in (("/$defs/", "defs"), ("/definitions/", "definitions")):
            if pointer.startswith(keyword):
                return f"#/$defs/{name}.{group}.{pointer[len(keyword) :]}"
        return f"#/$defs/{name}{pointer}"

    for keyword, group in (("$defs", "defs"), ("definitions", "definitions")):
        for key, definition in (schema.get(keyword) or {}).items():
            definitions[f"{name}.{group}.{key}"] = _rewrite_refs(definition, rename)
    body = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}
    definitions[name] = _rewrite_refs(body, rename)
    return {"$ref": f"#/$defs/{name}"}


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the tool-use one if there is one
        template = template.get("tool_use") or template.get("default")
    return template if isinstance(template, str) else ""


def call_style(tokenizer: Any) -> str:
    """The tool-call syntax the model's chat template teaches, GENERIC if it knows none."""
    template = _template(tokenizer)
    if "tools" not in template:
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if "tool▁call" in template:
        return DEEPSEEK
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return LLAMA
    return HERMES if "tool_call" in template else GENERIC


def plan_tools(body: ChatCompletionRequest, tokenizer: Any) -> ToolPlan | None:
    """The request's ToolPlan; None without tools or with ``tool_choice: none``."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(
                400, "tool_choice needs tools", param="tool_choice", code="invalid_value"
            )
        return None
    if choice == "none":
        return None
    name = None
    if choice is not None and not isinstance(choice, str):
        name = choice.function.name
        if name not in {t.function.name for t in body.tools}:
            raise APIError(
                400,
                f"tool_choice names function {name!r}, which is not in tools",
                param="tool_choice",
                code="invalid_value",
            )
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool names must be unique", param="tools", code="invalid_value")
    parallel = body.parallel_tool_calls is not False
    most = body.mtplx.max_tool_calls if body.mtplx is not None else None
    return ToolPlan(
        tools=tuple(body.tools),
        choice="function" if name else (choice or "auto"),  # type: ignore[arg-type]
        name=name,
        parallel=parallel,
        style=call_style(tokenizer),
        max_calls=most,
    )


def reply_grammar(body: ChatCompletionRequest, plan: ToolPlan | None) -> GrammarSpec | None:
    """The constraint on a chat request's reply: the tool plan's, or the request's own
    (``response_format`` / ``mtplx.regex`` / ``mtplx.grammar``), validated whatever the tools
    say (never silently dropped). Both at once only with ``tool_choice`` auto: then the
    request's own shapes a reply that calls no tool."""
    options = body.mtplx
    own = grammar_for(
        body.response_format,
        options.regex if options else None,
        options.grammar if options else None,
    )
    if plan is None:
        return own
    if own is None:
        return plan.grammar()
    if plan.choice != "auto":
        field = "response_format" if own.param.startswith("response_format") else own.param
        raise APIError(
            400,
            f"tool_choice {plan.choice!r} constrains the reply to tool calls: send no "
            f"{field} with it",
            param=field,
            code="invalid_value",
        )
    return own


def _generic_instructions(plan: ToolPlan) -> str:
    functions = [
        {
            "name": t.function.name,
            "description": t.function.description or "",
            "parameters": t.function.parameters or {"type": "object"},
        }
        for t in plan.tools
    ]
    shape = '{"tool_calls": [{"name": "<function name>", "arguments": {<arguments>}}]}'
    if plan.choice == "function":
        when = f"You must call the function {plan.name}."
    elif plan.choice == "required":
        when = "You must call one or more of these functions."
    else:
        when = "Call them when they help; otherwise answer normally."
    return (
        "You can call these functions (each with a JSON schema of its arguments):\n"
        f"{json.dumps(functions, ensure_ascii=False)}\n{when} To call functions, reply with "
        f"only this JSON object and nothing else:\n{shape}"
    )


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def render_conversation(
    messages: list[ChatMessage], plan: ToolPlan | None, style: str = GENERIC
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation as chat-template messages, and the tools for the template (None
    when the template does not render them). ``style``: the template's call syntax (it
    decides how a history's calls render when the request offers no tools)."""
    native = plan.native if plan is not None else style != GENERIC
    names: dict[str, str] = {}
    conversation: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        text = message_text(message, index)
        entry: dict[str, Any] = {"role": role, "content": text}
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            for call in message.tool_calls:
                names[call.id] = call.function.name
            calls = [
                (c.function.name, _arguments(c.function.arguments)) for c in message.tool_calls
            ]
            if native:
                entry["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": n, "arguments": a}}
                    for c, (n, a) in zip(message.tool_calls, calls, strict=True)
                ]
            else:
                payload = {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}
                entry["content"] = (text + "\n" if text else "") + json.dumps(payload)
        if role == "tool":
            if not message.tool_call_id:
                raise APIError(
                    400,
                    f"Missing required parameter: 'messages[{index}].tool_call_id'.",
                    param=f"messages[{index}].tool_call_id",
                    code="missing_required_parameter",
                )
            name = message.name or names.get(message.tool_call_id, "")
            if native:
                entry.update({"tool_call_id": message.tool_call_id, "name": name})
            else:  # templates without tools know no "tool" role
                entry = {"role": "user", "content": f"Result of the call to {name}: {text}"}
        conversation.append(entry)
    if plan is not None and not plan.native:
        instructions = _generic_instructions(plan)
        if conversation and conversation[0]["role"] == "system":
            conversation[0]["content"] = instructions + "\n\n" + conversation[0]["content"]
        else:
            conversation.insert(0, {"role": "system", "content": instructions})
    tools = plan.definitions() if plan is not None and plan.native else None
    return conversation, tools


def _call(value: Any, names: set[str]) -> dict[str, Any] | None:
    """An OpenAI tool call from a parsed ``{"name", "arguments" | "parameters"}``."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        arguments = _arguments(arguments)
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _json_calls(text: str, names: set[str]) -> list[dict[str, Any]] | None:
    try:
        value = json.loads(text)
    except ValueError:
        value = _complete_items(text)
        if value is None:
            return None
    if isinstance(value, dict) and "tool_calls" in value:
        value = value["tool_calls"]
    values = value if isinstance(value, list) else [value]
    calls = [_call(v, names) for v in values]
    return calls if calls and all(calls) else None  # type: ignore[return-value]


def _complete_items(text: str) -> list[Any] | None:
    """The complete calls of a JSON list of calls that was cut (``[{...}, {...}, {"na`` or
    ``{"tool_calls": [{...}, {"na``), None when there is none: what max_tokens cut is
    dropped, the calls before it stand."""
    match = re.match(r'\s*(?:\{\s*"tool_calls"\s*:\s*)?\[', text)
    if match is None:
        return None
    decoder, items, at = json.JSONDecoder(), [], match.end()
    while True:
        at = len(text) - len(text[at:].lstrip(" \n\t,"))
        try:
            item, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
    return items or None


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply. Calls in the model's syntax (Hermes ``<tool_call>``,
    DeepSeek's markers, a JSON object or list, Llama's ``<|python_tag|>``) to functions the
    request offered; anything else is content, and no calls."""
    names = {t.function.name for t in plan.tools}
    calls: list[dict[str, Any]] | None = None
    start = len(text)
    if "<tool_call>" in text:
        start = text.index("<tool_call>")
        found = [_json_calls(m.group(1), names) for m in HERMES_CALL.finditer(text, start)]
        if found and found[-1] is None and not text.rstrip().endswith("</tool_call>"):
            found.pop()  # a call cut by max_tokens: the complete ones before it stand
        calls = [c for group in found if group for c in group] if all(found) else None
    elif DS_CALLS in text:
        start = text.index(DS_CALLS)
        found = [
            _call({"name": m.group(1).strip(), "arguments": _arguments(m.group(2))}, names)
            for m in DS_CALL.finditer(text, start)
        ]
        calls = found if found and all(found) else None  # type: ignore[assignment]
    else:
        stripped = text.strip()
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>") :].strip()
        if stripped.startswith(("{", "[")):
            start = 0
            calls = _json_calls(stripped, names)
    if not calls:
        return text, []
    calls = calls[: plan.call_limit]
    content = text[:start].strip()
    return content or None, calls


def split_reply(text: str, plan: ToolPlan | None) -> tuple[str, list[dict[str, Any]]]:
    """(text, calls) of a whole reply for the APIs that answer calls beside the text
    (Anthropic's ``tool_use`` blocks, the Responses API's ``function_call`` items): the text
    before the calls ("" when none), or all of it when there are none."""
    if plan is None:
        return text, []
    content, calls = parse_tool_calls(text, plan)
    return (content or "", calls) if calls else (text, [])
