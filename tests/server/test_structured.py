"""Structured output and tool calling over HTTP around the real engine (tiny fixture, whose
ChatML template knows no tools: the generic JSON call format, constrained when required)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.helpers import stream_text

pytestmark = pytest.mark.anyio

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
UNIT = {
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
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture
def app(make_app: Any, real_engine: Any) -> Any:
    return make_app(real_engine, served_model_name=MODEL)


@pytest.fixture
async def client(app: Any) -> Any:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield c


def chat(content: str = "Set the unit.", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize("drafter", ["none", "ngram", "mtp", "draft_model"])
async def test_json_schema_output_parses_and_validates(client: Any, drafter: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    r = await client.post(
        CHAT,
        json=chat(
            response_format=response_format,
            temperature=0.8,
            seed=3,
            max_tokens=64,
            n=2,
            mtplx={"drafter": drafter, "depth": 2},
        ),
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        value = json.loads(choice["message"]["content"])
        assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3)


async def test_json_object_on_completions_greedy_is_the_same_with_and_without_drafting(
    client: Any,
) -> None:
    texts = set()
    for drafter, depth in (("none", 0), ("mtp", 3), ("ngram", 2)):
        body = {
            "model": MODEL,
            "prompt": '{"a": 1} {"a": 1} ',
            "max_tokens": 24,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "mtplx": {"drafter": drafter, "depth": depth},
        }
        r = await client.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        texts.add(choice["text"])
        assert choice["text"].startswith("{")
    assert len(texts) == 1


async def test_regex_extension(client: Any) -> None:
    body = chat(max_tokens=20, mtplx={"regex": "(yes|no)[0-9]{2}"})
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    assert content[:-2] in ("yes", "no") and content[-2:].isdigit()


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "set_unit"}}]
)
async def test_required_tool_call_always_parses(client: Any, tool_choice: Any) -> None:
    body = chat(tools=[UNIT, OTHER], tool_choice=tool_choice, temperature=1.0, seed=1, n=3)
    body["parallel_tool_calls"] = False
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["type"] == "function"
        assert calls[0]["id"].startswith("call_")
        arguments = json.loads(calls[0]["function"]["arguments"])
        if tool_choice != "required":
            assert calls[0]["function"]["name"] == "set_unit"
        if calls[0]["function"]["name"] == "set_unit":
            assert arguments["unit"] in ("c", "f")


async def test_streamed_tool_call_deltas(app: Any) -> None:
    # Greedy, one call: sampled with parallel calls on, the tiny model may go on to a second
    # call and reach max_tokens mid-call (then the output is content: a flaky test).
    body = chat(tools=[UNIT], tool_choice="required", stream=True, max_tokens=64, temperature=0)
    body["parallel_tool_calls"] = False
    text, chunks = await stream_text(app, CHAT, body)
    assert text == ""
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"]["name"] == "set_unit"
    assert json.loads(calls[0]["function"]["arguments"])["unit"] in ("c", "f")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_auto_tools_and_tool_history_render(client: Any) -> None:
    history = [
        {"role": "user", "content": "Set the unit."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "set_unit", "arguments": '{"unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    body = {"model": MODEL, "messages": history, "tools": [UNIT], "max_tokens": 8}
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    r = await client.post(CHAT, json={**body, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


# A Hermes-style template (Qwen's form, cut down): tools in the system turn, calls as
# <tool_call> JSON </tool_call>, tool results as "tool" turns.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n"
    'Reply with <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_engine(tiny_checkpoint: Any, tmp_path_factory: Any) -> Any:
    """The tiny model under HERMES_TEMPLATE."""
    import shutil

    from mtplx.engine import Engine
    from mtplx.models import load

    directory = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(tiny_checkpoint, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_path.write_text(json.dumps(config))
    return Engine(load(directory))


async def test_native_hermes_template_renders_tools_and_parses_calls(
    make_app: Any, hermes_engine: Any
) -> None:
    from server.tools import HERMES, call_style

    assert call_style(hermes_engine.tokenizer) == HERMES
    app = make_app(hermes_engine, served_model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as client:
        body = chat(tools=[UNIT], tool_choice="required", max_tokens=128, seed=2, temperature=1.0)
        body["parallel_tool_calls"] = False  # one call: the grammar ends after it
        r = await client.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "set_unit"
        assert json.loads(call["arguments"])["unit"] in ("c", "f")
        # A history with a call and its result renders through the template.
        history = [
            {"role": "user", "content": "Set the unit."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "set_unit", "arguments": '{"unit": "f"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        r = await client.post(
            CHAT, json={"model": MODEL, "messages": history, "tools": [UNIT], "max_tokens": 4}
        )
        assert r.status_code == 200, r.text


async def test_auto_tools_reply_is_text_or_a_call_that_parses(client: Any) -> None:
    """Generic format, tool_choice auto: text that does not open with "{", or a call."""
    body = chat(tools=[UNIT], max_tokens=96, temperature=1.0, seed=11, n=6)
    body["parallel_tool_calls"] = False
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        message = choice["message"]
        if choice["finish_reason"] == "tool_calls":
            arguments = json.loads(message["tool_calls"][0]["function"]["arguments"])
            assert arguments["unit"] in ("c", "f")
        else:
            assert not message["content"].lstrip().startswith("{"), message


async def test_constrained_reply_with_logprobs_and_a_stop_string(client: Any) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    body = chat(
        response_format=response_format, logprobs=True, top_logprobs=2, max_tokens=64, stop=['"n"']
    )
    r = await client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"].startswith('{"ok":')  # cut by the stop string
    content = choice["logprobs"]["content"]
    assert content and all(len(entry["top_logprobs"]) == 2 for entry in content)


@pytest.mark.parametrize("options", ["bad", [1], 3, None])
async def test_schema_x_guidance_that_is_not_an_object_is_a_400(client: Any, options: Any) -> None:
    # Was a 500: {**JSON_OPTIONS, **"bad"} raised TypeError.
    schema = {"type": "object", "x-guidance": options}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    r = await client.post(CHAT, json=chat(max_tokens=2, response_format=rf))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "response_format.json_schema.schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "bogus"}}, "response_format.type"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"mtplx": {"regex": "(("}}, "mtplx.regex"),
        ({"mtplx": {"grammar": 'start: "a"'}}, "mtplx.grammar"),
    ],
)
async def test_required_tools_with_the_requests_own_constraint_is_a_400(
    client: Any, extra: dict[str, Any], param: str
) -> None:
    # Was a 200 that silently dropped the request's constraint (even an invalid one).
    for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        body = chat(max_tokens=2, tools=[UNIT], tool_choice=choice, **extra)
        r = await client.post(CHAT, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param


async def test_grammars_that_admit_nothing_answer_400_and_leave_the_batch_whole(
    client: Any, real_engine: Any
) -> None:
    """More refused grammars than the batch has rows, of each kind: every one a 400, and
    afterwards a plain request still runs and /health says ok."""
    never = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}}
    for _ in range(real_engine.max_num_seqs + 2):
        r = await client.post(CHAT, json=chat(max_tokens=4, mtplx={"regex": "[^\\s\\S]"}))
        assert r.status_code == 400 and "admits no output" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "mtplx.regex"
        r = await client.post(CHAT, json=chat(max_tokens=4, response_format=never))
        assert r.status_code == 400, r.text
    r = await client.post(CHAT, json=chat(max_tokens=4))
    assert r.status_code == 200, r.text
    health = await client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert real_engine.num_orphan_rows == 0


async def test_grammar_errors_are_plain_and_bounded(client: Any) -> None:
    huge = "start: " + " | ".join(f'"t{i}"' for i in range(200_000))
    r = await client.post(CHAT, json=chat(max_tokens=4, mtplx={"grammar": huge}))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "mtplx.grammar" and error["code"] == "grammar_too_large"
    r = await client.post(CHAT, json=chat(max_tokens=4, mtplx={"grammar": "start: ((("}))
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "\n" not in message and "backtrace" not in message and len(message) < 500


def test_declared_properties_only_closes_objects_that_say_nothing_of_others() -> None:
    from server.structured import declared_properties_only

    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "home": {"$ref": "#/$defs/Address"},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {}}}},
            "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        },
        "$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"}}}},
        "anyOf": [{"type": "object", "properties": {"x": {}}, "patternProperties": {"^y": {}}}],
    }
    closed = declared_properties_only(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Address"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    # A schema that says what other keys may be keeps its word.
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in closed["anyOf"][0]
    assert "additionalProperties" not in schema  # a new schema, the request's untouched


async def test_strict_json_schema_output_has_only_the_declared_keys(client: Any) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": [1, 2]}}}
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": schema, "strict": True},
    }
    r = await client.post(
        CHAT,
        json=chat(response_format=response_format, temperature=1.0, seed=5, n=6, max_tokens=48),
    )
    assert r.status_code == 200, r.text
    finished = [c for c in r.json()["choices"] if c["finish_reason"] == "stop"]
    assert finished
    for choice in finished:
        assert set(json.loads(choice["message"]["content"])) <= {"a", "b"}


async def test_json_closes_within_max_tokens_unless_the_request_turns_it_off(client: Any) -> None:
    """A small budget: every reply is a complete object (the budget rule closes it); with
    the rule off, the same sampling is cut mid-object."""
    body = chat(response_format={"type": "json_object"}, temperature=1.0, seed=11, n=6)
    r = await client.post(CHAT, json={**body, "max_tokens": 14})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert isinstance(json.loads(choice["message"]["content"]), dict), choice
    off = {**body, "max_tokens": 14, "mtplx": {"close_within_max_tokens": False}}
    r = await client.post(CHAT, json=off)
    assert r.status_code == 200, r.text
    assert any(c["finish_reason"] == "length" for c in r.json()["choices"])
