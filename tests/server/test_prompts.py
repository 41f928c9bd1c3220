"""Prompts: refused by size before any tokenizer work, tokenized off the event loop (the
server keeps answering meanwhile), token ids checked before they are decoded."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from server.errors import APIError
from server.prompts import CHARS_PER_TOKEN_BOUND, check_prompt_size, count_prompts
from server.schemas import ChatCompletionRequest, CompletionRequest
from tests.fake_engine import FakeEngine, FakeTokenizer
from tests.server.helpers import MODEL, chat_body, completion_body, wait_until

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
CONTEXT = 4096


class CountingTokenizer(FakeTokenizer):
    """Counts every call that tokenizes or detokenizes a prompt."""

    def __init__(self) -> None:
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        self.calls += 1
        return super().encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens=False):
        self.calls += 1
        return super().decode(ids, skip_special_tokens)


class GatedTokenizer(FakeTokenizer):
    """apply_chat_template waits for ``gate`` (a slow tokenization, on demand)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.finished = threading.Event()

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        self.started.set()
        self.gate.wait(30)  # only a safety valve: the test opens the gate
        try:
            return super().apply_chat_template(messages, add_generation_prompt, tokenize)
        finally:
            self.finished.set()


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


def test_count_prompts():
    assert count_prompts("text") == 1
    assert count_prompts([1, 2, 3]) == 1
    assert count_prompts(["a", "b"]) == 2
    assert count_prompts([[1], [2], [3]]) == 3


def test_size_bound_is_characters_per_token_of_the_context():
    limit = CONTEXT * CHARS_PER_TOKEN_BOUND
    text = "x" * (limit - CHARS_PER_TOKEN_BOUND)  # a message's own token counts too
    fits = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": text}])
    check_prompt_size(fits, CONTEXT)
    parts = [{"type": "text", "text": "y" * (limit // 2)}] * 2 + [{"type": "text", "text": "z"}]
    too_long = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": parts}])
    with pytest.raises(APIError) as info:
        check_prompt_size(too_long, CONTEXT)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"


def test_each_message_counts_at_least_one_token():
    """Many tiny messages (each renders its role header: a token at least) are refused
    before the chat template renders them all under the tokenizer lock."""
    many = [{"role": "user", "content": "x"}] * CONTEXT
    with pytest.raises(APIError) as info:
        check_prompt_size(ChatCompletionRequest(model=MODEL, messages=many), CONTEXT)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"
    fewer = [{"role": "user", "content": "x"}] * (CONTEXT // 2)
    check_prompt_size(ChatCompletionRequest(model=MODEL, messages=fewer), CONTEXT)


def test_token_ids_are_checked_against_the_context_and_vocabulary():
    check_prompt_size(CompletionRequest(model=MODEL, prompt=[1] * (CONTEXT - 1)), CONTEXT, 257)
    with pytest.raises(APIError, match="4096 tokens") as info:
        check_prompt_size(CompletionRequest(model=MODEL, prompt=[1] * CONTEXT), CONTEXT, 257)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(APIError, match=r"\[257\]") as info:
        check_prompt_size(CompletionRequest(model=MODEL, prompt=[[1], [2, 257]]), CONTEXT, 257)
    assert info.value.param == "prompt[1]" and info.value.code == "invalid_value"


async def test_a_10mb_message_is_refused_without_tokenizing(make_app):
    engine = FakeEngine()
    engine.tokenizer = CountingTokenizer()
    app = make_app(engine)
    async with _client(app) as c:
        r = await c.post(CHAT, json=chat_body("x" * 10_000_000))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", json=completion_body(list(range(200)) * 100))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert engine.tokenizer.calls == 0 and engine.requests == []


async def test_a_message_over_the_body_limit_is_413(make_app):
    engine = FakeEngine()
    engine.tokenizer = CountingTokenizer()
    app = make_app(engine, max_request_bytes=1_000_000)
    async with _client(app) as c:
        r = await c.post(CHAT, json=chat_body("x" * 10_000_000))
    assert r.status_code == 413 and engine.tokenizer.calls == 0


async def test_health_answers_while_a_prompt_is_tokenized(make_app):
    engine = FakeEngine()
    tokenizer = GatedTokenizer()
    engine.tokenizer = tokenizer
    app = make_app(engine)
    async with _client(app) as c:
        chat = asyncio.ensure_future(c.post(CHAT, json=chat_body("hello", max_tokens=2)))
        try:
            await wait_until(tokenizer.started.is_set)
            health = await c.get("/health")
            # On the event loop, the tokenizer would hold the loop until its gate opened.
            assert health.status_code == 200
            assert not tokenizer.finished.is_set()
        finally:
            tokenizer.gate.set()
        r = await chat
    assert r.status_code == 200 and tokenizer.finished.is_set()


def _tool(name: str, description: str = "", schema: dict | None = None) -> dict:
    function = {"name": name, "description": description}
    if schema is not None:
        function["parameters"] = schema
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [_tool("big", "d" * (CONTEXT * CHARS_PER_TOKEN_BOUND))]}, "tools"),
        (
            {
                "tools": [
                    _tool(
                        "big",
                        schema={
                            "type": "object",
                            "properties": {f"p{i}": {"type": "string"} for i in range(10_000)},
                        },
                    )
                ]
            },
            "tools",
        ),
        ({"tools": [_tool(f"t{i}", "x" * 100) for i in range(2_000)]}, "tools"),
    ],
)
def test_tools_count_against_the_size_bound(extra: dict, param: str) -> None:
    body = ChatCompletionRequest.model_validate(chat_body(**extra))
    with pytest.raises(APIError) as info:
        check_prompt_size(body, CONTEXT)
    assert info.value.param == param and info.value.code == "context_length_exceeded"


def test_tool_call_arguments_and_names_count_against_the_size_bound() -> None:
    limit = CONTEXT * CHARS_PER_TOKEN_BOUND
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "a" * limit}}
    body = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
            ],
        }
    )
    with pytest.raises(APIError) as info:
        check_prompt_size(body, CONTEXT)
    assert info.value.param == "messages"
    named = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "n" * limit}]}
    )
    with pytest.raises(APIError):
        check_prompt_size(named, CONTEXT)


async def test_count_tokens_with_thousands_of_tools_is_refused_before_tokenizing(
    make_app, monkeypatch
) -> None:
    engine = FakeEngine(context_length=CONTEXT)

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", never)
    app = make_app(engine)
    tools = [
        {"name": f"t{i}", "description": "x" * 100, "input_schema": {"type": "object"}}
        for i in range(2_000)
    ]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        r = await c.post("/v1/messages/count_tokens", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        arguments = {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * 10**6}}
        ]}  # fmt: skip
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}, arguments]},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_a_text_part_without_text_is_a_missing_parameter() -> None:
    body = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    )
    from server.prompts import message_text

    with pytest.raises(APIError) as info:
        message_text(body.messages[0], 0)
    assert info.value.param == "messages[0].content[0].text"
    assert info.value.code == "missing_required_parameter"
    assert "Missing required parameter" in info.value.message
