"""The Anthropic stream events of replies with tools, fed token by token: text held back
while it may be a call, ``tool_use`` blocks with their input as ``input_json_delta``, and
block indexes that follow each other."""

from __future__ import annotations

import json
from typing import Any

from mtplx.request import FinishEvent, GenerationStats, TokenEvent
from server.anthropic_stream import AnthropicEvents
from server.schemas import Tool
from server.tools import GENERIC, HERMES, ToolPlan

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
)
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
CALL = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'


def run(pieces: list[str], style: str = GENERIC, tools: bool = True) -> list[dict[str, Any]]:
    """The events' data of a reply made of ``pieces`` (the last is the finish's tail)."""
    plan = ToolPlan((WEATHER,), "auto", None, True, style) if tools else None
    events = AnthropicEvents("msg_1", "m", 5, plan)
    sse = events.opening(0)
    for piece in pieces[:-1]:
        sse += events.token(0, TokenEvent(0, piece, False))
    finish = FinishEvent(finish_reason="stop", stats=GenerationStats(), text=pieces[-1])
    sse += events.finish(0, finish) + events.closing(USAGE, {})
    assert all(e["event"] == json.loads(e["data"])["type"] for e in sse)
    return [json.loads(e["data"]) for e in sse]


def blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks as a client accumulates them."""
    content: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(content)  # indexes follow each other
            content.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                content[event["index"]]["text"] += delta["text"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "content_block_stop" and event["index"] in partial:
            content[event["index"]]["input"] = json.loads(partial[event["index"]])
    return content


def test_text_then_a_native_call() -> None:
    events = run(
        [
            "Let me ",
            "look. <tool",
            "_call>",
            '{"name": "get_weather", ',
            '"arguments": {"city": "Oslo"}}',
            "</tool_call>",
        ],
        style=HERMES,
    )
    [text, use] = blocks(events)
    assert text == {"type": "text", "text": "Let me look. "}
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert use["name"] == "get_weather" and use["input"] == {"city": "Oslo"}
    start = next(e for e in events if e["type"] == "content_block_start" and e["index"] == 1)
    assert start["content_block"]["input"] == {}  # the delta fills it
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_a_reply_that_only_calls_has_no_text_block() -> None:
    events = run([CALL[:10], CALL[10:], ""])
    [use] = blocks(events)
    assert use["input"] == {"city": "Oslo"}
    types = [e["type"] for e in events]
    assert types[:2] == ["message_start", "ping"]
    assert types.count("content_block_start") == types.count("content_block_stop") == 1


def test_a_reply_that_calls_nothing_is_one_text_block() -> None:
    events = run(["  {not a call", "", ""])
    assert blocks(events) == [{"type": "text", "text": "  {not a call"}]
    assert events[-2]["delta"]["stop_reason"] == "end_turn"
    assert blocks(run(["", ""])) == [{"type": "text", "text": ""}]  # empty: still the block


def test_without_tools_the_text_block_opens_at_once() -> None:
    events = run(["Hi", " there", "!"], tools=False)
    assert [e["type"] for e in events[:3]] == ["message_start", "content_block_start", "ping"]
    assert blocks(events) == [{"type": "text", "text": "Hi there!"}]
