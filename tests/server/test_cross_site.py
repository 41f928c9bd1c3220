"""Web pages against a local server: foreign Host headers (DNS rebinding) refused with the
OpenAI error shape, ``allowed_hosts`` widening that, and CORS only for allowed origins."""

from __future__ import annotations

import httpx
import pytest

from server.cross_site import allowed_host_names, host_name
from server.settings import ServerSettings
from tests.server.helpers import chat_body

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _client(app, base_url: str = "http://localhost") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:8000", "localhost"),
        ("LOCALHOST", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8080", "::1"),
        ("[::1]", "::1"),
        ("localhost.:1", "localhost"),
        ("evil.example:8000", "evil.example"),
        ("localhost:", "localhost"),
        ("[::1]evil.com", ""),
        ("[::1]:80evil.com", ""),
        ("localhost:80evil", ""),
        ("localhost:1@evil.com", ""),
        ("[::1", ""),
    ],
)
def test_host_name(header, name):
    assert host_name(header) == name


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8000", "127.0.0.1:8000", "[::1]:8000", "127.0.0.1"]
)
async def test_loopback_host_names_are_accepted(make_app, host):
    app = make_app()
    async with _client(app) as c:
        r = await c.post(CHAT, json=chat_body(max_tokens=2), headers={"host": host})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "host",
    ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "[::1]evil.com"],
)
async def test_a_foreign_host_is_refused_before_anything_runs(make_app, engine, host):
    app = make_app(engine)
    async with _client(app) as c:
        r = await c.post(CHAT, json=chat_body(max_tokens=2), headers={"host": host})
        assert r.status_code == 400
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "invalid_host" and error["type"] == "invalid_request_error"
        assert (await c.get("/health", headers={"host": host})).status_code == 400
    assert engine.requests == []


async def test_allowed_hosts_widen_the_loopback_names(make_app):
    app = make_app(allowed_hosts="llm.lan, box.local")
    async with _client(app) as c:
        for host in ("llm.lan:8000", "box.local", "localhost:1"):
            assert (await c.get("/health", headers={"host": host})).status_code == 200
        assert (await c.get("/health", headers={"host": "other.lan"})).status_code == 400


async def test_star_accepts_any_host(make_app):
    app = make_app(allowed_hosts="*")
    async with _client(app) as c:
        assert (await c.get("/health", headers={"host": "anything.example"})).status_code == 200


def test_public_bind_accepts_any_host_unless_restricted():
    public = {"host": "0.0.0.0", "api_key": "k"}
    assert allowed_host_names(ServerSettings(**public)) is None
    names = allowed_host_names(ServerSettings(**public, allowed_hosts=["LLM.example"]))
    assert names is not None and "llm.example" in names and "localhost" in names
    assert allowed_host_names(ServerSettings(host="127.0.0.1")) == {"localhost", "127.0.0.1", "::1"}


async def test_no_cors_headers_by_default(client):
    origin = {"origin": "http://evil.example"}
    r = await client.get("/v1/models", headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    preflight = {
        **origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    r = await client.options(CHAT, headers=preflight)
    assert "access-control-allow-origin" not in r.headers


async def test_allowed_origins_get_cors_even_with_an_api_key(make_app):
    app = make_app(allowed_origins="http://localhost:3000", api_key="s3cret")
    preflight = {
        "origin": "http://localhost:3000",
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with _client(app) as c:
        # The preflight carries no Authorization header: CORS answers it before the key.
        r = await c.options(CHAT, headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        headers = {"origin": "http://localhost:3000", "authorization": "Bearer s3cret"}
        r = await c.post(CHAT, json=chat_body(max_tokens=2), headers=headers)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
        r = await c.options(CHAT, headers={**preflight, "origin": "http://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"
