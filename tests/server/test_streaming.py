"""Streaming and the engine's lifecycle seen over HTTP: chunk order, UTF-8 pieces,
disconnects freeing the engine, a full queue, timeouts, failures and concurrent streams."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.fake_engine import FakeEngine
from tests.server.helpers import ASGICall, chat_body, stream_text, wait_until

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


async def test_chat_stream_chunk_order(app, engine):
    body = chat_body(stream=True, max_tokens=10, seed=9)
    call = ASGICall(app, CHAT, body)
    assert await call.start() == 200
    assert call.headers["content-type"].startswith("text/event-stream")
    payloads = [p async for p in call.events()]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all("usage" not in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == engine.expected_text(engine.requests[-1])


async def test_stream_usage_chunk(app):
    body = chat_body(stream=True, max_tokens=4, stream_options={"include_usage": True})
    _, chunks = await stream_text(app, CHAT, body)
    assert all(c["usage"] is None for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 4
    assert last["mtplx"]["drafted"] == 3


async def test_stream_pieces_never_split_utf8(app, engine):
    # The fake's vocabulary is bytes; its word list has 2-, 3- and 4-byte characters.
    text, chunks = await stream_text(app, CHAT, chat_body(stream=True, max_tokens=300, seed=1))
    pieces = [c["choices"][0]["delta"].get("content", "") for c in chunks]
    # Only a character cut short by max_tokens may end the text, as U+FFFD (the tail).
    assert "\ufffd" not in text.removesuffix("\ufffd")
    assert any(len(p.encode()) > 1 for p in pieces)  # multi-byte characters did stream
    assert text == engine.expected_text(engine.requests[-1])


async def test_stream_n2_streams_each_choice_with_logprobs(app):
    body = chat_body(stream=True, n=2, max_tokens=3, seed=0, logprobs=True, top_logprobs=1)
    _, chunks = await stream_text(app, CHAT, body)
    indices = [c["choices"][0]["index"] for c in chunks]
    assert set(indices) == {0, 1}
    assert indices != sorted(indices)  # both choices decode at once, as rows of one batch
    finishes = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["index"] for c in finishes) == [0, 1]
    with_logprobs = [c for c in chunks if c["choices"][0]["logprobs"]]
    assert len(with_logprobs) == 6
    entry = with_logprobs[0]["choices"][0]["logprobs"]["content"][0]
    assert len(entry["top_logprobs"]) == 1


async def test_tokens_leave_as_soon_as_the_engine_yields_them(make_app):
    engine = FakeEngine(token_delay=0.05)
    app = make_app(engine)
    call = ASGICall(app, CHAT, chat_body(stream=True, max_tokens=40))
    started = time.monotonic()
    await call.start()
    arrivals = []
    async for data in call.events():
        if data != "[DONE]":
            arrivals.append(time.monotonic() - started)
        if len(arrivals) == 3:
            break
    # The second chunk is the first token: it arrives after ~one token delay, not after 40.
    assert arrivals[1] < 0.5
    await call.disconnect()


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_frees_the_engine_within_one_cycle(make_app, stream):
    engine = FakeEngine(token_delay=0.02)
    app = make_app(engine)
    bridge = app.state.ctx.bridge
    call = ASGICall(app, CHAT, chat_body("long", stream=stream, max_tokens=3000))
    if stream:
        assert await call.start() == 200
        received = 0
        async for _ in call.events():
            received += 1
            if received == 3:
                break
    else:
        await wait_until(lambda: bridge.active == 1 and engine.log)
        await asyncio.sleep(0.05)
    await call.disconnect()
    started = time.monotonic()
    await wait_until(lambda: ("closed", "<|user|>long\n<|assistant|>") in engine.log, 1.0)
    text, _ = await stream_text(app, CHAT, chat_body("next", stream=True, max_tokens=6))
    assert time.monotonic() - started < 0.6  # not 3000 tokens x 20 ms
    assert text
    assert bridge.stats().cancelled == 1


async def test_full_queue_returns_429_with_retry_after(make_app):
    engine = FakeEngine(token_delay=0.02, max_num_seqs=1)
    app = make_app(engine, max_queue=1)
    bridge = app.state.ctx.bridge
    running = ASGICall(app, CHAT, chat_body("a", stream=True, max_tokens=1000))
    await running.start()
    await wait_until(lambda: bridge.active == 1)
    waiting = ASGICall(app, CHAT, chat_body("b", max_tokens=5))
    await wait_until(lambda: bridge.queue_depth == 1)
    refused = ASGICall(app, CHAT, chat_body("c", max_tokens=5))
    assert await refused.start() == 429
    assert int(refused.headers["retry-after"]) >= 1
    error = json.loads(await refused.body())["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
    await running.disconnect()
    assert await waiting.start() == 200  # the waiting one is served once the engine frees
    await waiting.body()
    # Once the queue drains, requests are admitted again.
    text, _ = await stream_text(app, CHAT, chat_body("d", stream=True, max_tokens=6))
    assert text


async def test_timeout_returns_504(make_app):
    app = make_app(FakeEngine(token_delay=0.01), request_timeout=0.2)
    call = ASGICall(app, CHAT, chat_body(max_tokens=3000))
    assert await call.start(timeout=5) == 504
    assert json.loads(await call.body())["error"]["type"] == "timeout_error"


async def test_engine_failure_is_500_for_that_request_only(client):
    r = await client.post(CHAT, json=chat_body("[[fail]]"))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "generation_failed"
    r = await client.post(CHAT, json=chat_body("fine", max_tokens=3))
    assert r.status_code == 200


async def test_engine_failure_mid_stream_sends_an_error_event(app):
    call = ASGICall(app, CHAT, chat_body("[[fail]]", stream=True))
    assert await call.start() == 200
    payloads = [p async for p in call.events()]
    assert payloads[-1] == "[DONE]"  # the stream still ends as clients expect
    assert json.loads(payloads[-2])["error"]["code"] == "generation_failed"
    text, _ = await stream_text(app, CHAT, chat_body("ok", stream=True, max_tokens=6))
    assert text


async def test_sixteen_concurrent_streams_neither_lose_nor_mix_tokens(make_app):
    engine = FakeEngine(token_delay=0.0005, max_num_seqs=8)
    app = make_app(engine, max_queue=32)
    bodies = [
        chat_body(f"client {i}", stream=True, max_tokens=20 + i, seed=i, logprobs=i % 2 == 0)
        for i in range(16)
    ]
    alone = [await stream_text(app, CHAT, body) for body in bodies]
    together = await asyncio.gather(*(stream_text(app, CHAT, body) for body in bodies))
    for (text_alone, chunks_alone), (text_together, chunks_together) in zip(
        alone, together, strict=True
    ):
        assert text_together == text_alone
        strip = [c["choices"] for c in chunks_alone]
        assert [c["choices"] for c in chunks_together] == strip
    assert engine.max_concurrent == 8  # eight rows at once, the rest waited


def _cut_character_request(engine: FakeEngine, prompt: str) -> int:
    """A max_tokens at which the fake's output ends inside a multi-byte character."""
    from mtplx.request import GenerationRequest, SamplerConfig

    ids = list(f"<|user|>{prompt}\n<|assistant|>".encode())
    for max_tokens in range(1, 200):
        request = GenerationRequest(ids, SamplerConfig(seed=5), max_tokens=max_tokens)
        if engine.expected_text(request).endswith("\ufffd"):
            return max_tokens
    raise AssertionError("no cut character found")


@pytest.mark.parametrize("stream", [False, True])
async def test_finish_event_tail_is_sent(app, client, engine, stream):
    # The engine's detokenizer holds back the bytes of a character the length limit cut;
    # they come with the FinishEvent (as U+FFFD) and must reach the client, after the last
    # token's text and before the finish chunk.
    max_tokens = _cut_character_request(engine, "tail")
    body = chat_body("tail", max_tokens=max_tokens, seed=5, stream=stream)
    if stream:
        text, chunks = await stream_text(app, CHAT, body)
        assert chunks[-2]["choices"][0]["delta"] == {"content": "\ufffd"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        text = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["content"]
    assert text.endswith("\ufffd") and text == engine.expected_text(engine.requests[-1])


@pytest.mark.parametrize("stream", [False, True])
async def test_finish_event_tail_in_completions(app, client, engine, stream):
    max_tokens = _cut_character_request(engine, "tail")
    prompt = "<|user|>tail\n<|assistant|>"
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": max_tokens, "seed": 5}
    if stream:
        text, _ = await stream_text(app, "/v1/completions", {**body, "stream": True})
    else:
        text = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    assert text.endswith("\ufffd") and text == engine.expected_text(engine.requests[-1])


class BurstEngine(FakeEngine):
    """Several tokens of each row a step, as a speculative step commits them."""

    def __init__(self, burst: int, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.burst = burst

    def step(self):  # type: ignore[no-untyped-def]
        events = []
        for _ in range(self.burst):
            if self.running:
                events += super().step()
        return events


async def test_a_steps_tokens_leave_in_one_write(make_app):
    # Each write is a socket send and a wake-up of the client: a step's tokens, handed to
    # the stream together, go out together (3 steps of 3 tokens: at most 3 writes carry
    # text, where one write a token is 9), and the text is the same.
    engine = BurstEngine(3)
    app = make_app(engine)
    call = ASGICall(app, CHAT, chat_body(stream=True, max_tokens=9, seed=3))
    assert await call.start() == 200
    writes = []
    while not call.finished:
        message = await asyncio.wait_for(call._messages.get(), 10)
        call.finished = not message.get("more_body", False)
        writes.append(message.get("body", b"").decode())
    texts = []
    for write in writes:
        chunks = [
            json.loads(line[len("data: ") :])
            for line in write.splitlines()
            if line.startswith("data: {")
        ]
        texts.append("".join(c["choices"][0]["delta"].get("content", "") for c in chunks))
    with_text = [t for t in texts if t]
    assert 1 <= len(with_text) <= 3
    assert "".join(texts) == engine.expected_text(engine.requests[-1])
    assert "".join(writes).rstrip().endswith("data: [DONE]")
