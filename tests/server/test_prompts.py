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
    fits = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x" * limit}])
    check_prompt_size(fits, CONTEXT)
    parts = [{"type": "text", "text": "y" * (limit // 2)}] * 2 + [{"type": "text", "text": "z"}]
    too_long = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": parts}])
    with pytest.raises(APIError) as info:
        check_prompt_size(too_long, CONTEXT)
    assert info.value.param == "messages" and info.value.code == "context_length_exceeded"


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
