"""The prefix cache seen over HTTP: ``usage.prompt_tokens_details.cached_tokens``, the
prefix-cache metrics and /health, around the real engine on the tiny fixture."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.anyio

MODEL = "tiny"
SYSTEM = "You answer in one short sentence, politely and without any preamble. " * 4


@pytest.fixture(scope="module")
def cached_engine(tiny_checkpoint: Any) -> Any:
    from mtplx.engine import Engine
    from mtplx.models import load

    return Engine(load(tiny_checkpoint), prefix_cache_bytes=64 << 20)


@pytest.fixture
async def client(make_app: Any, cached_engine: Any) -> Any:
    app = make_app(cached_engine, served_model_name=MODEL)
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://localhost") as c,
    ):
        yield c


def _chat(question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }


async def test_a_shared_system_prompt_is_served_from_the_cache(client: httpx.AsyncClient) -> None:
    first = (await client.post("/v1/chat/completions", json=_chat("Hello?"))).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = (await client.post("/v1/chat/completions", json=_chat("Why?"))).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"]
    again = (await client.post("/v1/chat/completions", json=_chat("Hello?"))).json()
    assert again["choices"][0]["message"] == first["choices"][0]["message"]

    metrics = (await client.get("/metrics")).text
    assert "mtplx_prefix_cache_hits_total 2.0" in metrics
    assert "mtplx_prefix_cache_misses_total 1.0" in metrics
    assert "mtplx_prefix_cache_max_bytes 6.7108864e+07" in metrics
    health = (await client.get("/health")).json()
    assert health["prefix_cache"]["max_bytes"] == 64 << 20
    assert 0 < health["prefix_cache"]["bytes"] <= 64 << 20
