"""A real uvicorn server in a subprocess (tests/server/fake_server.py), driven by the
official ``openai`` SDK and by raw httpx SSE parsing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fake-model"
API_KEY = "test-key"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MTPLX_API_KEY", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.server.fake_server", "--token-delay", "0.002",
         "--api-key", API_KEY],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith("PORT "), f"launcher said {line!r}"
        url = f"http://127.0.0.1:{int(line.split()[1])}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.05)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="module")
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def _chat(**kwargs):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **kwargs}


def test_chat_non_streaming(sdk):
    reply = sdk.chat.completions.create(**_chat(max_tokens=12, seed=1))
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.model_extra["mtplx"]["drafts"] == 3


def test_chat_streaming_matches_non_streaming(sdk):
    whole = sdk.chat.completions.create(**_chat(max_tokens=30, seed=4))
    stream = sdk.chat.completions.create(
        **_chat(max_tokens=30, seed=4), stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 30


def test_completions_streaming_and_not(sdk):
    whole = sdk.completions.create(model=MODEL, prompt="Once upon", max_tokens=20, seed=2)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 20
    stream = sdk.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=20, seed=2, stream=True
    )
    text = "".join(c.choices[0].text for c in stream)
    assert text == whole.choices[0].text


def test_n2_and_logprobs(sdk):
    reply = sdk.chat.completions.create(
        **_chat(max_tokens=5, seed=3, n=2, logprobs=True, top_logprobs=2)
    )
    assert [c.index for c in reply.choices] == [0, 1]
    content = reply.choices[1].logprobs.content
    assert len(content) == 5 and len(content[0].top_logprobs) == 2
    completion = sdk.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=1, n=2)
    assert len(completion.choices) == 2
    assert len(completion.choices[0].logprobs.tokens) == 3


def test_seed_reproducibility(sdk):
    def text(seed):
        reply = sdk.chat.completions.create(**_chat(max_tokens=20, seed=seed, temperature=0.9))
        return reply.choices[0].message.content

    assert text(11) == text(11) != text(12)


def test_sdk_sees_openai_errors(sdk):
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(**_chat(temperature=5))
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(**{**_chat(), "model": "nope"})
    bad_key = openai.OpenAI(base_url=sdk.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    assert [m.id for m in sdk.models.list()] == [MODEL]


def _sse(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_raw_sse_framing(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = _chat(max_tokens=8, stream=True)
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = list(_sse(response))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_client_disconnect_over_tcp_frees_the_engine(base_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = _chat(max_tokens=3000, stream=True)  # ~6 s of tokens at 2 ms each
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        for i, _ in enumerate(_sse(response)):
            if i == 3:
                break
    started = time.monotonic()
    reply = httpx.post(
        f"{base_url}/v1/chat/completions", json=_chat(max_tokens=5), headers=headers, timeout=30
    )
    assert reply.status_code == 200
    assert time.monotonic() - started < 2.0
    health = httpx.get(f"{base_url}/health").json()
    assert health["queue"]["active"] == 0 and health["requests"]["cancelled"] >= 1
