"""Limits on stop sequences, like OpenAI's: at most 4 on chat and completions (16 as
Anthropic ``stop_sequences``), each of bounded length, checked before any other work; the
OpenAI SDK sees a 400 naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from server.params import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from tests.server.helpers import MODEL, chat_body, completion_body

pytestmark = pytest.mark.anyio


@pytest.fixture
async def sdk(app: Any) -> Any:
    transport = httpx.ASGITransport(app=app)
    http = httpx.AsyncClient(transport=transport, base_url="http://localhost")
    async with openai.AsyncOpenAI(
        base_url="http://localhost/v1", api_key="none", http_client=http, max_retries=0
    ) as client:
        yield client


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["ab"] * (MAX_STOP_SEQUENCES + 1), "at most 4 sequences, got 5"),
        (["ab"] * 1_000, "at most 4 sequences, got 1000"),
        (["x" * (MAX_STOP_CHARS + 1)], f"at most {MAX_STOP_CHARS}"),
        ("y" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS}"),
        (["a", ""], "must not be empty"),
    ],
)
async def test_too_many_or_too_long_stop_sequences_are_a_400_naming_stop(
    sdk: Any, engine: Any, stop: Any, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stop=stop
        )
    error = info.value.body
    assert error["param"] == "stop" and error["code"] == "invalid_value"
    assert message in error["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await sdk.completions.create(model=MODEL, prompt="hi", stop=stop)
    assert info.value.body["param"] == "stop"
    assert engine.requests == []


async def test_four_stop_sequences_are_accepted(client: httpx.AsyncClient) -> None:
    stop = ["x" * MAX_STOP_CHARS, "b", "c", "d"]
    assert (await client.post("/v1/chat/completions", json=chat_body(stop=stop))).status_code == 200
    r = await client.post("/v1/completions", json=completion_body(stop=stop))
    assert r.status_code == 200


async def test_anthropic_stop_sequences_are_bounded(client: httpx.AsyncClient) -> None:
    def body(stop: list[str]) -> dict[str, Any]:
        messages = [{"role": "user", "content": "hi"}]
        return {"model": MODEL, "max_tokens": 4, "messages": messages, "stop_sequences": stop}

    assert (await client.post("/v1/messages", json=body(["s"] * 16))).status_code == 200
    for stop in (["s"] * 17, ["x" * (MAX_STOP_CHARS + 1)], [""]):
        r = await client.post("/v1/messages", json=body(stop))
        assert r.status_code == 400
        error = r.json()
        assert error["type"] == "error" and "stop_sequences" in error["error"]["message"]
