"""/v1/models, /health (ready, loading, failed), /metrics, the API key and request logs."""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

from server.engine_bridge import EngineBridge
from tests.fake_engine import FakeEngine
from tests.server.helpers import MODEL, chat_body

pytestmark = pytest.mark.anyio


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost")


async def test_models(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list"
    (card,) = data["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "mtplx"
    assert (await client.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
    r = await client.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_health_when_ready(make_app):
    app = make_app(FakeEngine())
    app.state.ctx.blas_info = lambda: {"name": "openblas-shim", "threads": 4}
    async with _client(app) as c:
        r = await c.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok"
    assert body["model"] == MODEL and body["drafter"] == "mtp" and body["depth"] == 3
    assert body["queue"] == {"depth": 0, "active": 0, "max": 64}
    assert body["blas"] == {"name": "openblas-shim", "threads": 4}
    assert body["uptime_s"] >= 0


async def test_health_is_not_ok_while_rows_are_held_for_no_request(make_app):
    engine = FakeEngine()
    app = make_app(engine)
    engine.num_orphan_rows = 2  # as if a failed admission had kept two rows
    async with _client(app) as c:
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        r = await c.get("/health")
        assert r.status_code == 503
        assert r.json()["status"] == "error" and "2 batch rows" in r.json()["error"]
        engine.num_orphan_rows = 0
        assert (await c.post("/v1/chat/completions", json=chat_body())).status_code == 200
        assert (await c.get("/health")).status_code == 200


async def test_health_adaptive_depth_and_broken_blas_probe(make_app):
    app = make_app(FakeEngine(default_depth=None))

    def broken():
        raise RuntimeError("no shim")

    app.state.ctx.blas_info = broken
    async with _client(app) as c:
        body = (await c.get("/health")).json()
    assert body["depth"] == "adaptive"
    assert body["blas"].startswith("unknown")


async def test_loading_is_503_then_ready(make_app):
    gate = threading.Event()

    def factory():
        gate.wait(5)
        return FakeEngine()

    bridge = EngineBridge(factory)
    from server.app import create_app

    app = create_app(bridge)
    bridge.start()
    try:
        async with _client(app) as c:
            r = await c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            r = await c.post("/v1/chat/completions", json=chat_body())
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "model_not_ready"
            assert r.headers["retry-after"] == "5"
            assert (await c.get("/v1/models")).status_code == 503
            gate.set()
            assert bridge.wait_ready(5)
            assert (await c.get("/health")).status_code == 200
            r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
            assert r.status_code == 200
    finally:
        gate.set()
        bridge.stop()


async def test_failed_load_is_503_with_the_error(make_app):
    def factory():
        raise FileNotFoundError("checkpoint missing")

    bridge = EngineBridge(factory)
    from server.app import create_app

    app = create_app(bridge)
    bridge.start()
    bridge.wait_ready(5)
    async with _client(app) as c:
        r = await c.get("/health")
        assert r.status_code == 503
        assert r.json()["status"] == "error" and "checkpoint missing" in r.json()["error"]
        r = await c.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and "checkpoint missing" in r.json()["error"]["message"]


async def test_metrics_after_traffic(client):
    await client.post("/v1/chat/completions", json=chat_body(max_tokens=8))
    await client.post("/v1/chat/completions", json=chat_body(stream=True, max_tokens=8))
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
    await client.post("/v1/chat/completions", json=chat_body(temperature=9))
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'mtplx_requests_total{endpoint="/v1/chat/completions",status="200"} 2.0' in text
    assert 'mtplx_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert 'mtplx_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
    assert 'mtplx_time_to_first_token_seconds_count{endpoint="/v1/chat/completions"} 2.0' in text
    assert 'mtplx_request_duration_seconds_count{endpoint="/v1/completions"} 1.0' in text
    assert "mtplx_generation_tokens_total 20.0" in text
    # 8 + 8 + 4 tokens = 2 + 2 + 1 cycles of 3 drafts each.
    assert "mtplx_spec_decode_num_drafts_total 5.0" in text
    assert "mtplx_spec_decode_num_draft_tokens_total 15.0" in text
    assert "mtplx_spec_decode_num_accepted_tokens_total 15.0" in text
    assert 'mtplx_spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5.0' in text
    assert "mtplx_queue_depth 0.0" in text and "mtplx_requests_running 0.0" in text


async def test_kv_gauge_in_health_and_metrics(make_app):
    engine = FakeEngine()
    async with _client(make_app(engine)) as c:
        # An engine that does not say what KV it holds: no gauge.
        assert "kv" not in (await c.get("/health")).json()
        assert "mtplx_kv_bytes" not in (await c.get("/metrics")).text
    engine = FakeEngine()
    engine.kv_nbytes = 3 << 20  # type: ignore[attr-defined]
    engine.max_kv_bytes = 4 << 30  # type: ignore[attr-defined]
    app = make_app(engine)
    async with _client(app) as c:
        # Published by the engine thread: once loaded, then after each admission and step.
        assert (await c.get("/health")).json()["kv"] == {"bytes": 3 << 20, "max_bytes": 4 << 30}
        engine.kv_nbytes = 5 << 20  # type: ignore[attr-defined]
        assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))).is_success
        assert (await c.get("/health")).json()["kv"] == {"bytes": 5 << 20, "max_bytes": 4 << 30}
        text = (await c.get("/metrics")).text
        assert "mtplx_kv_bytes 5.24288e+06" in text
        assert "mtplx_kv_max_bytes 4.294967296e+09" in text
        engine.max_kv_bytes = None  # type: ignore[attr-defined]
        assert (await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))).is_success
        assert (await c.get("/health")).json()["kv"]["max_bytes"] is None
        assert "mtplx_kv_max_bytes" not in (await c.get("/metrics")).text


async def test_metrics_registries_are_per_app(make_app):
    first, second = make_app(), make_app()
    async with _client(first) as c:
        await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
    async with _client(second) as c:
        text = (await c.get("/metrics")).text
    assert 'status="200"} 1.0' not in text.split("mtplx_requests_total")[1].split("#")[0]


async def test_api_key(make_app):
    app = make_app(api_key="s3cret")
    async with _client(app) as c:
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2))
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        bad = {"Authorization": "Bearer wrong"}
        assert (await c.get("/v1/models", headers=bad)).status_code == 401
        good = {"Authorization": "Bearer s3cret"}
        assert (await c.get("/v1/models", headers=good)).status_code == 200
        r = await c.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers=good)
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200  # open for health checks


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
async def test_api_key_guards_the_api_documents(make_app, path):
    app = make_app(api_key="s3cret")
    async with _client(app) as c:
        r = await c.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await c.get(path, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert (await c.get("/metrics")).status_code == 200  # open for scrapers


async def test_documents_are_open_without_an_api_key(client):
    assert (await client.get("/openapi.json")).status_code == 200
    assert (await client.get("/docs")).status_code == 200


@pytest.mark.parametrize("key", ["", "   ", "\t"])
def test_an_empty_api_key_is_refused(key):
    from pydantic import ValidationError

    from server.auth import ApiKeyMiddleware
    from server.settings import ServerSettings

    with pytest.raises(ValidationError, match="empty or whitespace"):
        ServerSettings(api_key=key)
    with pytest.raises(ValueError, match="empty or whitespace"):
        ApiKeyMiddleware(lambda scope, receive, send: None, key)


async def test_one_log_line_per_request_with_id(client, caplog):
    with caplog.at_level(logging.INFO, logger="mtplx.access"):
        r = await client.post(
            "/v1/chat/completions",
            json=chat_body(max_tokens=3),
            headers={"x-request-id": "req-123"},
        )
        await client.post("/v1/chat/completions", json=chat_body(n=0))
    assert r.headers["x-request-id"] == "req-123"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "mtplx.access"]
    assert len(lines) == 2
    assert "id=req-123" in lines[0] and "status=200" in lines[0]
    assert "completion_tokens=3" in lines[0] and "latency_ms=" in lines[0]
    assert "status=400" in lines[1]


async def test_a_disconnected_stream_is_499_and_its_sent_tokens_count(make_app):
    from tests.fake_engine import FakeEngine
    from tests.server.helpers import ASGICall, wait_until

    app = make_app(FakeEngine(token_delay=0.01))
    call = ASGICall(app, "/v1/chat/completions", chat_body(stream=True, max_tokens=3000))
    assert await call.start() == 200
    received = 0
    async for payload in call.events():
        choices = json.loads(payload)["choices"]
        received += bool(choices and choices[0]["delta"].get("content"))
        if received == 5:
            break
    await call.disconnect()
    await wait_until(lambda: app.state.ctx.bridge.active == 0)
    async with _client(app) as c:
        text = (await c.get("/metrics")).text
    assert 'mtplx_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0' in text
    sent = next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("mtplx_generation_tokens_total")
    )
    assert 5 <= sent < 3000  # what went out before the client left, not nothing, not all


async def test_requests_while_draining_say_shutting_down_not_loading(make_app):
    app = make_app(FakeEngine())
    app.state.ctx.bridge.drain(30).join(5)  # nothing in flight: drained, then stopped
    async with _client(app) as c:
        for path, body in (("/v1/chat/completions", chat_body()), ("/v1/models", None)):
            r = await (c.post(path, json=body) if body else c.get(path))
            assert r.status_code == 503, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == "server_shutting_down", (path, error)
            assert "loading" not in error["message"]
            assert "Retry-After" not in r.headers


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", f"/v1/models/{MODEL}"])
async def test_head_on_get_routes_is_200(client, path):
    r = await client.head(path)
    assert r.status_code == 200
    assert r.headers["content-type"] == (await client.get(path)).headers["content-type"]


async def test_head_is_not_in_the_openapi_schema(client):
    paths = (await client.get("/openapi.json")).json()["paths"]
    assert "head" not in paths["/health"] and "get" in paths["/health"]
