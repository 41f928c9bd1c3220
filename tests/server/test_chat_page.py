"""GET / (the chat page) and its static files: served from the package with a strict
Content-Security-Policy, open with an API key, and nothing but the listed files; the page's
script never hands model text to the HTML parser."""

from __future__ import annotations

import ast
import re
from fnmatch import fnmatch
from pathlib import Path

import httpx
import pytest

from server.routes.page import CONTENT_SECURITY_POLICY, STATIC_FILES

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
STATIC = ROOT / "server" / "static"


async def test_page_and_security_headers(client):
    r = await client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>MTPLX chat</title>" in r.text
    csp = r.headers["content-security-policy"]
    assert csp == CONTENT_SECURITY_POLICY
    directives = dict(d.split(" ", 1) for d in csp.split("; "))
    assert directives["default-src"] == "'none'" and directives["script-src"] == "'self'"
    assert directives["connect-src"] == "'self'" and directives["frame-ancestors"] == "'none'"
    assert "unsafe" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"
    assert (await client.head("/")).status_code == 200


async def test_static_files(client):
    for name, media_type in STATIC_FILES.items():
        r = await client.get(f"/static/{name}")
        assert r.status_code == 200 and r.headers["content-type"] == media_type
        assert r.content == (STATIC / name).read_bytes()
        assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    for name in ("index.html", "../app.py", "..%2Fapp.py", "nope.js"):
        r = await client.get(f"/static/{name}")
        assert r.status_code == 404, name


async def test_every_file_the_page_names_is_served(client):
    page = (await client.get("/")).text
    script = (STATIC / "chat.js").read_text()
    named = re.findall(r'(?:src|href)="(/static/[^"]+)"', page)
    named += ["/static/" + m for m in re.findall(r'from "\./([\w.]+)"', script)]
    assert len(named) >= 4
    for path in named:
        assert (await client.get(path)).status_code == 200, path
    # No inline script or style: the CSP would block it.
    assert "<script>" not in page and "style=" not in page and "<style" not in page


async def test_page_is_open_with_an_api_key_but_the_api_is_not(make_app):
    app = make_app(api_key="s3cret")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        assert (await c.get("/")).status_code == 200
        assert (await c.get("/static/chat.js")).status_code == 200
        assert (await c.get("/v1/models")).status_code == 401
        assert (await c.get("/docs")).status_code == 401


def test_page_never_parses_strings_as_html():
    for path in STATIC.glob("*.js"):
        text = path.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
            assert sink not in text, f"{path.name} uses {sink}"


def test_static_files_are_package_data():
    # tomllib is 3.11+; the project supports 3.10: read the one line.
    line = re.search(r"^server = (\[.*\])$", (ROOT / "pyproject.toml").read_text(), re.M)
    globs = ast.literal_eval(line.group(1))
    shipped = {p.name for p in STATIC.iterdir()}
    assert shipped == {*STATIC_FILES, "index.html"}
    for name in shipped:
        assert any(fnmatch(f"static/{name}", g) for g in globs), name


async def test_streaming_chat_carries_the_figures_the_page_shows(client):
    """The page asks for include_usage; the usage chunk carries mtplx statistics."""
    from tests.server.helpers import chat_body, named_events

    r = await client.post(
        "/v1/chat/completions",
        json=chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=8),
    )
    chunks = [data for _, data in named_events(r.text) if data != "[DONE]"]
    mtplx = chunks[-1]["mtplx"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    for field in ("acceptance_rate", "mean_acceptance_length", "accepted_per_position"):
        assert field in mtplx
    assert len(mtplx["accepted_per_position"]) == len(mtplx["drafted_per_position"]) > 0
