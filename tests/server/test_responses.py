"""POST /v1/responses (the OpenAI Responses API, text, stateless) on the fake engine: the
response object, incomplete replies, the typed stream events and the 400s for what it does
not do."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fake_engine import FakeEngine
from tests.server.helpers import MODEL, named_events

pytestmark = pytest.mark.anyio

RESPONSES = "/v1/responses"
F_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
OUTPUT = {"type": "function_call_output", "output": "x"}

STREAM_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def body(input_: Any = "hi", **extra: Any) -> dict[str, Any]:
    """A minimal valid Responses request."""
    return {"model": MODEL, "input": input_, **extra}


def prompt_text(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_ids)


def output_text(response: dict[str, Any]) -> str:
    [item] = response["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    return "".join(part["text"] for part in item["content"] if part["type"] == "output_text")


async def test_response_object(client, engine):
    request = body("hello [[eos]]", instructions="Be brief.", store=True, temperature=0)
    r = await client.post(RESPONSES, json=request)
    assert r.status_code == 200
    reply = r.json()
    assert reply["id"].startswith("resp_") and reply["object"] == "response"
    assert reply["status"] == "completed" and reply["incomplete_details"] is None
    assert reply["model"] == MODEL and reply["error"] is None
    assert reply["store"] is False  # nothing is kept, whatever was asked
    assert output_text(reply) == engine.expected_text(engine.requests[-1])
    assert reply["output"][0]["id"].startswith("msg_")
    assert prompt_text(engine) == "<|system|>Be brief.\n<|user|>hello [[eos]]\n<|assistant|>"
    usage = reply["usage"]
    assert usage["input_tokens"] == len(engine.requests[-1].prompt_ids)
    assert usage["output_tokens"] == 5
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert reply["mtplx"]["cycles"] >= 1


async def test_max_output_tokens_makes_it_incomplete(client, engine):
    reply = (await client.post(RESPONSES, json=body(max_output_tokens=7, temperature=0))).json()
    assert reply["status"] == "incomplete"
    assert reply["incomplete_details"] == {"reason": "max_output_tokens"}
    assert reply["output"][0]["status"] == "incomplete"
    assert reply["usage"]["output_tokens"] == 7 and reply["max_output_tokens"] == 7
    assert engine.requests[-1].max_tokens == 7 and engine.requests[-1].sampler.temperature == 0


async def test_message_items_and_parameters(client, engine):
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "b", "annotations": []}],
        },
        {"role": "user", "content": "c"},
    ]
    r = await client.post(
        RESPONSES,
        json=body(
            items,
            top_p=0.5,
            metadata={"k": "v"},
            truncation="disabled",
            text={"format": {"type": "text"}},
            tool_choice="auto",
            mtplx={"drafter": "none"},
        ),
    )
    assert r.status_code == 200, r.text
    assert prompt_text(engine) == (
        "<|system|>Rules.\n<|user|>a\n<|assistant|>b\n<|user|>c\n<|assistant|>"
    )
    assert engine.requests[-1].sampler.top_p == 0.5 and engine.requests[-1].drafter == "none"
    assert r.json()["metadata"] == {"k": "v"} and r.json()["top_p"] == 0.5


async def test_stream_events(client):
    whole = (await client.post(RESPONSES, json=body(max_output_tokens=30, temperature=0))).json()
    r = await client.post(RESPONSES, json=body(max_output_tokens=30, temperature=0, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = named_events(r.text)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert names[:4] == STREAM_ORDER
    assert names[-4:] == [*STREAM_END, "response.incomplete"]  # max_output_tokens cut it
    assert set(names[4:-4]) == {"response.output_text.delta"}
    created = events[0][1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
    assert text == output_text(whole)
    done = dict(events)["response.output_text.done"]
    assert done["text"] == text
    item_id = events[2][1]["item"]["id"]
    assert all(d["item_id"] == item_id for n, d in events if "output_text" in n)
    final = events[-1][1]["response"]
    assert final["id"] == created["id"] and output_text(final) == text
    assert final["usage"]["output_tokens"] == 30


async def test_stream_completed(client):
    r = await client.post(RESPONSES, json=body("x [[eos]]", stream=True))
    events = named_events(r.text)
    assert events[-1][0] == "response.completed"
    assert events[-1][1]["response"]["status"] == "completed"


async def test_failure_mid_stream(client):
    r = await client.post(RESPONSES, json=body("[[fail]]", stream=True))
    events = named_events(r.text)
    assert [n for n, _ in events][-2:] == ["error", "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed"


@pytest.mark.parametrize(
    ("request_body", "status", "param"),
    [
        (body(previous_response_id="resp_123"), 400, "previous_response_id"),
        (body(tools=[{"type": "web_search_preview"}]), 400, "tools[0].type"),
        (body(tools=[{"type": "function"}]), 400, "tools[0].name"),
        (body(tools=[{**F_TOOL, "parameters": 3}]), 400, "tools[0].parameters"),
        (body(tools=[{**F_TOOL, "parameters": {"type": "array"}}]), 400, "tools[0].parameters"),
        (body(tool_choice="required"), 400, "tool_choice"),
        (body(tools=[F_TOOL], tool_choice={"type": "file_search"}), 400, "tool_choice"),
        (body(tools=[F_TOOL], tool_choice={"type": "function", "name": "g"}), 400, "tool_choice"),
        (body(reasoning={"effort": "highest"}), 400, "reasoning.effort"),
        (body(background=True), 400, "background"),
        (body(include=["message.output_text.logprobs"]), 400, "include"),
        (body(text={"format": {"type": "json_object"}}), 400, "text.format"),
        (body(truncation="auto"), 400, "truncation"),
        (body([{"type": "function_call_output", "call_id": "c"}]), 400, "input[0].output"),
        (body([{**OUTPUT, "call_id": "c"}]), 400, "input[0].call_id"),
        (body([{"type": "function_call", "call_id": "c", "name": "f"}]), 400, "input[0].arguments"),
        (body([{"type": "web_search_call", "id": "w"}]), 400, "input[0].type"),
        (body([{"role": "user", "content": [{"type": "input_file"}]}]), 400, "input[0].content[0]"),
        (body([{"role": "tool", "content": "x"}]), 400, "input[0].role"),
        (body([]), 400, "input"),
        (body(max_output_tokens=100_000), 400, "max_output_tokens"),
        (body(temperature=3), 400, "temperature"),
        (body(model="gpt-5"), 404, "model"),
        (body(bogus=1), 400, "bogus"),
        ({"model": MODEL}, 400, "input"),
    ],
    ids=[
        "previous-response-id", "built-in-tool", "tool-without-name", "tool-parameters",
        "tool-parameters-not-an-object",
        "tool-choice-without-tools", "tool-choice-built-in", "tool-choice-unknown-function",
        "reasoning", "background", "include", "json-format", "truncation-auto",
        "function-call-output-without-output", "function-call-output-without-call",
        "function-call-without-arguments", "web-search-item", "input-image", "tool-role",
        "empty-input", "max-output-tokens", "temperature", "unknown-model", "unknown-field",
        "missing-input",
    ],
)  # fmt: skip
async def test_bad_requests(client, request_body, status, param):
    r = await client.post(RESPONSES, json=request_body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert (await client.post(RESPONSES, json=body(max_output_tokens=2))).status_code == 200


async def test_non_object_parameters_say_why(client):
    tool = {**F_TOOL, "parameters": {"type": "array"}}
    r = await client.post(RESPONSES, json=body(tools=[tool]))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "Invalid value for 'tools[0].parameters': the parameters must be a JSON schema of "
        "type 'object', got type 'array'"
    )


def test_usage_reports_cached_prompt_tokens():
    from server.responses_api import ResponsesRequest
    from server.responses_output import ResponseBuilder

    builder = ResponseBuilder(ResponsesRequest(model=MODEL, input="x"), MODEL)
    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    reply = builder.final(("text", []), "stop", usage, {})
    assert reply["usage"]["input_tokens"] == 100 and reply["usage"]["total_tokens"] == 107
    assert reply["usage"]["input_tokens_details"] == {"cached_tokens": 64}


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
CALL_ITEMS = [
    {"role": "user", "content": "Weather?"},
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
    },
    {
        "type": "function_call",
        "id": "fc_1",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
        "status": "completed",
    },
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
]


async def test_function_items_reach_the_prompt_and_tools_are_echoed(client, engine):
    request = body(
        CALL_ITEMS,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
        max_tool_calls=3,
    )
    r = await client.post(RESPONSES, json=request)
    assert r.status_code == 200, r.text
    prompt = prompt_text(engine)
    # The fake template knows no tools: the generic format, the call merged into the
    # assistant message before it, its output as a user turn.
    assert "You must call the function get_weather." in prompt
    assert prompt.endswith(
        '<|user|>Weather?\n<|assistant|>Checking.\n{"tool_calls": [{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}]}\n<|user|>Result of the call to get_weather: sunny\n'
        "<|assistant|>"
    )
    assert engine.requests[-1].grammar is not None  # a named function: constrained
    reply = r.json()
    assert reply["tools"] == [WEATHER] and reply["parallel_tool_calls"] is False
    assert reply["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert reply["max_tool_calls"] == 3
    # The fake engine's words are no call: the output is the message.
    assert [item["type"] for item in reply["output"]] == ["message"]


async def test_auto_tool_choice_without_tools_is_the_default(client):
    r = await client.post(RESPONSES, json=body(tool_choice="auto", tools=[]))
    assert r.status_code == 200, r.text
    assert r.json()["tool_choice"] == "auto" and r.json()["tools"] == []


async def test_an_input_text_part_without_text_is_a_missing_parameter(client):
    item = {"role": "user", "content": [{"type": "input_text"}]}
    r = await client.post(RESPONSES, json={"model": MODEL, "input": [item]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "input[0].content[0].text"
    assert error["code"] == "missing_required_parameter"
