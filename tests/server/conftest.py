"""Fixtures for in-process server tests: an app around the fake engine with its bridge
running, and an httpx client on ASGITransport; a tiny real checkpoint (llama + MTP head,
untied LM head so its output varies) and the real engine on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from server.app import create_app
from server.engine_bridge import EngineBridge
from server.settings import ServerSettings
from tests.fake_engine import FakeEngine
from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.variants import untie_lm_head


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def make_app() -> Any:
    """``make_app(engine=None, **settings) -> FastAPI`` with the bridge started (the
    ASGI transport does not run the lifespan)."""
    bridges: list[EngineBridge] = []

    def factory(engine: Any = None, **settings: Any) -> FastAPI:
        app = create_app(engine if engine is not None else FakeEngine(), ServerSettings(**settings))
        bridge = app.state.ctx.bridge
        bridge.start()
        bridge.wait_ready(5)
        bridges.append(bridge)
        return app

    yield factory
    for bridge in bridges:
        bridge.stop()


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(make_app: Any, engine: FakeEngine) -> FastAPI:
    return make_app(engine)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
        yield c


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint with an MTP head and an untied LM head (read-only)."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    return untie_lm_head(build_checkpoint("llama_mtp", directory))


@pytest.fixture(scope="session")
def real_engine(tiny_checkpoint: Path) -> Any:
    """The real engine on ``tiny_checkpoint`` with every drafter (a 1-layer layer-skip draft
    model). Shared by the tests: only one bridge thread uses it at a time."""
    from mtplx.engine import Engine
    from mtplx.models import load, make_layer_skip_draft

    model = load(tiny_checkpoint)
    return Engine(model, draft_model=make_layer_skip_draft(model, 1))
