"""Structured output and tool calling against a live ``mtplx serve`` (tiny checkpoint) with
real clients: the ``openai`` SDK (``response_format``, ``chat.completions.parse``, tools,
streamed tool-call deltas) and LangChain's ``ChatOpenAI`` (``with_structured_output(...,
method="json_schema")``, ``bind_tools``)."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel

from tests.server import test_live_server as live

API_KEY, MODEL = live.API_KEY, live.MODEL
base_url, sdk = live.base_url, live.sdk  # the live server fixtures (one server per module)


class Unit(BaseModel):
    """The unit to show temperatures in."""

    unit: Literal["c", "f"]
    ok: bool


UNIT_TOOL = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "description": "Choose the temperature unit.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "Pick a unit."}]


def test_sdk_json_object(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
        extra_body={"mtplx": {"drafter": "mtp", "depth": 2}},
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_sdk_parse_with_a_pydantic_model(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Unit, max_tokens=64, seed=4
    )
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Unit) and parsed.unit in ("c", "f")


def test_sdk_required_tool_call_and_a_streamed_one(sdk: openai.OpenAI) -> None:
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[UNIT_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=64,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "set_unit"
    assert json.loads(call.function.arguments)["unit"] in ("c", "f")
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[UNIT_TOOL],
        tool_choice={"type": "function", "function": {"name": "set_unit"}},
        parallel_tool_calls=False,
        max_tokens=64,
        stream=True,
    )
    arguments, names, finish = "", [], None
    for chunk in stream:
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            if delta_call.function.name:
                names.append(delta_call.function.name)
            arguments += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["set_unit"] and finish == "tool_calls"
    assert json.loads(arguments)["unit"] in ("c", "f")
    # The call and its result go back into the history.
    follow_up = sdk.chat.completions.create(
        model=MODEL,
        messages=[
            *MESSAGES,
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "done"},
        ],
        tools=[UNIT_TOOL],
        max_tokens=8,
    )
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_sdk_invalid_schema_is_a_400(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "a"}},
            },
        )
    assert caught.value.body["param"] == "response_format.json_schema.schema"


def test_langchain_structured_output_and_bind_tools(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{base_url}/v1",
        api_key=API_KEY,
        max_tokens=64,
        max_retries=0,
        temperature=0,  # deterministic: sampled, the tiny model may repeat calls to max_tokens
    )
    structured = llm.with_structured_output(Unit, method="json_schema")
    result = structured.invoke("Pick a unit.")
    assert isinstance(result, Unit)

    def set_unit(unit: Literal["c", "f"]) -> str:
        """Choose the temperature unit."""
        return unit

    # strict: LangChain closes the arguments object (additionalProperties false), so the
    # tiny random model cannot wander off into extra keys.
    bound = llm.bind_tools(
        [set_unit], tool_choice="set_unit", strict=True, parallel_tool_calls=False
    )
    message = bound.invoke("Pick a unit.")
    assert message.tool_calls and message.tool_calls[0]["name"] == "set_unit"
    assert message.tool_calls[0]["args"]["unit"] in ("c", "f")
