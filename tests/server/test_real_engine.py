"""The server in process (httpx ASGITransport / raw ASGI) around the REAL engine on a tiny
fixture checkpoint: what goes over HTTP is exactly what ``engine.generate`` produces."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest

from mtplx.request import FinishEvent, GenerationRequest, SamplerConfig, TokenEvent
from tests.server.helpers import ASGICall, stream_text, wait_until

pytestmark = pytest.mark.anyio

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GREEDY = SamplerConfig(temperature=0.0)


@pytest.fixture
def app(make_app: Any, real_engine: Any) -> Any:
    return make_app(real_engine, served_model_name=MODEL)


@pytest.fixture
async def client(app: Any) -> Any:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield c


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def chat_ids(engine: Any, content: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    return [int(t) for t in ids]


async def engine_run(app: Any, request: GenerationRequest) -> tuple[str, list[int], FinishEvent]:
    """``engine.generate(request)`` on the bridge's engine thread (the thread that owns
    MLX), unformatted: (token texts + the finish tail, token ids, finish event)."""
    text, ids, finish = "", [], None
    async with app.state.ctx.bridge.submit(request) as ticket:
        async for _, event in ticket:
            text += event.text
            if isinstance(event, TokenEvent):
                ids.append(event.token_id)
            else:
                finish = event
    assert finish is not None
    return text, ids, finish


def plain_greedy(prompt_ids: list[int], max_tokens: int, **extra: Any) -> GenerationRequest:
    """Plain one-token-at-a-time greedy decoding: the reference for every drafter."""
    return GenerationRequest(
        prompt_ids, GREEDY, max_tokens=max_tokens, drafter="none", depth=0, **extra
    )


async def test_chat_greedy_over_http_equals_plain_engine_output(app, client, real_engine):
    expected, ids, finish = await engine_run(
        app, plain_greedy(chat_ids(real_engine, "Hello there"), 24)
    )
    body = chat("Hello there", max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    r = await client.post(CHAT, json=body)  # the engine's default drafter: MTP, adaptive
    assert r.status_code == 200, r.text
    data = r.json()
    (choice,) = data["choices"]
    assert choice["message"]["content"] == expected
    assert choice["finish_reason"] == finish.finish_reason
    assert data["usage"]["completion_tokens"] == len(ids) == finish.stats.completion_tokens
    assert data["usage"]["prompt_tokens"] == len(chat_ids(real_engine, "Hello there"))
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [real_engine.token_text(t) for t in ids]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    # Greedy: the chosen token is the most likely one.
    assert all(e["logprob"] == pytest.approx(e["top_logprobs"][0]["logprob"]) for e in entries)
    assert data["mtplx"]["cycles"] >= 1

    text, chunks = await stream_text(app, CHAT, {**body, "stream": True})
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == finish.finish_reason


async def test_completions_streaming_and_not_equal_engine_output(app, client, real_engine):
    prompt = "Once upon a time"
    prompt_ids = list(real_engine.tokenizer.encode(prompt))
    expected, ids, _ = await engine_run(app, plain_greedy(prompt_ids, 20))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0}
    data = (await client.post(COMPLETIONS, json=body)).json()
    assert data["choices"][0]["text"] == expected
    assert data["usage"]["completion_tokens"] == len(ids)
    text, _ = await stream_text(app, COMPLETIONS, {**body, "stream": True})
    assert text == expected
    echoed = (await client.post(COMPLETIONS, json={**body, "echo": True})).json()
    assert echoed["choices"][0]["text"] == prompt + expected
    by_ids = (await client.post(COMPLETIONS, json={**body, "prompt": prompt_ids})).json()
    assert by_ids["choices"][0]["text"] == expected


async def test_completion_text_is_its_tokens_text_and_a_chat_reply_drops_a_leading_space(
    app, client, real_engine
):
    """A completion continues its prompt: its text (streamed, echoed) is the concatenation
    of its tokens' text, a leading space included; a chat reply starts a turn of its own."""
    (space,) = real_engine.tokenizer.encode(" ", add_special_tokens=False)
    body = {
        "model": MODEL,
        "prompt": "Once upon a",
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": 1,
        "logit_bias": {str(space): 100},  # every token a space
    }
    choice = (await client.post(COMPLETIONS, json=body)).json()["choices"][0]
    assert choice["text"] == "".join(choice["logprobs"]["tokens"]) == "    "
    echoed = (await client.post(COMPLETIONS, json={**body, "echo": True, "logprobs": None})).json()
    assert echoed["choices"][0]["text"] == "Once upon a    "
    text, _ = await stream_text(app, COMPLETIONS, {**body, "stream": True})
    assert text == "    "
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "logit_bias": {str(space): 100},
    }
    reply = (await client.post(CHAT, json=chat)).json()["choices"][0]["message"]["content"]
    assert reply == " "  # the first of the two spaces is the turn's leading space


async def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(app, client, real_engine):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 0): the
    prompt's tokens with their logprobs (the first null), the same as the engine scores them
    and the same beside concurrent streams; vLLM's prompt_logprobs carries the same."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = list(real_engine.tokenizer.encode(prompt))
    _, _, finish = await engine_run(app, plain_greedy(ids, 0, prompt_logprobs=1))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}
    r = await client.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [real_engine.token_text(t) for t in ids]
    assert logprobs["token_logprobs"] == [s.logprob for s in finish.prompt_logprobs]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    assert r.json()["usage"]["completion_tokens"] == 0

    streams = [
        client.post(COMPLETIONS, json={"model": MODEL, "prompt": f"story {i}", "max_tokens": 24})
        for i in range(4)
    ]
    replies = await asyncio.gather(client.post(COMPLETIONS, json=body), *streams)
    assert replies[0].json()["choices"][0]["logprobs"] == logprobs

    vllm = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0}
    scored = (await client.post(COMPLETIONS, json=vllm)).json()["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for token, entry, expected in zip(ids[1:], scored[1:], finish.prompt_logprobs[1:], strict=True):
        assert entry[str(token)]["logprob"] == expected.logprob
        assert entry[str(token)]["rank"] == expected.rank


async def test_prompt_scoring_is_refused_where_it_cannot_be_served(client):
    stream = {"model": MODEL, "prompt": "a b", "echo": True, "logprobs": 1, "stream": True}
    r = await client.post(COMPLETIONS, json=stream)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = await client.post(COMPLETIONS, json={"model": MODEL, "prompt": "a b", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


async def test_sixteen_concurrent_greedy_streams_match_their_solo_runs(app, real_engine):
    bodies = [chat(f"client {i} says hi", max_tokens=16, temperature=0) for i in range(16)]
    solo = [await stream_text(app, CHAT, {**b, "stream": True}) for b in bodies]
    together = await asyncio.gather(
        *(stream_text(app, CHAT, {**b, "stream": True}) for b in bodies)
    )
    assert [text for text, _ in together] == [text for text, _ in solo]
    assert len({text for text, _ in solo}) > 8  # distinct prompts, distinct outputs
    # Each equals the plain engine output, held-back finish tails included.
    tails = []
    for i, (text, _) in enumerate(solo):
        expected, _, finish = await engine_run(
            app, plain_greedy(chat_ids(real_engine, f"client {i} says hi"), 16)
        )
        assert text == expected
        tails.append(finish.text)
    assert any(tails)  # some outputs ended inside a character: the tail did reach clients


async def test_disconnect_mid_stream_frees_the_engine_within_a_cycle(app, client):
    bridge = app.state.ctx.bridge
    before = bridge.stats().cancelled
    # ignore_eos: an unseeded sample of the fixture model may draw EOS within 4 chunks.
    body = chat("go on forever", max_tokens=3000, stream=True, ignore_eos=True)
    call = ASGICall(app, CHAT, body)
    assert await call.start() == 200
    seen = 0
    async for _ in call.events():
        seen += 1
        if seen == 4:
            break
    assert bridge.active == 1
    started = time.monotonic()
    await call.disconnect()
    await wait_until(lambda: bridge.active == 0, timeout=2.0)
    r = await client.post(CHAT, json=chat("next", max_tokens=2))
    assert r.status_code == 200
    assert time.monotonic() - started < 2.0  # far less than 3000 tokens would take
    assert bridge.stats().cancelled == before + 1


async def test_mtplx_extension_ngram_depth_3(app, client, real_engine):
    prompt = "abcabcabc abcabcabc"
    expected, _, _ = await engine_run(app, plain_greedy(chat_ids(real_engine, prompt), 48))
    body = chat(prompt, max_tokens=48, temperature=0, mtplx={"drafter": "ngram", "depth": 3})
    data = (await client.post(CHAT, json=body)).json()
    assert data["choices"][0]["message"]["content"] == expected  # exact under speculation
    stats = data["mtplx"]
    assert stats["drafts"] > 0 and 0 < stats["drafted"] <= 3 * stats["drafts"]
    assert len(stats["drafted_per_position"]) <= 3
    assert sum(stats["drafted_per_position"]) == stats["drafted"]
    assert sum(stats["accepted_per_position"]) == stats["accepted"] <= stats["drafted"]
    # Prefill samples the first token; each cycle then commits its accepted drafts + 1
    # (the last cycle's surplus past max_tokens is dropped).
    assert stats["cycles"] < data["usage"]["completion_tokens"]
    assert data["usage"]["completion_tokens"] <= 1 + stats["cycles"] + stats["accepted"]
    assert stats["mean_acceptance_length"] >= 1.0
    assert stats["verify_s"] > 0

    _, chunks = await stream_text(
        app, CHAT, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert chunks[-1]["mtplx"]["drafted"] == stats["drafted"]


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_over_http(app, client, stream):
    body = chat("stop somewhere", max_tokens=40, temperature=0)
    full = (await client.post(CHAT, json=body)).json()["choices"][0]["message"]["content"]
    # A two-character stop string from the middle of the greedy text (no U+FFFD).
    start = next(i for i in range(len(full) // 3, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    body = {**body, "stop": [stop]}
    if stream:
        text, chunks = await stream_text(app, CHAT, {**body, "stream": True})
        reason = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = (await client.post(CHAT, json=body)).json()["choices"][0]
        text, reason = choice["message"]["content"], choice["finish_reason"]
    assert text == full[: full.find(stop)]
    assert reason == "stop"


async def test_eos_ends_with_stop_unless_ignored(client):
    eos = {"258": 100.0}  # <|im_end|>, the fixture tokenizer's end of sequence
    choice = (await client.post(CHAT, json=chat("hi", max_tokens=5, logit_bias=eos))).json()
    assert choice["choices"][0]["finish_reason"] == "stop"
    assert choice["choices"][0]["message"]["content"] == ""
    assert choice["usage"]["completion_tokens"] == 0
    body = chat("hi", max_tokens=5, logit_bias=eos, ignore_eos=True)
    ignored = (await client.post(CHAT, json=body)).json()
    assert ignored["choices"][0]["finish_reason"] == "length"
    assert ignored["usage"]["completion_tokens"] == 5


async def test_seeded_sampling_is_reproducible_and_n_choices_differ(client):
    body = chat("roll the dice", max_tokens=12, temperature=1.0, seed=7, n=2)
    first = (await client.post(CHAT, json=body)).json()
    again = (await client.post(CHAT, json=body)).json()
    texts = [c["message"]["content"] for c in first["choices"]]
    assert texts == [c["message"]["content"] for c in again["choices"]]
    assert texts[0] != texts[1]  # choice k samples with seed + k


async def test_health_and_metrics_with_the_real_engine(client, real_engine):
    health = (await client.get("/health")).json()
    assert health["status"] == "ok" and health["model"] == MODEL
    assert set(health["available_drafters"]) == set(real_engine.available_drafters)
    assert health["context_length"] == real_engine.context_length
    await client.post(CHAT, json=chat("count", max_tokens=4, temperature=0))
    metrics = (await client.get("/metrics")).text
    assert "mtplx_generation_tokens_total" in metrics
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == MODEL
    assert json.loads(json.dumps(models))  # plain JSON


async def test_kv_gauge_and_a_prompt_over_the_kv_bound(app, client, real_engine):
    # /health and /metrics report the KV the engine's stores hold and the bound; a prompt
    # whose KV alone is over the bound is a 400 before it is queued, in the OpenAI shape.
    bridge = app.state.ctx.bridge
    await client.post(CHAT, json=chat("count", max_tokens=4, temperature=0))
    await wait_until(lambda: bridge.kv is not None and bridge.kv.bytes == real_engine.kv_nbytes)
    assert real_engine.kv_nbytes > 0
    health = (await client.get("/health")).json()
    assert health["kv"] == {"bytes": real_engine.kv_nbytes, "max_bytes": None}
    metrics = (await client.get("/metrics")).text
    assert f"mtplx_kv_bytes {float(real_engine.kv_nbytes)}" in metrics
    assert "mtplx_kv_max_bytes" not in metrics  # no bound
    ids = chat_ids(real_engine, "count to three")
    bound = real_engine.prompt_kv_bytes(len(ids) - 1)
    real_engine.max_kv_bytes = bound
    try:
        r = await client.post(CHAT, json=chat("count to three", max_tokens=4))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert f"at most {len(ids) - 1} prompt tokens fit" in error["message"]
        r = await client.post(CHAT, json=chat("count", max_tokens=4, temperature=0))
        assert r.status_code == 200, r.text
        await wait_until(lambda: bridge.kv.max_bytes == bound)
        metrics = (await client.get("/metrics")).text
        assert f"mtplx_kv_max_bytes {float(bound)}" in metrics
        assert (await client.get("/health")).json()["kv"]["max_bytes"] == bound
    finally:
        real_engine.max_kv_bytes = None
