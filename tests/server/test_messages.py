"""POST /v1/messages and /v1/messages/count_tokens (the Anthropic Messages API) on the fake
engine: the reply, stop reasons, the named stream events, the prompt it builds, and every
error in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.fake_engine import FakeEngine
from tests.server.helpers import MODEL, ASGICall, chat_body, named_events, wait_until

pytestmark = pytest.mark.anyio

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "x"}]
INVALID = "invalid_request_error"
F_TOOL = {"name": "f", "input_schema": {"type": "object"}}


def body(content: Any = "hi", **extra: Any) -> dict[str, Any]:
    """A minimal valid Messages request."""
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }


def prompt_text(engine: FakeEngine) -> str:
    return engine.tokenizer.decode(engine.requests[-1].prompt_ids)


def assert_anthropic_error(response: Any, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert error["error"]["type"] == kind
    return error["error"]["message"]


async def test_reply_shape_and_usage(client, engine):
    r = await client.post(MESSAGES, json=body(max_tokens=12, temperature=0))
    assert r.status_code == 200
    reply = r.json()
    assert reply["id"].startswith("msg_") and reply["type"] == "message"
    assert reply["role"] == "assistant" and reply["model"] == MODEL
    assert reply["stop_reason"] == "max_tokens" and reply["stop_sequence"] is None
    [block] = reply["content"]
    assert block["type"] == "text"
    assert block["text"] == engine.expected_text(engine.requests[-1])
    prompt_tokens = len(engine.requests[-1].prompt_ids)
    assert reply["usage"] == {
        "input_tokens": prompt_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": 12,
    }
    assert reply["mtplx"]["drafted"] > 0


async def test_end_turn_and_stop_sequence(client):
    r = await client.post(MESSAGES, json=body("[[eos]]"))
    assert r.json()["stop_reason"] == "end_turn" and r.json()["stop_sequence"] is None
    whole = (await client.post(MESSAGES, json=body(temperature=0, max_tokens=40))).json()
    text = whole["content"][0]["text"]
    stop = text[10:13]
    r = await client.post(
        MESSAGES, json=body(temperature=0, max_tokens=40, stop_sequences=["QQQ", stop])
    )
    reply = r.json()
    assert reply["stop_reason"] == "stop_sequence" and reply["stop_sequence"] == stop
    assert reply["content"][0]["text"] == text[: text.index(stop)]


async def test_system_blocks_merged_turns_and_prefill_shape_the_prompt(client, engine):
    request = body(
        [{"type": "text", "text": "one", "cache_control": {"type": "ephemeral"}}],
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        metadata={"user_id": "u1"},
    )
    request["messages"] += [
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "Sure:"},
    ]
    r = await client.post(MESSAGES, json=request, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200
    # system first; the two user turns merged; the last assistant turn is a prefill the
    # reply continues (no end of turn after it).
    assert (
        prompt_text(engine)
        == "<|system|>Be brief.\nBe kind.\n<|user|>one\n\ntwo\n<|assistant|>Sure:"
    )
    counted = {k: v for k, v in request.items() if k not in ("max_tokens", "metadata")}
    count = await client.post(COUNT, json=counted)
    assert count.json() == {"input_tokens": r.json()["usage"]["input_tokens"]}


async def test_sampling_fields_and_mtplx_options_reach_the_engine(client, engine):
    r = await client.post(
        MESSAGES,
        json=body(temperature=0.5, top_p=0.9, top_k=7, mtplx={"drafter": "ngram", "depth": 2}),
    )
    assert r.status_code == 200
    request = engine.requests[-1]
    assert request.sampler.temperature == 0.5 and request.sampler.top_p == 0.9
    assert request.sampler.top_k == 7 and request.max_tokens == 16
    assert request.drafter == "ngram" and request.depth == 2


async def test_stream_event_sequence(client, engine):
    whole = (await client.post(MESSAGES, json=body(temperature=0, max_tokens=20))).json()
    r = await client.post(MESSAGES, json=body(temperature=0, max_tokens=20, stream=True))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = named_events(r.text)
    assert all(name == data["type"] for name, data in events)  # every event is named
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert (
        start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    )
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"text_delta"}
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 20
    assert delta["mtplx"]["cycles"] >= 1


async def test_stream_with_stop_sequence(client):
    text = (await client.post(MESSAGES, json=body(temperature=0, max_tokens=30))).json()
    stop = text["content"][0]["text"][5:8]
    r = await client.post(
        MESSAGES, json=body(temperature=0, max_tokens=30, stop_sequences=[stop], stream=True)
    )
    delta = next(d for n, d in named_events(r.text) if n == "message_delta")
    assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}


async def test_failure_mid_stream_is_an_error_event(client):
    r = await client.post(MESSAGES, json=body("[[fail]]", stream=True))
    events = named_events(r.text)
    assert events[0][0] == "message_start"
    name, error = events[-1]
    assert name == "error" and error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert "message_stop" not in [n for n, _ in events]


async def test_api_key_as_x_api_key_or_bearer(make_app):
    import httpx

    app = make_app(api_key="s3cret")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        message = assert_anthropic_error(
            await c.post(MESSAGES, json=body()), 401, "authentication_error"
        )
        assert "x-api-key" in message
        wrong = await c.post(MESSAGES, json=body(), headers={"x-api-key": "nope"})
        assert_anthropic_error(wrong, 401, "authentication_error")
        assert (await c.post(MESSAGES, json=body(), headers={"x-api-key": "s3cret"})).is_success
        bearer = {"Authorization": "Bearer s3cret"}
        assert (await c.post(MESSAGES, json=body(), headers=bearer)).is_success
        # One right and one wrong: refused.
        both = {"Authorization": "Bearer s3cret", "x-api-key": "nope"}
        assert (await c.post(MESSAGES, json=body(), headers=both)).status_code == 401
        # The OpenAI routes take x-api-key too, and keep their own error shape.
        chat = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"
        ok = await c.post(
            "/v1/chat/completions", json=chat_body(max_tokens=2), headers={"x-api-key": "s3cret"}
        )
        assert ok.is_success


CASES = {
    "no-max-tokens": ({"model": MODEL, "messages": USER}, 400, INVALID, "max_tokens"),
    "zero-max-tokens": (body(max_tokens=0), 400, INVALID, "max_tokens"),
    "temperature": (body(temperature=1.5), 400, INVALID, "temperature"),
    "top-k": (body(top_k=-1), 400, INVALID, "top_k"),
    "empty-stop": (body(stop_sequences=[""]), 400, INVALID, "stop_sequences"),
    "unknown-model": (body(model="claude-x"), 404, "not_found_error", "claude-x"),
    "unknown-field": (body(unknown_field=1), 400, INVALID, "unknown_field"),
    "no-messages": ({**body(), "messages": []}, 400, INVALID, "messages"),
    "system-role": (body(messages=[{"role": "system", "content": "x"}]), 400, INVALID, "role"),
    "tool-schema-not-object": (
        body(tools=[{"name": "f", "input_schema": {}}]),
        400,
        INVALID,
        "tools[0].input_schema",
    ),
    "tool-no-schema": (body(tools=[{"name": "f"}]), 400, INVALID, "tools[0].input_schema"),
    "tool-bad-name": (
        body(tools=[{"name": "a b", "input_schema": {"type": "object"}}]),
        400,
        INVALID,
        "tools[0].name",
    ),
    "server-tool": (
        body(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]),
        400,
        INVALID,
        "'web_search_20250305' is not supported",
    ),
    "tool-choice-any-without-tools": (body(tool_choice={"type": "any"}), 400, INVALID, "tools"),
    "tool-choice-unknown-type": (body(tool_choice={"type": "all"}), 400, INVALID, "tool_choice"),
    "tool-choice-tool-without-name": (
        body(tools=[F_TOOL], tool_choice={"type": "tool"}),
        400,
        INVALID,
        "tool_choice.name",
    ),
    "tool-choice-unknown-tool": (
        body(tools=[F_TOOL], tool_choice={"type": "tool", "name": "g"}),
        400,
        INVALID,
        "'g'",
    ),
    "thinking": (
        body(thinking={"type": "sometimes", "budget_tokens": 1024}),
        400,
        INVALID,
        "thinking",
    ),
    "image-block": (body([{"type": "image", "source": {}}]), 400, INVALID, "image"),
    "tool-result-without-use": (
        body([{"type": "tool_result", "tool_use_id": "t"}]),
        400,
        INVALID,
        "unexpected tool_use_id 't'",
    ),
    "tool-use-in-user-turn": (
        body([{"type": "tool_use", "id": "t", "name": "f", "input": {}}]),
        400,
        INVALID,
        "tool_use blocks belong in assistant turns",
    ),
    "text-block-without-text": (
        body([{"type": "text"}]),
        400,
        INVALID,
        "Missing required parameter: 'messages[0].content[0].text'",
    ),
    "system-text-block-without-text": (
        body(system=[{"type": "text"}]),
        400,
        INVALID,
        "Missing required parameter: 'system[0].text'",
    ),
    "max-tokens-over-limit": (body(max_tokens=10_000), 400, INVALID, "max_tokens"),
    "unavailable-drafter": (body(mtplx={"drafter": "draft_model"}), 400, INVALID, "drafter"),
}


@pytest.mark.parametrize(
    ("request_body", "status", "kind", "words"), CASES.values(), ids=CASES.keys()
)
async def test_bad_requests_get_anthropic_errors(client, request_body, status, kind, words):
    message = assert_anthropic_error(await client.post(MESSAGES, json=request_body), status, kind)
    assert words in message
    assert (await client.post(MESSAGES, json=body(max_tokens=2))).status_code == 200


async def test_thinking_disabled_is_fine(client):
    r = await client.post(MESSAGES, json=body(thinking={"type": "disabled"}, service_tier="auto"))
    assert r.status_code == 200


async def test_transport_level_errors_take_anthropic_shape_under_messages(make_app, client):
    r = await client.post(MESSAGES, content=b"{", headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error")
    r = await client.post(MESSAGES, content=b"{}", headers={"content-type": "text/plain"})
    assert_anthropic_error(r, 415, "invalid_request_error")
    assert_anthropic_error(await client.get(MESSAGES), 405, "invalid_request_error")
    assert_anthropic_error(await client.post(MESSAGES + "/nope", json={}), 404, "not_found_error")
    r = await client.post(MESSAGES, json=body(), headers={"host": "evil.example"})
    assert_anthropic_error(r, 400, "invalid_request_error")
    # Outside /v1/messages the OpenAI shape stays.
    r = await client.post("/v1/messagesX", json={})
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"


async def test_full_queue_is_a_rate_limit_error(make_app):
    engine = FakeEngine(token_delay=0.02, max_num_seqs=1)
    app = make_app(engine, max_queue=1)
    bridge = app.state.ctx.bridge
    running = ASGICall(app, MESSAGES, body("a", stream=True, max_tokens=1000))
    await running.start()
    await wait_until(lambda: bridge.active == 1)
    waiting = ASGICall(app, MESSAGES, body("b", max_tokens=3))
    await wait_until(lambda: bridge.queue_depth == 1)
    refused = ASGICall(app, MESSAGES, body("c", max_tokens=3))
    assert await refused.start() == 429
    assert int(refused.headers["retry-after"]) >= 1
    error = json.loads(await refused.body())
    assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
    await running.disconnect()
    assert await waiting.start() == 200
    await waiting.body()


async def test_count_tokens(client, engine):
    r = await client.post(COUNT, json={"model": MODEL, "system": "sys", "messages": USER})
    expected = len(engine.tokenizer.encode("<|system|>sys\n<|user|>x\n<|assistant|>"))
    assert r.status_code == 200 and r.json() == {"input_tokens": expected}
    assert not engine.requests  # counting generates nothing
    r = await client.post(COUNT, json={"model": MODEL, "messages": [], "max_tokens": 3})
    assert_anthropic_error(r, 400, "invalid_request_error")
    r = await client.post(
        COUNT, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert_anthropic_error(r, 404, "not_found_error")
    tools = {"model": MODEL, "messages": USER, "tools": [{}]}
    assert_anthropic_error(await client.post(COUNT, json=tools), 400, "invalid_request_error")


async def test_loading_model_is_overloaded_error_then_served():
    import threading

    import httpx

    from server.app import create_app
    from server.engine_bridge import EngineBridge

    gate = threading.Event()

    def factory() -> FakeEngine:
        gate.wait(5)
        return FakeEngine()

    bridge = EngineBridge(factory)
    app = create_app(bridge)
    bridge.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            r = await c.post(MESSAGES, json=body())
            assert_anthropic_error(r, 503, "overloaded_error")
            assert r.headers["retry-after"] == "5"
            r = await c.post(COUNT, json={"model": MODEL, "messages": USER})
            assert_anthropic_error(r, 503, "overloaded_error")
            gate.set()
            assert bridge.wait_ready(5)
            assert (await c.post(MESSAGES, json=body(max_tokens=2))).status_code == 200
    finally:
        gate.set()
        bridge.stop()


def test_usage_counts_prefix_cache_reads_as_anthropic_does():
    from server.anthropic_api import anthropic_usage

    usage = {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 64},
    }
    assert anthropic_usage(usage) == {
        "input_tokens": 36,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 64,
        "output_tokens": 7,
    }


WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
    },
    {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": [{"type": "text", "text": "sunny"}],
            },
            {"type": "text", "text": "Thanks."},
        ],
    },
]


@pytest.mark.parametrize(
    ("choice", "chat_choice", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        (
            {"type": "tool", "name": "get_weather"},
            {"type": "function", "function": {"name": "get_weather"}},
            None,
        ),
        ({"type": "none"}, "none", None),
    ],
    ids=["auto", "any", "tool", "none"],
)
def test_tools_and_tool_choice_map_onto_chat(choice, chat_choice, parallel):
    from server.anthropic_api import MessagesRequest, to_chat_request

    chat = to_chat_request(
        MessagesRequest.model_validate(body(tools=[WEATHER], tool_choice=choice))
    )
    [tool] = chat.tools
    assert tool.function.name == "get_weather"
    assert tool.function.parameters == WEATHER["input_schema"]
    assert tool.function.description == WEATHER["description"]
    got = chat.tool_choice if isinstance(chat.tool_choice, str) else chat.tool_choice.model_dump()
    assert got == chat_choice
    assert chat.parallel_tool_calls is parallel


def test_tool_blocks_become_chat_tool_calls_and_tool_messages():
    from server.anthropic_api import MessagesRequest, to_chat_request

    history = [*TOOL_HISTORY]
    history[2] = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "boom", "is_error": True}
        ],
    }
    chat = to_chat_request(MessagesRequest.model_validate(body(messages=history)))
    roles = [m.role for m in chat.messages]
    assert roles == ["user", "assistant", "tool"]
    [call] = chat.messages[1].tool_calls
    assert call.id == "toolu_1" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}
    assert chat.messages[1].content == "Checking."
    assert chat.messages[2].tool_call_id == "toolu_1" and chat.messages[2].content == "Error: boom"


async def test_tool_history_and_definitions_reach_the_prompt_and_count_tokens(client, engine):
    request = body(
        system="Be brief.",
        messages=TOOL_HISTORY,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    r = await client.post(MESSAGES, json=request)
    assert r.status_code == 200, r.text
    prompt = prompt_text(engine)
    # The default-style template knows no tools: definitions and the call format in the
    # system prompt, the call as its JSON, the result as a user turn.
    system, rest = prompt.split("\n\nBe brief.\n", 1)
    assert '"name": "get_weather"' in system and "You must call one or more" in system
    assert rest == (
        '<|user|>Weather?\n<|assistant|>Checking.\n{"tool_calls": [{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}]}\n<|user|>Result of the call to get_weather: sunny\n'
        "<|user|>Thanks.\n<|assistant|>"
    )
    assert engine.requests[-1].grammar is not None  # "any": constrained to a call
    # The fake engine's words are no call: the reply is text.
    assert r.json()["content"][0]["type"] == "text"
    counted = {k: v for k, v in request.items() if k != "max_tokens"}
    count = (await client.post(COUNT, json=counted)).json()["input_tokens"]
    assert count == r.json()["usage"]["input_tokens"]
    without = {k: v for k, v in counted.items() if k not in ("tools", "tool_choice")}
    assert (await client.post(COUNT, json=without)).json()["input_tokens"] < count


async def test_tool_errors_in_the_history(client):
    last_use = body(messages=[*TOOL_HISTORY[:2]])
    message = assert_anthropic_error(await client.post(MESSAGES, json=last_use), 400, INVALID)
    assert "last assistant turn cannot hold tool_use" in message
    bad_input = [
        TOOL_HISTORY[0],
        {**TOOL_HISTORY[1], "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 3}]},
    ]
    message = assert_anthropic_error(
        await client.post(MESSAGES, json=body(messages=bad_input)), 400, INVALID
    )
    assert "messages[1].content[0].input" in message
    image = [
        {
            "type": "tool_result",
            "tool_use_id": "toolu_1",
            "content": [{"type": "image", "source": {}}],
        }
    ]
    history = [*TOOL_HISTORY[:2], {"role": "user", "content": image}]
    message = assert_anthropic_error(
        await client.post(MESSAGES, json=body(messages=history)), 400, INVALID
    )
    assert "messages[2].content[0].content[0]" in message and "image" in message


async def test_empty_content_is_a_400_except_a_final_assistant_prefill(client):
    r = await client.post(MESSAGES, json=body([]))
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "non-empty content" in r.json()["error"]["message"]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": []}]
    r = await client.post(MESSAGES, json={**body(), "messages": turns})
    assert r.status_code == 200, r.text
