"""The FastAPI application factory.

``create_app(engine_or_bridge, settings)`` wires the routes, the error handlers, the
OpenAPI request bodies and the ASGI middleware: trailing slashes dropped outermost, then the
request log, the Host check, CORS (when origins are allowed), the API key, and the body
limit. The engine is plugged in through a ``EngineBridge``: pass one (``EngineBridge(factory)``
loads the model on the engine thread while /health answers 503), or pass an engine and one
is made around it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

from server.anthropic_api import CountTokensRequest, MessagesRequest
from server.auth import ApiKeyMiddleware
from server.context import AppContext
from server.cross_site import HostCheckMiddleware, allowed_host_names
from server.engine_bridge import EngineBridge, EngineLike
from server.errors import install_error_handlers
from server.limits import BodyLimitMiddleware
from server.metrics import ServerMetrics
from server.openapi import document_request_bodies
from server.paths import TrailingSlashMiddleware
from server.request_log import RequestLogMiddleware
from server.responses_api import ResponsesRequest
from server.routes import chat, completions, messages, page, responses, system, tokenize
from server.schemas import ChatCompletionRequest, CompletionRequest
from server.settings import ServerSettings

__all__ = ["create_app"]


def create_app(
    engine: EngineLike | EngineBridge,
    settings: ServerSettings | None = None,
    *,
    blas_info: Callable[[], Any] | None = None,
) -> FastAPI:
    """Build the app. The bridge starts with the app (lifespan) and stops with it.

    ``blas_info`` is asked on each /health for a description of the BLAS in use.
    """
    settings = settings or ServerSettings()
    bridge = (
        engine
        if isinstance(engine, EngineBridge)
        else EngineBridge.from_engine(
            engine, max_queue=settings.max_queue, request_timeout=settings.request_timeout
        )
    )
    metrics = ServerMetrics(
        queue_depth=lambda: bridge.queue_depth,
        active=lambda: bridge.active,
        running_sequences=lambda: bridge.running,
        slow_readers=lambda: bridge.slow_readers,
        prefix_cache=lambda: bridge.prefix_cache,
        kv=lambda: bridge.kv,
    )
    bridge.step_observer = metrics.observe_step

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        bridge.start()
        try:
            yield
        finally:
            # Joining the engine thread blocks; keep the loop free for closing connections.
            await asyncio.to_thread(bridge.stop)

    app = FastAPI(title="MTPLX", version="0.1.0", lifespan=lifespan)
    app.state.ctx = AppContext(
        bridge=bridge, settings=settings, metrics=metrics, blas_info=blas_info
    )
    install_error_handlers(app)
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(messages.router)
    app.include_router(responses.router)
    app.include_router(system.router)
    app.include_router(tokenize.router)
    app.include_router(page.router)
    document_request_bodies(
        app,
        {
            ("post", "/v1/chat/completions"): ChatCompletionRequest,
            ("post", "/v1/completions"): CompletionRequest,
            ("post", "/v1/messages"): MessagesRequest,
            ("post", "/v1/messages/count_tokens"): CountTokensRequest,
            ("post", "/v1/responses"): ResponsesRequest,
        },
    )
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    if settings.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key.get_secret_value())
    if settings.allowed_origins:
        # Outside the API key: a browser's preflight carries no Authorization header.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=["*"] if "*" in settings.allowed_origins else settings.allowed_origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["*"],
            expose_headers=["x-request-id", "retry-after"],
        )
    allowed_hosts = allowed_host_names(settings)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)
    app.add_middleware(RequestLogMiddleware, metrics=metrics)
    app.add_middleware(TrailingSlashMiddleware)
    return app
