"""The Anthropic Messages API and the OpenAI Responses API driven by the official
``anthropic`` and ``openai`` SDKs against ``python -m mtplx serve`` on a tiny real checkpoint
(with an API key). Replies at temperature 0 must equal the chat completion of the same
conversation: every API is the same chat generation path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.server.live import live_server

MODEL = "tiny"
API_KEY = "sdk-key"
SYSTEM = "You are terse."
PROMPT = "Tell me a story."
# Recent anthropic SDKs have no temperature argument; the field still goes in the body.
GREEDY = {"extra_body": {"temperature": 0}}


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
            tools=[{"name": "f", "input_schema": {"type": "object"}}],
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "tool" in info.value.body["error"]["message"]
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
