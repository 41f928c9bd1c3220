"""``python -m mtplx serve`` in a subprocess, on a tiny real checkpoint (llama + MTP head,
untied LM head, a 1-layer layer-skip draft model), driven by the official ``openai`` SDK
and by raw httpx SSE parsing over TCP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.live import live_server

MODEL = "tiny"
API_KEY = "test-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NO_EOS = {"extra_body": {"ignore_eos": True}}  # exact token counts: the model may emit EOS


@pytest.fixture(scope="module")
def base_url(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("live") / "server.log"
    args = ["--drafter", "mtp", "--draft-layers", "1", "--served-model-name", MODEL]
    args += ["--api-key", API_KEY, "--log-level", "warning"]
    with live_server(tiny_checkpoint, log, *args) as url:
        yield url


@pytest.fixture(scope="module")
def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(**kwargs):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **kwargs}


def test_health_reports_the_real_engine(base_url):
    health = httpx.get(f"{base_url}/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert health["drafter"] == "mtp" and health["depth"] == "adaptive"
    assert set(health["available_drafters"]) == {
        "none",
        "ngram",
        "mtp",
        "draft_model",
        "mtp+ngram",
        "draft_model+ngram",
    }
    assert {"name", "threads", "fast", "fallback_reason"} <= set(health["blas"])


def test_chat_non_streaming(sdk):
    reply = sdk.chat.completions.create(**_chat(max_tokens=12, seed=1), **NO_EOS)
    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    stats = reply.model_extra["mtplx"]
    assert stats["cycles"] >= 1 and stats["accepted"] <= stats["drafted"]


def test_chat_streaming_matches_non_streaming(sdk):
    whole = sdk.chat.completions.create(**_chat(max_tokens=30, seed=4), **NO_EOS)
    stream = sdk.chat.completions.create(
        **_chat(max_tokens=30, seed=4),
        stream=True,
        stream_options={"include_usage": True},
        **NO_EOS,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].model_extra["mtplx"]["cycles"] >= 1


def test_completions_streaming_and_not(sdk):
    args = {"model": MODEL, "prompt": "Once upon", "max_tokens": 20, "seed": 2, **NO_EOS}
    whole = sdk.completions.create(**args)
    assert whole.object == "text_completion" and whole.usage.completion_tokens == 20
    text = "".join(c.choices[0].text for c in sdk.completions.create(**args, stream=True))
    assert text == whole.choices[0].text


def test_greedy_is_the_same_for_every_drafter(sdk):
    def text(**mtplx):
        extra = {"ignore_eos": True, "mtplx": mtplx} if mtplx else {"ignore_eos": True}
        reply = sdk.chat.completions.create(**_chat(max_tokens=24, temperature=0), extra_body=extra)
        return reply.choices[0].message.content

    plain = text(drafter="none")
    assert text() == plain  # the server's default: MTP, adaptive depth
    assert text(drafter="draft_model", depth=3) == plain
    assert text(drafter="ngram", depth=2) == plain


def test_n2_and_logprobs(sdk):
    reply = sdk.chat.completions.create(
        **_chat(max_tokens=5, seed=3, n=2, logprobs=True, top_logprobs=2), **NO_EOS
    )
    assert [c.index for c in reply.choices] == [0, 1]
    content = reply.choices[1].logprobs.content
    assert len(content) == 5 and len(content[0].top_logprobs) == 2
    assert all(entry.logprob <= 0 for entry in content)
    completion = sdk.completions.create(
        model=MODEL, prompt="x", max_tokens=3, logprobs=1, n=2, **NO_EOS
    )
    assert len(completion.choices) == 2
    assert len(completion.choices[0].logprobs.tokens) == 3


def test_seed_reproducibility(sdk):
    def text(seed):
        reply = sdk.chat.completions.create(
            **_chat(max_tokens=20, seed=seed, temperature=0.9), **NO_EOS
        )
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
    body = _chat(max_tokens=8, stream=True, ignore_eos=True, seed=5)
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=HEADERS, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = list(_sse(response))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    reply = httpx.post(
        f"{base_url}/v1/chat/completions", json={**body, "stream": False}, headers=HEADERS
    ).json()
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reply["choices"][0]["message"]["content"]


def test_client_disconnect_over_tcp_frees_the_engine(base_url):
    body = _chat(max_tokens=3000, stream=True, ignore_eos=True)  # many seconds of tokens
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=HEADERS, timeout=60
    ) as response:
        for i, _ in enumerate(_sse(response)):
            if i == 3:
                break
    started = time.monotonic()
    reply = httpx.post(
        f"{base_url}/v1/chat/completions", json=_chat(max_tokens=5), headers=HEADERS, timeout=60
    )
    assert reply.status_code == 200
    assert time.monotonic() - started < 2.0
    health = httpx.get(f"{base_url}/health").json()
    assert health["queue"]["active"] == 0 and health["requests"]["cancelled"] >= 1


def test_concurrent_streams_equal_their_solo_runs(sdk):
    """Eight greedy streams at once (rows of one batch) give the text each gives alone."""
    from concurrent.futures import ThreadPoolExecutor

    def run(i: int) -> str:
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"story {i}"}],
            max_tokens=24,
            temperature=0.0,
            stream=True,
            **NO_EOS,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    alone = [run(i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, range(8)))
    assert together == alone
    assert len(set(alone)) > 1


def test_bench_serve_admission_measures_running_streams_gaps(base_url):
    import asyncio

    from mtplx.bench.serve_bench import admission_gaps

    async def main():
        async with httpx.AsyncClient(base_url=base_url, headers=HEADERS, timeout=60) as client:
            return await admission_gaps(
                client, MODEL, streams=3, prompt_tokens=300, max_tokens=200, settle_s=0.5
            )

    result = asyncio.run(main())
    assert result.streams == 3 and result.long_ttft_s > 0
    assert result.max_gap_s > 0 and result.max_gap_before_s > 0


def test_head_health_is_200_without_a_body(base_url):
    import socket

    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and body == b""
