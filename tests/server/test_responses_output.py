"""The Responses API's output for replies with function calls: the ``function_call`` items of
the whole response, and the stream fed token by token (the message item only when there is
text, argument deltas, output indexes and sequence numbers)."""

from __future__ import annotations

import json
from typing import Any

from mtplx.request import FinishEvent, GenerationStats, TokenEvent
from server.responses_api import ResponsesRequest
from server.responses_output import ResponseBuilder, ResponsesEvents
from server.schemas import Tool
from server.tools import HERMES, ToolPlan

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
)
PLAN = ToolPlan((WEATHER,), "auto", None, True, HERMES)
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'


def run(pieces: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    """The events' data of a reply made of ``pieces`` (the last is the finish's tail)."""
    body = ResponsesRequest(model="m", input="x")
    events = ResponsesEvents(ResponseBuilder(body, "m"), PLAN)
    sse = events.opening(0)
    for piece in pieces[:-1]:
        sse += events.token(0, TokenEvent(0, piece, False))
    finish = FinishEvent(finish_reason=reason, stats=GenerationStats(), text=pieces[-1])  # type: ignore[arg-type]
    sse += events.finish(0, finish) + events.closing(USAGE, {})
    data = [json.loads(e["data"]) for e in sse]
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    return data


def test_text_then_two_calls() -> None:
    events = run(["Checking", ". ", CALL % "Oslo", "\n", CALL % "Rome", ""])
    kinds = [e["type"] for e in events]
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == [0, 1, 2]
    assert [e["item"]["type"] for e in added] == ["message", "function_call", "function_call"]
    assert added[1]["item"]["arguments"] == "" and added[1]["item"]["status"] == "in_progress"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Checking. "
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert [json.loads(d["delta"]) for d in deltas] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert [d["output_index"] for d in deltas] == [1, 2]
    assert deltas[0]["item_id"] == added[1]["item"]["id"] and deltas[0]["item_id"].startswith("fc_")
    assert kinds.count("response.output_item.done") == 3
    final = events[-1]
    assert final["type"] == "response.completed"
    output = final["response"]["output"]
    assert [item["type"] for item in output] == ["message", "function_call", "function_call"]
    assert output[1]["call_id"].startswith("call_") and output[1]["status"] == "completed"
    assert output[1]["id"] == added[1]["item"]["id"]


def test_only_a_call_has_no_message_item() -> None:
    events = run([CALL % "Oslo", ""])
    assert not any(e["type"].startswith("response.output_text") for e in events)
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and json.loads(item["arguments"]) == {"city": "Oslo"}


def test_no_call_is_a_message_even_when_cut() -> None:
    events = run(["<tool_", "call> broken", ""], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    [item] = events[-1]["response"]["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "<tool_call> broken"


def test_final_response_matches_the_stream_shape() -> None:
    builder = ResponseBuilder(ResponsesRequest(model="m", input="x"), "m")
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = builder.final(("", [call]), "stop", USAGE, {})
    assert reply["status"] == "completed"
    assert reply["output"] == [
        {
            "id": "fc_1",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_1",
            "name": "f",
            "arguments": "{}",
        }
    ]
