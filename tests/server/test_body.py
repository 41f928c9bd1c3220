"""Reading JSON bodies: only ``application/json`` (415 otherwise, before any work), nesting
and lone surrogates refused by name, parsing off the event loop."""

from __future__ import annotations

import json

import pytest

from server.body import (
    MAX_JSON_DEPTH,
    _has_problem,
    _locate_problem,
    check_json_values,
    decode_json,
)
from server.errors import APIError
from server.schemas import CompletionRequest
from tests.server.helpers import chat_body, completion_body

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_a_post_that_is_not_json_is_415_and_generates_nothing(client, engine, content_type):
    # text/plain is what a web page can POST cross-site without a CORS preflight.
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps(chat_body(max_tokens=2)).encode()
    r = await client.post(CHAT, content=body, headers=headers)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "unsupported_media_type"
    assert error["type"] == "invalid_request_error"
    assert engine.requests == []


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON"])
async def test_json_content_type_with_parameters_or_case(client, content_type):
    body = json.dumps(chat_body(max_tokens=2)).encode()
    r = await client.post(CHAT, content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text


def _lists(depth: int) -> list:
    return json.loads("[" * depth + "]" * depth)


def test_depth_limit_names_the_top_level_field():
    check_json_values({"metadata": _lists(MAX_JSON_DEPTH)})  # the deepest value allowed
    too_deep = {"metadata": _lists(MAX_JSON_DEPTH + 1)}
    with pytest.raises(APIError) as info:
        check_json_values(too_deep)
    assert info.value.param == "metadata" and info.value.code == "invalid_json"


def test_lone_surrogates_are_found_in_values_and_keys():
    with pytest.raises(APIError) as info:
        check_json_values({"messages": [{"role": "user", "content": "ok \udc00"}]})
    assert info.value.param == "messages[0].content"
    with pytest.raises(APIError) as info:
        check_json_values({"logit_bias": {"\ud800": 1}})
    assert info.value.param == "logit_bias"
    check_json_values({"prompt": "a pair is fine: \U0001f642 日本"})


def test_a_lone_surrogate_in_a_top_level_key_is_named_plainly():
    with pytest.raises(APIError) as info:
        check_json_values({"model": "m", "\ud800x": 1})
    message = info.value.message
    assert "None" not in message and "at the top level of the body" in message
    assert '"\\ud800x"' in message and info.value.param is None


def test_decode_json_passes_the_data_to_the_error_location():
    # The error's location is read against the parsed body: "5" is a key of logit_bias.
    raw = json.dumps(completion_body(logit_bias={"5": "high"})).encode()
    with pytest.raises(APIError) as info:
        decode_json(raw, CompletionRequest)
    assert info.value.param == "logit_bias.5"


@pytest.mark.parametrize("levels", range(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 3))
@pytest.mark.parametrize("leaf", ["x", 1, [], {}, "a\ud800"])
def test_the_fast_check_agrees_with_the_one_that_names_the_field(levels, leaf):
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    data = {"a": value}
    try:
        _locate_problem(data, MAX_JSON_DEPTH)  # the walk that builds every path
        located = False
    except APIError:
        located = True
    assert _has_problem(data, MAX_JSON_DEPTH) == located


def test_a_million_short_strings_pass_the_quick_walk():
    data = {"stop": ["ab"] * 1_000_000}
    check_json_values(data)
    assert not _has_problem(data, MAX_JSON_DEPTH)


@pytest.mark.parametrize(
    ("path", "field", "item"),
    [
        (CHAT, "messages", {"role": "user", "content": "x"}),
        (CHAT, "tools", {"type": "function", "function": {"name": "f"}}),
        ("/v1/messages", "messages", {"role": "user", "content": "x"}),
        ("/v1/messages/count_tokens", "messages", {"role": "user", "content": "x"}),
        ("/v1/responses", "input", {"role": "user", "content": "x"}),
        ("/tokenize", "messages", {"role": "user", "content": "x"}),
    ],
)
async def test_lists_longer_than_the_context_are_refused_before_validation(
    client, monkeypatch, path, field, item
):
    """More messages, tools or input items than the context has tokens (each renders one
    at least) is a 400 naming the field before pydantic validates them: validating 420k
    messages held the GIL, and so every other request, for 5 s."""
    import server.body

    validated = []
    real = server.body.check_json_values
    monkeypatch.setattr(server.body, "check_json_values", lambda d: validated.append(d) or real(d))
    body = {"model": "fake-model", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    if path == "/v1/responses":
        body = {"model": "fake-model", "input": "x"}
    if path == "/tokenize":
        body = {"messages": [{"role": "user", "content": "x"}]}
    body[field] = [item] * 4097  # the fake engine's context: 4,096 tokens
    r = await client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "array too long" in error["message"] and not validated
    if not path.startswith("/v1/messages"):
        assert error["param"] == field and error["code"] == "array_above_max_length"


def test_decode_json_checks_list_lengths_first():
    raw = json.dumps(chat_body(messages=[{"role": "user", "content": "x"}] * 3)).encode()
    with pytest.raises(APIError, match="maximum length 2"):
        decode_json(raw, CompletionRequest, {"messages": 2})


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 5000}]},
            "messages[0].content",
        ),
        ({"logit_bias": {str(i): 1 for i in range(5000)}}, "logit_bias"),
    ],
    ids=["content-parts", "logit-bias"],
)
async def test_any_list_or_object_longer_than_context_and_vocabulary_is_refused(
    client, extra, param
):
    """No array or object nested in a request may hold more items than the context's
    tokens or the vocabulary (4,096 and 257 in the fake engine): a 15 MB body of 420k text
    parts held the GIL for 4 s in validation."""
    r = await client.post(CHAT, json=chat_body(max_tokens=1, **extra))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"].endswith("_above_max_length")


def test_the_length_check_comes_before_the_items_are_walked():
    data = {"messages": [{"content": ["\ud800"] * 10}]}  # a bad string inside the long list
    with pytest.raises(APIError, match="too long") as info:
        check_json_values(data, max_len=5)
    assert info.value.param == "messages[0].content"
    assert _has_problem({"a": [1] * 5}, MAX_JSON_DEPTH, 5) is False
    assert _has_problem({"a": [1] * 6}, MAX_JSON_DEPTH, 5) is True
