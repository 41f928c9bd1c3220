"""/tokenize and /detokenize: vLLM's shapes over the served model's tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.fake_engine import VOCAB_SIZE
from tests.server.helpers import MODEL

pytestmark = pytest.mark.anyio

TEXTS = ["Hello world", " leading space", "naïve ünïcödé 🙂 日本", "a\nb\tc", "  two  spaces "]


async def test_tokenize_and_detokenize_round_trip(client: httpx.AsyncClient) -> None:
    for text in TEXTS:
        r = await client.post("/tokenize", json={"model": MODEL, "prompt": text})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == list(text.encode("utf-8"))  # the fake's byte tokenizer
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 4096
        back = await client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert back.status_code == 200 and back.json()["prompt"] == text


async def test_tokenize_messages_applies_the_chat_template(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    r = await client.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    assert r.status_code == 200, r.text
    assert bytes(r.json()["tokens"]).decode() == "<|user|>Hi\n<|assistant|>"
    assert len(r.json()["token_strs"]) == r.json()["count"]
    # llama.cpp's spelling of the text field
    r = await client.post("/tokenize", json={"content": "Hi"})
    assert r.json()["tokens"] == [72, 105]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [VOCAB_SIZE + 5]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, None),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
async def test_bad_requests_get_openai_errors(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    r = await client.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user", "content": "x", "name": "n" * 70_000},
        {"role": "user", "content": [{"type": "text", "text": "x" * 70_000}]},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "f", "arguments": "a" * 70_000},
                }
            ],
        },
        [{"role": "user", "content": "x"}] * 4_096,
    ],
    ids=["name", "text-part", "tool-call-arguments", "many-messages"],
)
async def test_every_part_of_the_messages_counts_before_tokenizing(
    client: httpx.AsyncClient, message: dict[str, Any] | list[dict[str, Any]]
) -> None:
    """As on the chat route, a name, a text part or a tool call's arguments past what the
    context can hold, or more messages than it has tokens, is a 400 before the tokenizer is
    held (4,096 x 16 characters here)."""
    messages = message if isinstance(message, list) else [message]
    r = await client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
