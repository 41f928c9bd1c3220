"""/openapi.json declares the request bodies the generation routes really take."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.anyio


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


@pytest.mark.parametrize(
    ("path", "model", "required"),
    [
        ("/v1/chat/completions", "ChatCompletionRequest", {"model", "messages"}),
        ("/v1/completions", "CompletionRequest", {"model", "prompt"}),
        ("/v1/messages", "MessagesRequest", {"model", "messages", "max_tokens"}),
        ("/v1/responses", "ResponsesRequest", {"model", "input"}),
    ],
)
async def test_post_routes_declare_their_json_body(client, path, model, required):
    document = (await client.get("/openapi.json")).json()
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    assert body["content"]["application/json"]["schema"] == {
        "$ref": f"#/components/schemas/{model}"
    }
    schema = document["components"]["schemas"][model]
    assert set(schema["required"]) == required
    assert "temperature" in schema["properties"] and schema["additionalProperties"] is False


async def test_every_reference_resolves(client):
    document = (await client.get("/openapi.json")).json()
    schemas = document["components"]["schemas"]
    refs = _refs(document)
    assert "#/components/schemas/ChatMessage" in refs
    for ref in refs:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
    assert "$defs" not in str(document)
