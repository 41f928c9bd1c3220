"""Bad input: every case answers with the right status and OpenAI error JSON naming the
field, and the server keeps serving (a good request right after succeeds)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mtplx.errors import InvalidParameter
from server.errors import from_validation_error, from_value_error
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
    # Python's json (httpx, the openai SDK) writes NaN and Infinity unless told not to.
    (
        "temperature-nan",
        CHAT,
        b'{"model": "fake-model", "messages": [{"role": "user", '
        b'"content": "hi"}], "temperature": NaN}',
        400,
        "temperature",
        "invalid_value",
    ),
    (
        "top-p-infinity",
        COMPLETIONS,
        b'{"model": "fake-model", "prompt": "hi", "top_p": Infinity}',
        400,
        "top_p",
        "invalid_value",
    ),
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
    ("max-tokens-negative", CHAT, chat_body(max_tokens=-1), 400, "max_tokens", "invalid_value"),
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
    # A field named like one of FastAPI's value sources is still the field.
    ("unknown-field-query", CHAT, chat_body(query=1), 400, "query", "unknown_parameter"),
    ("tools", CHAT, chat_body(tools=[{"type": "function"}]), 400, "tools[0].function", None),
    ("tool-choice", CHAT, chat_body(tool_choice="auto"), 400, "tool_choice", "invalid_value"),
    (
        "tool-choice-unknown-function",
        CHAT,
        chat_body(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        "tool_choice",
        "invalid_value",
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
        chat_body(response_format={"type": "json_schema"}),
        400,
        "response_format.json_schema",
        "invalid_value",
    ),
    (
        "response-format-bad-schema",
        CHAT,
        chat_body(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            }
        ),
        400,
        "response_format.json_schema.schema",
        "invalid_value",
    ),
    (
        "response-format-bad-regex",
        COMPLETIONS,
        {"model": "fake-model", "prompt": "x", "mtplx": {"regex": "a(b"}},
        400,
        "mtplx.regex",
        "invalid_value",
    ),
    (
        "response-format-unknown-type",
        CHAT,
        chat_body(response_format={"type": "xml"}),
        400,
        "response_format.type",
        "invalid_value",
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
        "completion-best-of-below-n",
        COMPLETIONS,
        completion_body(best_of=1, n=2),
        400,
        "best_of",
        "invalid_value",
    ),
    (
        "chat-user-content-null",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": None}]},
        400,
        "messages[0].content",
        "missing_required_parameter",
    ),
    (
        "chat-content-empty-array",
        CHAT,
        {"model": MODEL, "messages": [{"role": "user", "content": []}]},
        400,
        "messages[0].content",
        "empty_array",
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
        "completion-echo-logprobs-streamed",
        COMPLETIONS,
        completion_body(echo=True, logprobs=1, stream=True),
        400,
        "stream",
        "unsupported_parameter",
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
    # Nesting deeper than the JSON parser's recursion limit (was a 500: RecursionError).
    ("nested-100k-deep", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None, "invalid_json"),
    (
        "nested-in-a-field",
        CHAT,
        json.dumps(chat_body(metadata={"a": json.loads("[" * 200 + "]" * 200)})).encode(),
        400,
        "metadata",
        "invalid_json",
    ),
    # A lone surrogate (JSON "\ud800") cannot be encoded (was a 500 in the tokenizer).
    (
        "completion-lone-surrogate",
        COMPLETIONS,
        b'{"model": "fake-model", "prompt": "a\\ud800b"}',
        400,
        "prompt",
        "invalid_value",
    ),
    (
        "completion-lone-surrogate-in-list",
        COMPLETIONS,
        b'{"model": "fake-model", "prompt": ["ok", "\\udfff"]}',
        400,
        "prompt[1]",
        "invalid_value",
    ),
    (
        "chat-lone-surrogate",
        CHAT,
        b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud83d"}]}',
        400,
        "messages[0].content",
        "invalid_value",
    ),
    (
        "model-lone-surrogate",  # echoed in the 404 message: would fail to encode
        CHAT,
        b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        400,
        "model",
        "invalid_value",
    ),
    # Token ids past any integer type a tokenizer decodes (was a 500: OverflowError).
    ("completion-token-2-40", COMPLETIONS, completion_body([1, 2**40]), 400, "prompt", None),
    ("completion-token-2-70", COMPLETIONS, completion_body([[2**70]]), 400, "prompt", None),
    (
        "completion-token-outside-vocab",
        COMPLETIONS,
        completion_body([1, 300]),
        400,
        "prompt",
        "invalid_value",
    ),
    ("seed-negative", CHAT, chat_body(seed=-1), 400, "seed", "invalid_value"),
    ("seed-over-int64", CHAT, chat_body(seed=2**63), 400, "seed", "invalid_value"),
    # "²".isdigit() is True but int("²") fails (was param "invalid", from the message).
    ("logit-bias-superscript-key", CHAT, chat_body(logit_bias={"²": 1}), 400, "logit_bias", None),
    (
        "completion-too-many-prompts",
        COMPLETIONS,
        completion_body(["x"] * 2000),
        400,
        "prompt",
        "invalid_value",
    ),
    ("completion-prompts-times-n", COMPLETIONS, completion_body(["x"] * 4, n=5), 400, "n", None),
    (
        "chat-message-longer-than-context-could-hold",
        CHAT,
        chat_body("x" * (4096 * 16 + 1)),
        400,
        "messages",
        "context_length_exceeded",
    ),
    (
        "completion-prompt-longer-than-context-could-hold",
        COMPLETIONS,
        completion_body(["ok", "y" * (4096 * 16 + 1)]),
        400,
        "prompt[1]",
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


async def test_messages_say_what_a_value_must_be(client):
    """A chat's max_tokens below 1 says so (0 is a completion's prompt scoring, not a
    chat's), and a NaN says it is not a number rather than out of range."""
    for value in (-1, 0):
        r = await client.post(CHAT, json=chat_body(max_tokens=value))
        assert "greater than or equal to 1" in r.json()["error"]["message"]
    nan = b'{"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], '
    json_type = {"content-type": "application/json"}
    r = await client.post(CHAT, content=nan + b'"temperature": NaN}', headers=json_type)
    assert "finite number" in r.json()["error"]["message"]


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25


async def test_unknown_route_and_method(client):
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = await client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert r.headers["allow"] == "POST"  # RFC 9110: a 405 says what is allowed


def test_typed_value_error_names_its_field_and_code():
    error = from_value_error(
        InvalidParameter("prompt_ids", "prompt_ids must not be empty", code="empty"),
        {"prompt_ids": "messages"},
    )
    assert (error.status, error.param, error.code) == (400, "messages", "empty")


def test_untyped_value_error_is_not_named_after_its_first_word():
    # The message of int("²"): its first word is not a field.
    error = from_value_error(ValueError("invalid literal for int() with base 10: '²'"))
    assert error.param is None and error.status == 400
    error = from_value_error(ValueError("logit_bias token ids [300] are outside the vocabulary"))
    assert error.param == "logit_bias"


def test_validation_error_location_follows_the_data():
    # A dict key that looks like a union tag ("list", "a-b") is still a key; a union
    # member tag is never part of the field name.
    data = {"logit_bias": {"list": "x", "a-b": "y"}, "prompt": [[1, -1]]}
    errors = [{"type": "float_parsing", "loc": ("logit_bias", "list"), "msg": "not a number"}]
    assert from_validation_error(errors, data).param == "logit_bias.list"
    errors = [{"type": "float_parsing", "loc": ("logit_bias", "a-b"), "msg": "not a number"}]
    assert from_validation_error(errors, data).param == "logit_bias.a-b"
    errors = [
        {"type": "string_type", "loc": ("prompt", "str"), "msg": "m"},
        {"type": "greater_than_equal", "loc": ("prompt", "list[list[int]]", 0, 1), "msg": "m"},
    ]
    error = from_validation_error(errors, data)
    assert error.param == "prompt" and "str, list[list[int]]" in error.message
    errors = [{"type": "missing", "loc": ("messages", 0, "role"), "msg": "Field required"}]
    error = from_validation_error(errors, {"messages": [{"content": "x"}]})
    assert error.param == "messages[0].role" and error.code == "missing_required_parameter"


async def test_huge_body_is_413(make_app):
    import httpx

    app = make_app(max_request_bytes=4096)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://localhost"
    ) as c:
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
