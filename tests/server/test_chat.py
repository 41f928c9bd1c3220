"""POST /v1/chat/completions: replies, every parameter's way into the engine request,
logprobs, n and seeds, and the speculative stats block."""

from __future__ import annotations

import pytest

from tests.server.helpers import MODEL, chat_body

pytestmark = pytest.mark.anyio


async def test_basic_reply_shape(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=12, seed=1))
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "chat.completion"
    assert data["id"].startswith("chatcmpl-")
    assert data["model"] == MODEL
    (choice,) = data["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == engine.expected_text(engine.requests[-1])
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"] is None
    usage = data["usage"]
    assert usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] == len(engine.requests[-1].prompt_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + 12


async def test_chat_template_and_content_parts(client, engine):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "developer", "content": "dev note"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again", "name": "bob"},
    ]
    r = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2}
    )
    assert r.status_code == 200
    prompt = engine.tokenizer.decode(engine.requests[-1].prompt_ids)
    assert prompt == (
        "<|system|>be brief\n<|system|>dev note\n<|user|>a\nb\n<|assistant|>ok\n"
        "<|user|>again\n<|assistant|>"
    )


async def test_sampling_parameters_reach_the_engine(client, engine):
    body = chat_body(
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"65": 5, "66": -100},
        seed=42,
        stop=["\n\n", "END"],
        ignore_eos=True,
        user="someone",
        metadata={"k": "v"},
        mtplx={"drafter": "ngram", "depth": 2},
    )
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    request = engine.requests[-1]
    s = request.sampler
    assert (s.temperature, s.top_p, s.top_k, s.min_p) == (0.5, 0.9, 40, 0.05)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.1)
    assert dict(s.logit_bias) == {65: 5.0, 66: -100.0}
    assert s.seed == 42
    assert request.max_tokens == 7
    assert tuple(request.stop) == ("\n\n", "END")
    assert request.ignore_eos is True
    assert (request.drafter, request.depth) == ("ngram", 2)
    assert request.logprobs is None


async def test_defaults(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200
    request = engine.requests[-1]
    assert request.sampler.temperature == 1.0 and request.sampler.seed is None
    assert request.drafter is None  # the engine's default drafter
    assert request.depth == engine.default_depth  # the server's default depth
    # No max_tokens: fill the context, up to the server's limit.
    assert request.max_tokens == min(8192, engine.context_length - len(request.prompt_ids))


async def test_explicit_null_depth_means_adaptive(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(mtplx={"depth": None}))
    assert r.status_code == 200
    assert engine.requests[-1].depth is None


async def test_stop_string_single_and_top_k_minus_one(client, engine):
    r = await client.post(
        "/v1/chat/completions", json=chat_body(stop="xyz", top_k=-1, max_tokens=3)
    )
    assert r.status_code == 200
    assert tuple(engine.requests[-1].stop) == ("xyz",)
    assert engine.requests[-1].sampler.top_k == 0


async def test_stop_ends_with_finish_reason_stop(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(seed=5, max_tokens=200))
    full = r.json()["choices"][0]["message"]["content"]
    stop = full[10:13]
    r = await client.post(
        "/v1/chat/completions", json=chat_body(seed=5, max_tokens=200, stop=[stop])
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == full[: full.index(stop)]


async def test_eos_finishes_with_stop(client):
    r = await client.post("/v1/chat/completions", json=chat_body("[[eos]]", max_tokens=50))
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert r.json()["usage"]["completion_tokens"] == 5


async def test_n_choices_with_seed_use_seed_plus_index(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(n=3, seed=10, max_tokens=8))
    assert r.status_code == 200
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    seeds = [req.sampler.seed for req in engine.requests[-3:]]
    assert seeds == [10, 11, 12]
    for choice, request in zip(data["choices"], engine.requests[-3:], strict=True):
        assert choice["message"]["content"] == engine.expected_text(request)
    assert data["usage"]["completion_tokens"] == 24
    assert data["usage"]["prompt_tokens"] == len(engine.requests[-1].prompt_ids)


async def test_seed_reproducible(client):
    first = await client.post("/v1/chat/completions", json=chat_body(seed=7, max_tokens=20))
    again = await client.post("/v1/chat/completions", json=chat_body(seed=7, max_tokens=20))
    other = await client.post("/v1/chat/completions", json=chat_body(seed=8, max_tokens=20))
    text = [r.json()["choices"][0]["message"]["content"] for r in (first, again, other)]
    assert text[0] == text[1] != text[2]


async def test_logprobs_and_top_logprobs(client, engine):
    r = await client.post(
        "/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=3, max_tokens=4)
    )
    assert r.status_code == 200
    assert engine.requests[-1].logprobs == 3
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["token"] == entry["token"]


async def test_logprobs_without_top_logprobs(client, engine):
    r = await client.post("/v1/chat/completions", json=chat_body(logprobs=True, max_tokens=2))
    assert engine.requests[-1].logprobs == 0
    entries = r.json()["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in entries)


async def test_mtplx_stats_block(client):
    r = await client.post("/v1/chat/completions", json=chat_body(max_tokens=8))
    stats = r.json()["mtplx"]
    # The fake accepts 3 drafts then emits one bonus token per cycle: 8 tokens = 2 cycles.
    assert stats["drafts"] == 2 and stats["drafted"] == 6 and stats["accepted"] == 6
    assert stats["accepted_per_position"] == [2, 2, 2]
    assert stats["mean_acceptance_length"] == pytest.approx(4.0)


async def test_response_format_text_and_empty_tools_are_fine(client):
    r = await client.post(
        "/v1/chat/completions",
        json=chat_body(response_format={"type": "text"}, tools=[], max_tokens=1),
    )
    assert r.status_code == 200


async def test_model_may_be_the_served_name(make_app):
    app = make_app(served_model_name="my-model")
    import httpx

    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as c:
        r = await c.post(
            "/v1/chat/completions", json={**chat_body(max_tokens=1), "model": "my-model"}
        )
        assert r.status_code == 200 and r.json()["model"] == "my-model"


@pytest.mark.parametrize(
    "shape", ["list", "batched", "mapping", "batched-mapping", "array", "text"]
)
def test_chat_template_result_shapes(shape):
    # apply_chat_template returns ids, a batch, a BatchEncoding-like mapping, an array or
    # (a wrapper that ignores tokenize=True) the rendered text.
    import numpy as np

    from server.prompts import chat_prompt
    from server.schemas import ChatMessage
    from tests.fake_engine import FakeTokenizer

    class Tokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
            ids = super().apply_chat_template(messages, add_generation_prompt, tokenize=True)
            return {
                "list": ids,
                "batched": [ids],
                "mapping": {"input_ids": ids, "attention_mask": [1] * len(ids)},
                "batched-mapping": {"input_ids": np.array([ids])},
                "array": np.array(ids),
                "text": bytes(ids).decode(),
            }[shape]

    prompt = chat_prompt(Tokenizer(), [ChatMessage(role="user", content="hé")])
    assert prompt.token_ids == list("<|user|>hé\n<|assistant|>".encode())


async def test_a_tool_message_without_tool_call_id_is_a_400(client):
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages[1].tool_call_id"
    assert error["code"] == "missing_required_parameter"
