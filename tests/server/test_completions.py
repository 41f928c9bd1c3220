"""POST /v1/completions: the four prompt forms, n per prompt, echo, logprobs, streaming."""

from __future__ import annotations

import pytest

from tests.server.helpers import completion_body, stream_text

pytestmark = pytest.mark.anyio


async def test_string_prompt(client, engine):
    r = await client.post("/v1/completions", json=completion_body("Once", seed=3))
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "text_completion" and data["id"].startswith("cmpl-")
    (choice,) = data["choices"]
    request = engine.requests[-1]
    assert request.prompt_ids == list(b"Once")
    assert request.max_tokens == 16  # OpenAI's completions default
    assert choice["text"] == engine.expected_text(request)
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert data["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 16,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_list_of_strings_gives_one_choice_set_per_prompt(client, engine):
    r = await client.post(
        "/v1/completions", json=completion_body(["ab", "cd"], n=2, max_tokens=4, seed=1)
    )
    assert r.status_code == 200
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    prompts = [bytes(req.prompt_ids) for req in engine.requests[-4:]]
    assert prompts == [b"ab", b"ab", b"cd", b"cd"]
    assert [req.sampler.seed for req in engine.requests[-4:]] == [1, 2, 3, 4]
    assert r.json()["usage"]["prompt_tokens"] == 4  # each prompt counted once


async def test_token_id_prompts(client, engine):
    r = await client.post("/v1/completions", json=completion_body([72, 105], max_tokens=2))
    assert r.status_code == 200
    assert engine.requests[-1].prompt_ids == [72, 105]
    r = await client.post(
        "/v1/completions", json=completion_body([[72, 105], [79, 75]], max_tokens=2)
    )
    assert r.status_code == 200
    assert [req.prompt_ids for req in engine.requests[-2:]] == [[72, 105], [79, 75]]
    assert len(r.json()["choices"]) == 2


async def test_echo_prepends_the_prompt(client, engine):
    r = await client.post(
        "/v1/completions", json=completion_body("Say: ", echo=True, max_tokens=5, seed=2)
    )
    text = r.json()["choices"][0]["text"]
    assert text == "Say: " + engine.expected_text(engine.requests[-1])
    r = await client.post(
        "/v1/completions", json=completion_body([83, 97], echo=True, max_tokens=1)
    )
    assert r.json()["choices"][0]["text"].startswith("Sa")


async def test_logprobs_int(client, engine):
    r = await client.post("/v1/completions", json=completion_body("x", logprobs=2, max_tokens=5))
    assert engine.requests[-1].logprobs == 2
    choice = r.json()["choices"][0]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 5
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


async def test_streaming_completions_with_echo_and_usage(app, engine):
    body = completion_body(
        "Hey", stream=True, echo=True, max_tokens=6, seed=4, stream_options={"include_usage": True}
    )
    text, chunks = await stream_text(app, "/v1/completions", body)
    assert text == "Hey" + engine.expected_text(engine.requests[-1])
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[0]["choices"][0]["text"] == "Hey"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert "mtplx" in chunks[-1]


async def test_streaming_completions_logprobs(app):
    body = completion_body("Hey", stream=True, logprobs=1, max_tokens=4)
    _, chunks = await stream_text(app, "/v1/completions", body)
    token_chunks = [c for c in chunks if c["choices"][0]["logprobs"]]
    assert len(token_chunks) == 4
    offsets = [c["choices"][0]["logprobs"]["text_offset"][0] for c in token_chunks]
    assert offsets == sorted(offsets)
