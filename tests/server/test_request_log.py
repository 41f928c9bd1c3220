"""The access log: what the client controls is escaped, so it cannot forge log lines."""

from __future__ import annotations

import logging

import pytest

from server.request_log import MAX_LOGGED_CHARS, printable

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("text", "logged"),
    [
        ("/v1/plain", "/v1/plain"),
        ("/a\nrequest id=x status=200", "/a\\x0arequest id=x status=200"),
        ("/a\r\x1b[31m", "/a\\x0d\\x1b[31m"),
        ("/a\u2028b\u202e", "/a\\u2028b\\u202e"),  # line separator, right-to-left override
        ("/back\\x0a", "/back\\\\x0a"),  # a literal backslash cannot fake an escape
        ("/naïve/日本", "/naïve/日本"),
    ],
)
def test_printable(text, logged):
    assert printable(text) == logged


def test_printable_is_bounded():
    assert printable("x" * 10_000) == "x" * MAX_LOGGED_CHARS + "..."


async def test_percent_encoded_newline_in_an_unmatched_path_is_escaped(client, caplog):
    with caplog.at_level(logging.INFO, logger="mtplx.access"):
        r = await client.get(
            "/v1/nothing%0Arequest id=forged method=GET endpoint=/v1/models status=200"
        )
        await client.get("/v1/x", headers={"x-request-id": "id\x01with-control"})
    assert r.status_code == 404
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "mtplx.access"]
    assert len(lines) == 2
    assert "\n" not in lines[0] and "/v1/nothing\\x0arequest id=forged" in lines[0]
    assert "status=404" in lines[0]
    assert "id=id\\x01with-control" in lines[1]


async def test_a_client_that_leaves_mid_body_is_counted_as_499_not_500(app, caplog):
    """The client sends part of a body and disconnects: no response goes out, and the
    request is logged and counted as 499 (client closed request)."""
    messages = [
        {"type": "http.request", "body": b'{"model": "fake', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
    with caplog.at_level(logging.INFO, logger="mtplx.access"):
        await app(scope, receive, send)
    assert sent == []
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "mtplx.access"]
    assert "status=499" in line
    metrics = app.state.ctx.metrics.render().decode()
    assert 'mtplx_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0' in metrics
    assert 'status="500"' not in metrics
