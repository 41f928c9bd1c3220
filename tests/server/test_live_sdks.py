"""The Anthropic Messages API and the OpenAI Responses API driven by the official
``anthropic`` and ``openai`` SDKs against ``python -m mtplx serve`` on a tiny real checkpoint
(with an API key). Replies at temperature 0 must equal the chat completion of the same
conversation: every API is the same chat generation path."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.live import live_server

MODEL = "tiny"
API_KEY = "sdk-key"
SYSTEM = "You are terse."
PROMPT = "Tell me a story."
# Recent anthropic SDKs have no temperature argument; the field still goes in the body.
GREEDY = {"extra_body": {"temperature": 0}}
UNIT_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
UNIT_TOOL = {"name": "set_unit", "description": "Choose the unit.", "input_schema": UNIT_SCHEMA}
UNIT_FUNCTION = {
    "type": "function",
    "name": "set_unit",
    "description": "Choose the unit.",
    "parameters": UNIT_SCHEMA,
    "strict": True,
}
PICK = {"role": "user", "content": "Pick a unit."}


@pytest.fixture(scope="module")
def base_url(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("live-sdks") / "server.log"
    args = ["--drafter", "mtp", "--served-model-name", MODEL, "--api-key", API_KEY]
    with live_server(tiny_checkpoint, log, *args, "--log-level", "warning") as url:
        yield url


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat_reply(oai: openai.OpenAI, max_tokens: int) -> tuple[str, str]:
    """(text, finish_reason) of the chat completion of SYSTEM + PROMPT at temperature 0."""
    reply = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_messages_create_equals_the_chat_completion(claude, oai):
    text, finish = chat_reply(oai, 24)
    message = claude.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        metadata={"user_id": "u-1"},
        **GREEDY,
    )
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_") and message.role == "assistant"
    assert message.model == MODEL and message.content[0].type == "text"
    assert message.content[0].text == text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert 0 < message.usage.output_tokens <= 24
    count = claude.messages.count_tokens(
        model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": PROMPT}]
    )
    # The chat completion above left this prompt in the prefix cache: Anthropic counts the
    # tokens read from a cache apart from input_tokens.
    usage = message.usage
    assert count.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0


def test_messages_stream(claude):
    args = {
        "model": MODEL,
        "system": [{"type": "text", "text": SYSTEM}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
        "max_tokens": 20,
        **GREEDY,
    }
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = [event.type for event in claude.messages.create(**args, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequences(claude):
    args = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **GREEDY}
    text = claude.messages.create(**args, max_tokens=40).content[0].text
    assert len(text) >= 8, f"the tiny model ended too early: {text!r}"
    stop = text[4:7]
    message = claude.messages.create(**args, max_tokens=40, stop_sequences=[stop])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == text[: text.index(stop)]


def test_anthropic_errors_reach_the_sdk(claude, base_url):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=5,
            tools=[{"type": "bash_20250124", "name": "bash"}],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "'bash_20250124' is not supported" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="claude-x", messages=[{"role": "user", "content": "x"}], max_tokens=5
        )
    wrong = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5
        )
    assert info.value.body["error"]["type"] == "authentication_error"
    # Older SDKs and curl users send the key as x-api-key.
    reply = httpx.post(
        f"{base_url}/v1/messages",
        json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": API_KEY, "anthropic-version": "2023-06-01"},
        timeout=60,
    )
    assert reply.status_code == 200 and reply.json()["type"] == "message"


def test_responses_create_equals_the_chat_completion(oai):
    text, finish = chat_reply(oai, 24)
    response = oai.responses.create(
        model=MODEL,
        instructions=SYSTEM,
        input=PROMPT,
        max_output_tokens=24,
        temperature=0,
        store=False,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == text
    assert response.status == {"length": "incomplete", "stop": "completed"}[finish]
    if finish == "length":
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert 0 < usage.output_tokens <= 24


def test_responses_stream(oai):
    args = {
        "model": MODEL,
        "input": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "input_text", "text": PROMPT}]},
        ],
        "max_output_tokens": 20,
        "temperature": 0,
    }
    whole = oai.responses.create(**args)
    events = list(oai.responses.create(**args, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"


def test_models_with_a_trailing_slash_and_the_open_page(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    listing = httpx.get(f"{base_url}/v1/models/", headers=headers).json()
    assert [m["id"] for m in listing["data"]] == [MODEL]
    assert httpx.get(f"{base_url}/v1/models/{MODEL}/", headers=headers).json()["id"] == MODEL
    page = httpx.get(f"{base_url}/")
    assert (
        page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    )


def test_messages_tool_round_trip(claude):
    message = claude.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[PICK],
        tools=[UNIT_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        **GREEDY,
    )
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    [use] = message.content  # no text before the call: no text block
    assert isinstance(use, anthropic.types.ToolUseBlock)
    assert use.id.startswith("toolu_") and use.name == "set_unit"
    assert set(use.input) == {"unit"} and use.input["unit"] in ("c", "f")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "unit set"}
    history = [PICK, {"role": "assistant", "content": message.content}]
    history.append({"role": "user", "content": [result]})
    final = claude.messages.create(
        model=MODEL, max_tokens=16, messages=history, tools=[UNIT_TOOL], **GREEDY
    )
    # tool_choice auto: the greedy tiny model answers in text.
    assert [block.type for block in final.content] == ["text"] and final.content[0].text
    assert final.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, messages=history, tools=[UNIT_TOOL])
    bare = claude.messages.count_tokens(model=MODEL, messages=history)
    assert counted.input_tokens > bare.input_tokens > 0


def test_messages_stream_tool_use(claude):
    args = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [PICK],
        "tools": [UNIT_TOOL],
        "tool_choice": {"type": "tool", "name": "set_unit", "disable_parallel_tool_use": True},
        **GREEDY,
    }
    whole = claude.messages.create(**args)
    with claude.messages.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(event.partial_json for event in events if event.type == "input_json")
    [use] = final.content
    assert use.type == "tool_use" and use.name == "set_unit"
    # The SDK rebuilt the input from the input_json_delta events.
    assert use.input == json.loads(partial) == whole.content[0].input
    assert use.input["unit"] in ("c", "f")
    assert final.stop_reason == "tool_use"
    stops = [event.type for event in events if event.type == "content_block_stop"]
    assert len(stops) == 1


def test_responses_function_call_round_trip(oai):
    response = oai.responses.create(
        model=MODEL,
        input="Pick a unit.",
        tools=[UNIT_FUNCTION],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "set_unit" and json.loads(call.arguments)["unit"] in ("c", "f")
    assert response.tool_choice == "required" and response.tools[0].name == "set_unit"
    assert response.parallel_tool_calls is False
    follow_up = oai.responses.create(
        model=MODEL,
        input=[
            PICK,
            *response.output,
            {"type": "function_call_output", "call_id": call.call_id, "output": "unit set"},
        ],
        tools=[UNIT_FUNCTION],
        max_output_tokens=16,
        temperature=0,
    )
    # tool_choice auto: the greedy tiny model answers in text.
    assert [item.type for item in follow_up.output] == ["message"] and follow_up.output_text


def test_responses_stream_function_call_arguments(oai):
    args = {
        "model": MODEL,
        "input": "Pick a unit.",
        "tools": [UNIT_FUNCTION],
        "tool_choice": {"type": "function", "name": "set_unit"},
        "parallel_tool_calls": False,
        "max_output_tokens": 64,
        "temperature": 0,
    }
    whole = oai.responses.create(**args)
    with oai.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    [call] = final.output
    assert deltas and "".join(e.delta for e in deltas) == call.arguments
    assert call.arguments == whole.output[0].arguments
    assert call.parsed_arguments == json.loads(call.arguments)  # strict: the SDK parsed it
    assert {e.output_index for e in deltas} == {0} and deltas[0].item_id == call.id
    assert [e.sequence_number for e in events] == list(range(len(events)))


class Address(BaseModel):
    """A place (pydantic puts it in the schema's ``$defs``)."""

    model_config = ConfigDict(extra="forbid")

    city: Literal["oslo", "rome"]
    main: bool


class Person(BaseModel):
    """Arguments whose schema refers to ``#/$defs/Address``."""

    model_config = ConfigDict(extra="forbid")

    home: Address
    others: list[Address] = Field(max_length=2)


def test_a_pydantic_schema_with_defs_gives_a_valid_call_on_every_api(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    schema = Person.model_json_schema()
    assert "$defs" in schema and "#/$defs/Address" in json.dumps(schema)
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[PICK],
        tools=[{"type": "function", "function": {"name": "save", "parameters": schema}}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    [call] = chat.choices[0].message.tool_calls
    Person.model_validate_json(call.function.arguments)
    response = oai.responses.create(
        model=MODEL,
        input="Save a person.",
        tools=[{"type": "function", "name": "save", "parameters": schema, "strict": True}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
    )
    [item] = response.output
    Person.model_validate_json(item.arguments)
    message = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        messages=[PICK],
        tools=[{"name": "save", "input_schema": schema}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    [use] = message.content
    assert use.type == "tool_use"
    Person.model_validate(use.input)
