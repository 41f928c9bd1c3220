"""Bad input: every case answers with the right status and OpenAI error JSON naming the
field, and the server keeps serving (a good request right after succeeds)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.server.helpers import MODEL, chat_body, completion_body

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]

# (id, path, body (dict, or raw bytes), status, param, code)
CASES: list[tuple[str, str, Any, int, str | None, str | None]] = [
    ("malformed-json", CHAT, b'{"model": "fake-model", "messages": [', 400, None, "invalid_json"),
    ("not-utf8", CHAT, b"\xff\xfe{}", 400, None, "invalid_json"),
    ("json-array-body", CHAT, b"[1, 2]", 400, None, "invalid_json"),
    ("empty-body", CHAT, b"", 400, None, "invalid_json"),
    ("missing-messages", CHAT, {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("missing-model", CHAT, {"messages": USER}, 400, "model", "missing_required_parameter"),
    ("empty-messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    (
        "bad-role",
        CHAT,
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "content-wrong-type",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (
        "image-part",
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
        },
        400,
        "messages[0].content[0].type",
        None,
    ),
    ("messages-not-list", CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages", None),
    ("temperature-string", CHAT, chat_body(temperature="0.5"), 400, "temperature", None),
    ("temperature-high", CHAT, chat_body(temperature=2.5), 400, "temperature", "invalid_value"),
    ("temperature-negative", CHAT, chat_body(temperature=-1), 400, "temperature", None),
    ("top-p-zero", CHAT, chat_body(top_p=0), 400, "top_p", "invalid_value"),
    ("top-k-float", CHAT, chat_body(top_k=1.5), 400, "top_k", None),
    ("min-p-over-one", CHAT, chat_body(min_p=1.5), 400, "min_p", None),
    ("presence-out-of-range", CHAT, chat_body(presence_penalty=3), 400, "presence_penalty", None),
    (
        "frequency-out-of-range",
        CHAT,
        chat_body(frequency_penalty=-3),
        400,
        "frequency_penalty",
        None,
    ),
    ("repetition-zero", CHAT, chat_body(repetition_penalty=0), 400, "repetition_penalty", None),
    ("max-tokens-zero", CHAT, chat_body(max_tokens=0), 400, "max_tokens", "invalid_value"),
    ("max-tokens-string", CHAT, chat_body(max_tokens="10"), 400, "max_tokens", None),
    ("max-tokens-over-limit", CHAT, chat_body(max_tokens=100_000), 400, "max_tokens", None),
    (
        "max-tokens-over-context",
        CHAT,
        chat_body(max_tokens=4090),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    ("n-zero", CHAT, chat_body(n=0), 400, "n", "invalid_value"),
    ("n-over-limit", CHAT, chat_body(n=100), 400, "n", "invalid_value"),
    ("stream-not-bool", CHAT, chat_body(stream="yes"), 400, "stream", None),
    ("seed-float", CHAT, chat_body(seed=1.5), 400, "seed", None),
    ("stop-number", CHAT, chat_body(stop=5), 400, "stop", None),
    ("stop-empty-string", CHAT, chat_body(stop=[""]), 400, "stop", "invalid_value"),
    ("logit-bias-bad-key", CHAT, chat_body(logit_bias={"abc": 1}), 400, "logit_bias", None),
    ("logit-bias-out-of-range", CHAT, chat_body(logit_bias={"5": 500}), 400, "logit_bias", None),
    ("logit-bias-outside-vocab", CHAT, chat_body(logit_bias={"99999": 1}), 400, "logit_bias", None),
    (
        "top-logprobs-too-many",
        CHAT,
        chat_body(logprobs=True, top_logprobs=50),
        400,
        "top_logprobs",
        None,
    ),
    ("top-logprobs-without-logprobs", CHAT, chat_body(top_logprobs=2), 400, "top_logprobs", None),
    (
        "stream-options-without-stream",
        CHAT,
        chat_body(stream_options={"include_usage": True}),
        400,
        "stream_options",
        None,
    ),
    ("unknown-field", CHAT, chat_body(frobnicate=1), 400, "frobnicate", "unknown_parameter"),
    ("tools", CHAT, chat_body(tools=[{"type": "function"}]), 400, "tools", "unsupported_parameter"),
    (
        "tool-choice",
        CHAT,
        chat_body(tool_choice="auto"),
        400,
        "tool_choice",
        "unsupported_parameter",
    ),
    (
        "functions",
        CHAT,
        chat_body(functions=[{"name": "f"}]),
        400,
        "functions",
        "unsupported_parameter",
    ),
    (
        "response-format-json",
        CHAT,
        chat_body(response_format={"type": "json_object"}),
        400,
        "response_format",
        "unsupported_parameter",
    ),
    ("unknown-model", CHAT, {**chat_body(), "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("unknown-drafter", CHAT, chat_body(mtplx={"drafter": "magic"}), 400, "mtplx.drafter", None),
    (
        "unavailable-drafter",
        CHAT,
        chat_body(mtplx={"drafter": "draft_model"}),
        400,
        "mtplx.drafter",
        "invalid_value",
    ),
    ("depth-too-deep", CHAT, chat_body(mtplx={"depth": 99}), 400, "mtplx.depth", None),
    ("mtplx-unknown-key", CHAT, chat_body(mtplx={"width": 2}), 400, "mtplx.width", None),
    (
        "prompt-over-context",
        CHAT,
        chat_body("x" * 5000),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "max-tokens-disagree",
        CHAT,
        chat_body(max_tokens=3, max_completion_tokens=4),
        400,
        "max_completion_tokens",
        None,
    ),
    (
        "completion-missing-prompt",
        COMPLETIONS,
        {"model": MODEL},
        400,
        "prompt",
        "missing_required_parameter",
    ),
    ("completion-empty-list", COMPLETIONS, completion_body([]), 400, "prompt", None),
    ("completion-empty-string", COMPLETIONS, completion_body(""), 400, "prompt", None),
    ("completion-negative-token", COMPLETIONS, completion_body([1, -2]), 400, "prompt", None),
    ("completion-mixed-prompt", COMPLETIONS, completion_body(["a", 1]), 400, "prompt", None),
    (
        "completion-best-of",
        COMPLETIONS,
        completion_body(best_of=3),
        400,
        "best_of",
        "unsupported_parameter",
    ),
    (
        "completion-suffix",
        COMPLETIONS,
        completion_body(suffix="x"),
        400,
        "suffix",
        "unsupported_parameter",
    ),
    (
        "completion-echo-logprobs",
        COMPLETIONS,
        completion_body(echo=True, logprobs=1),
        400,
        "echo",
        None,
    ),
    (
        "completion-logprobs-bool",
        COMPLETIONS,
        completion_body(logprobs=True),
        400,
        "logprobs",
        None,
    ),
    (
        "completion-prompt-over-context",
        COMPLETIONS,
        completion_body([65] * 4096),
        400,
        "prompt",
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_bad_input_then_good_request(client, path, body, status, param, code):
    if isinstance(body, bytes):
        r = await client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("invalid_request_error")
    assert error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    good = chat_body(max_tokens=2) if path == CHAT else completion_body(max_tokens=2)
    assert (await client.post(path, json=good)).status_code == 200


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


async def test_unknown_route_and_method(client):
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = await client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_huge_body_is_413(make_app):
    import httpx

    app = make_app(max_request_bytes=4096)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post(CHAT, json=chat_body("x" * 10_000))
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"

        async def chunked():  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield json.dumps(chat_body("y" * 1000)).encode()

        r = await c.post(CHAT, content=chunked())
        assert r.status_code == 413
        assert (await c.post(CHAT, json=chat_body(max_tokens=2))).status_code == 200


async def test_fastapi_request_validation_errors_use_the_openai_shape(app, client):
    @app.get("/typed")
    async def typed(n: int) -> dict:
        return {"n": n}

    r = await client.get("/typed", params={"n": "abc"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n"
    r = await client.get("/typed")
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"


async def test_value_error_raised_inside_generate_is_400(app, client, engine, monkeypatch):
    def generate(request):
        raise ValueError("logit_bias token id 300 is outside the vocabulary")
        yield  # pragma: no cover

    monkeypatch.setattr(engine, "generate", generate)
    r = await client.post(CHAT, json=chat_body())
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
