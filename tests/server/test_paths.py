"""A trailing slash names the same route (``/v1/models/`` is ``/v1/models``), for every
route, the API key's open paths included."""

from __future__ import annotations

import httpx
import pytest

from server.paths import without_trailing_slash
from tests.server.helpers import MODEL, chat_body, completion_body

pytestmark = pytest.mark.anyio

USER = [{"role": "user", "content": "x"}]


def test_without_trailing_slash():
    assert without_trailing_slash("/v1/models/") == "/v1/models"
    assert without_trailing_slash("/v1/models//") == "/v1/models"
    assert without_trailing_slash("/v1/models") == "/v1/models"
    assert without_trailing_slash("/") == "/"
    assert without_trailing_slash("//") == "/"


async def test_models_with_and_without_slash(client):
    listing = await client.get("/v1/models")
    assert (await client.get("/v1/models/")).json() == listing.json()
    card = (await client.get(f"/v1/models/{MODEL}")).json()
    assert card["id"] == MODEL and card == listing.json()["data"][0]
    assert (await client.get(f"/v1/models/{MODEL}/")).json() == card
    missing = await client.get("/v1/models/nope/")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions/", chat_body(max_tokens=2)),
        ("/v1/completions/", completion_body(max_tokens=2)),
        ("/v1/messages/", {"model": MODEL, "max_tokens": 2, "messages": USER}),
        ("/v1/messages/count_tokens/", {"model": MODEL, "messages": USER}),
        ("/v1/responses/", {"model": MODEL, "input": "x", "max_output_tokens": 2}),
    ],
)  # fmt: skip
async def test_posts_with_a_trailing_slash_are_served_not_redirected(client, path, body):
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text


async def test_open_paths_stay_open_with_a_slash(make_app):
    app = make_app(api_key="s3cret")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        assert (await c.get("/health/")).status_code == 200
        assert (await c.get("/metrics/")).status_code == 200
        assert (await c.get("/v1/models/")).status_code == 401
        ok = await c.get("/v1/models/", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
