"""Tool-call syntax: which style a chat template teaches, rendering the history, parsing the
model's calls (malformed output stays content), and holding streamed text back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from mtplx.errors import InvalidParameter
from mtplx.grammar import check_grammar
from mtplx.request import TokenEvent
from server.schemas import ChatMessage, Tool
from server.tool_stream import ToolCallStream
from server.tools import (
    DEEPSEEK,
    GENERIC,
    HERMES,
    LLAMA,
    MAX_TOOL_CALLS,
    ToolPlan,
    call_style,
    hoist_definitions,
    parse_tool_calls,
    render_conversation,
)

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
)


def plan(style: str = GENERIC, choice: str = "auto", parallel: bool = True) -> ToolPlan:
    return ToolPlan((WEATHER,), choice, None, parallel, style)


class Template:
    def __init__(self, template: str) -> None:
        self.chat_template = template


@pytest.mark.parametrize(
    "template, style",
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", GENERIC),
        ("{% if tools %}<tool_call>{% endif %}", HERMES),
        ("{% if tools %}<｜tool▁calls▁begin｜>{% endif %}", DEEPSEEK),
        ("{% if tools %}<|python_tag|>{% endif %}", LLAMA),
    ],
)
def test_call_style(template: str, style: str) -> None:
    assert call_style(Template(template)) == style


@pytest.mark.parametrize(
    "text, content",
    [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None),
        (
            "Let me check.\n<tool_call>"
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
            "Let me check.",
        ),
        ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}', None),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None),
        (
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
            '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            None,
        ),
    ],
    ids=["hermes", "hermes-after-text", "generic", "llama", "deepseek"],
)
def test_calls_parse(text: str, content: str | None) -> None:
    parsed_content, calls = parse_tool_calls(text, plan())
    assert parsed_content == content
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
        '{"name": "unknown", "arguments": {}}',
        '{"a": 1}',
        "plain words",
        '{"tool_calls": [{"name": "get_weather", "arguments": 3}]}',
    ],
)
def test_malformed_calls_are_content(text: str) -> None:
    assert parse_tool_calls(text, plan()) == (text, [])


def test_parallel_false_keeps_one_call() -> None:
    text = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {}}] * 2})
    assert len(parse_tool_calls(text, plan(parallel=False))[1]) == 1
    assert len(parse_tool_calls(text, plan())[1]) == 2


def test_generic_rendering_puts_tools_in_the_system_prompt() -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="sunny", tool_call_id="c1"),
    ]
    conversation, tools = render_conversation(messages, plan())
    assert tools is None
    assert "get_weather" in conversation[0]["content"] and "Be brief." in conversation[0]["content"]
    assert json.loads(conversation[2]["content"])["tool_calls"][0]["arguments"] == {"city": "Oslo"}
    assert conversation[3] == {
        "role": "user",
        "content": "Result of the call to get_weather: sunny",
    }
    native, tools = render_conversation(messages, plan(HERMES))
    assert tools and tools[0]["function"]["name"] == "get_weather"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[3]["role"] == "tool" and native[3]["name"] == "get_weather"


@pytest.mark.parametrize("style", [GENERIC, HERMES, LLAMA, DEEPSEEK])
@pytest.mark.parametrize("choice", ["required", "function"])
def test_required_grammars_are_valid(style: str, choice: str) -> None:
    spec = ToolPlan(
        (WEATHER,), choice, "get_weather" if choice == "function" else None, True, style
    ).grammar()
    assert spec is not None
    check_grammar(spec)
    auto = plan(style).grammar()
    assert (auto is None) == (style != GENERIC)  # auto: only the generic format is shaped
    if auto is not None:
        check_grammar(auto)


class Chunks:
    wants_logprobs = False

    def _chunk(self, index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {"choices": [{"index": index, "delta": delta, **extra}]}

    def begin(self, index: int) -> dict[str, Any]:
        return self._chunk(index, {"role": "assistant"})

    def token(self, index: int, event: TokenEvent) -> dict[str, Any]:
        return self._chunk(index, {"content": event.text})

    def tail(self, index: int, text: str) -> dict[str, Any]:
        return self._chunk(index, {"content": text})

    def finish(self, index: int, reason: str) -> dict[str, Any]:
        return self._chunk(index, {}, finish_reason=reason)


def _stream(pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    stream = ToolCallStream(Chunks(), plan())
    sent = ""
    for piece in pieces:
        chunk = stream.token(0, TokenEvent(0, piece, False))
        if chunk is not None:
            sent += chunk["choices"][0]["delta"]["content"]
    return sent, stream.finish(0, "stop")


def test_stream_holds_back_a_call_and_sends_deltas() -> None:
    sent, tail = _stream(["Sure. <to", "ol_call>", '{"name": "get_weather", ', '"arguments": {}}'])
    assert sent == "Sure. "
    assert tail[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert tail[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_stream_of_plain_text_is_content() -> None:
    sent, tail = _stream(["Hello", " <b>", "world"])
    assert (
        sent + "".join(c["choices"][0]["delta"].get("content", "") for c in tail)
        == "Hello <b>world"
    )
    assert tail[-1]["choices"][0]["finish_reason"] == "stop"


def test_held_text_settles_the_unsent_text_before_calls() -> None:
    from server.tool_stream import HeldText

    held = HeldText()
    # Leading whitespace goes out with the first text; the content parse strips it, and
    # the rest before the call must still be sent once, not shifted by the whitespace.
    sent = held.add("  Sure") + held.add("thing ") + held.add("<tool_ca")
    sent += held.add('ll>{"name": "get_weather", "arguments": {}}</tool_call>')
    unsent, calls = held.settle(plan(HERMES))
    assert sent == "  Surething " and unsent == ""
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    plain = HeldText()
    assert plain.add("Hello") == "Hello" and plain.settle(plan()) == ("", [])


def test_split_reply() -> None:
    from server.tools import split_reply

    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert split_reply("Hi", plan()) == ("Hi", [])
    assert split_reply(call, None) == (call, [])
    text, [parsed] = split_reply(call, plan())
    assert text == "" and json.loads(parsed["function"]["arguments"]) == {"city": "Oslo"}


def test_a_bad_schema_under_auto_names_tools() -> None:
    """The generic ``auto`` grammar's errors name ``tools`` (the schema is a tool's), not
    ``response_format``, which the request never sent."""
    bad = Tool.model_validate(
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
            },
        }
    )
    spec = ToolPlan((bad,), "auto", None, True, GENERIC).grammar()
    assert spec is not None
    with pytest.raises(InvalidParameter) as error:
        check_grammar(spec)
    assert error.value.param == "tools"


@pytest.mark.parametrize(
    "parameters",
    [{"type": "array"}, {"type": "integer"}, {"enum": [1, 2]}, {"properties": {}}],
)
def test_parameters_must_be_an_object_schema(parameters: dict[str, Any]) -> None:
    """Arguments are a JSON object: a schema of anything else could force (``required``) a
    reply that is not a call."""
    with pytest.raises(ValidationError):
        Tool.model_validate(
            {"type": "function", "function": {"name": "f", "parameters": parameters}}
        )


@pytest.mark.parametrize("parameters", [None, {}, {"type": "object", "properties": {}}])
def test_object_parameters_are_accepted(parameters: dict[str, Any] | None) -> None:
    tool = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": parameters}}
    )
    assert tool.function.parameters == parameters


def test_defs_and_refs_move_to_the_root_of_the_call_grammar() -> None:
    parameters = {
        "type": "object",
        "properties": {
            "home": {"$ref": "#/$defs/Address"},
            "old": {"$ref": "#/definitions/Place"},
            "default": {"$ref": "#/properties/home"},  # a property called "default"
            "tag": {"const": {"$ref": "#/not/a/schema"}},  # data: left alone
        },
        "$defs": {"Address": {"type": "object", "properties": {"next": {"$ref": "#"}}}},
        "definitions": {"Place": {"type": "string"}},
    }
    definitions: dict[str, Any] = {}
    assert hoist_definitions(parameters, "tool0", definitions) == {"$ref": "#/$defs/tool0"}
    root = definitions["tool0"]["properties"]
    assert root["home"] == {"$ref": "#/$defs/tool0.defs.Address"}
    assert root["old"] == {"$ref": "#/$defs/tool0.definitions.Place"}
    assert root["default"] == {"$ref": "#/$defs/tool0/properties/home"}
    assert root["tag"] == {"const": {"$ref": "#/not/a/schema"}}
    assert definitions["tool0.defs.Address"]["properties"]["next"] == {"$ref": "#/$defs/tool0"}
    assert definitions["tool0.definitions.Place"] == {"type": "string"}
    plain = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert hoist_definitions(plain, "tool1", definitions) == plain


@pytest.mark.parametrize("style", [GENERIC, HERMES, LLAMA, DEEPSEEK])
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_tool_schemas_with_defs_compile_in_every_style(style: str, choice: str) -> None:
    address = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    }
    tools = tuple(
        Tool.model_validate(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "parameters": {
                        "type": "object",
                        "properties": {"home": {"$ref": "#/$defs/Address"}},
                        "required": ["home"],
                        "$defs": {"Address": address},
                    },
                },
            }
        )
        for name in ("a", "b")
    )
    spec = ToolPlan(tools, choice, None, True, style).grammar()
    if spec is not None:
        check_grammar(spec)


def test_calls_complete_before_a_cut_are_kept() -> None:
    """max_tokens cut the last call: the complete ones before it stand (JSON and Hermes)."""
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    cut = '{"name": "get_weather", "arguments": {"ci'
    for style, text in (
        (GENERIC, f'{{"tool_calls": [{call}, {call}, {cut}'),
        (GENERIC, f"[{call}, {cut}"),
        (HERMES, f"<tool_call>\n{call}\n</tool_call>\n<tool_call>\n{cut}"),
    ):
        content, calls = parse_tool_calls(text, plan(style))
        assert calls and all(
            json.loads(c["function"]["arguments"]) == {"city": "Oslo"} for c in calls
        ), (style, text)
        assert not content
    # Text that only looks like a list is still text.
    assert parse_tool_calls("[1, 2] is a list", plan(GENERIC)) == ("[1, 2] is a list", [])


def test_tool_grammars_admit_declared_arguments_only_and_a_bounded_number_of_calls() -> None:
    required = json.loads(plan(GENERIC, "required").grammar().source)
    items = required["properties"]["tool_calls"]
    assert items["maxItems"] == MAX_TOOL_CALLS
    arguments = items["items"]["properties"]["arguments"]
    assert arguments["additionalProperties"] is False  # the schema said nothing of others
    single = ToolPlan((WEATHER,), "function", "get_weather", True, GENERIC)
    schema = json.loads(single.grammar().source)
    assert schema["properties"]["tool_calls"]["maxItems"] == 1  # a named function: one call
    hermes = ToolPlan((WEATHER,), "required", None, True, HERMES, max_calls=3)
    assert '("\\n" call){0,2}' in hermes.grammar().source
    assert "call{" not in ToolPlan((WEATHER,), "required", None, False, HERMES).grammar().source
