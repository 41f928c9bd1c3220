"""GET /v1/models, /health and /metrics; HEAD on each answers the same status and headers
without the body (the HTTP server drops it)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from starlette.requests import Request

from server.context import get_context
from server.errors import APIError
from server.metrics import CONTENT_TYPE

router = APIRouter()


def _model_card(request: Request) -> dict[str, Any]:
    ctx = get_context(request)
    engine = ctx.engine()
    return {
        "id": ctx.model_id(),
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "mtplx",
        "context_length": engine.context_length,
        "drafters": list(engine.available_drafters),
    }


@router.get("/v1/models")
@router.head("/v1/models", include_in_schema=False)
async def list_models(request: Request) -> dict[str, Any]:
    """The one model this server serves."""
    return {"object": "list", "data": [_model_card(request)]}


@router.get("/v1/models/{model_id:path}")
@router.head("/v1/models/{model_id:path}", include_in_schema=False)
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    """One model card, or 404."""
    card = _model_card(request)
    if model_id not in get_context(request).model_names():
        raise APIError(
            404, f"The model '{model_id}' does not exist", param="model", code="model_not_found"
        )
    return card


def _blas(ctx: Any) -> Any:
    if ctx.blas_info is None:
        return None
    try:
        return ctx.blas_info()
    except Exception as exc:  # a broken probe must not break /health
        return f"unknown ({type(exc).__name__}: {exc})"


@router.get("/health")
@router.head("/health", include_in_schema=False)
async def health(request: Request) -> JSONResponse:
    """200 when serving; 503 while the model loads, after it failed to, or when the engine
    holds rows for no request (it could not admit what it should)."""
    ctx = get_context(request)
    stats = ctx.bridge.stats()
    body: dict[str, Any] = {
        "status": {"ready": "ok", "failed": "error"}.get(stats.state, stats.state),
        "uptime_s": round(time.time() - ctx.started_at, 3),
        "queue": {"depth": stats.queue_depth, "active": stats.active, "max": stats.max_queue},
        "batch": {"running": stats.running, "waiting": stats.queue_depth},
        "requests": {
            "completed": stats.completed,
            "failed": stats.failed,
            "cancelled": stats.cancelled,
        },
        "blas": _blas(ctx),
    }
    orphan_rows = ctx.bridge.orphan_rows
    if stats.state == "ready" and orphan_rows:
        body["status"] = "error"
        body["error"] = f"{orphan_rows} batch rows are held by no request"
    elif stats.state == "ready":
        engine = ctx.bridge.engine
        body.update(
            model=ctx.model_id(),
            drafter=engine.default_drafter,
            depth=engine.default_depth if engine.default_depth is not None else "adaptive",
            available_drafters=list(engine.available_drafters),
            context_length=engine.context_length,
            max_num_seqs=engine.max_num_seqs,
        )
        weights = getattr(getattr(engine, "model", None), "weights", None)
        if isinstance(weights, str):
            body["weights"] = weights
        kv = ctx.bridge.kv
        if kv is not None:
            body["kv"] = {"bytes": kv.bytes, "max_bytes": kv.max_bytes}
        cache = ctx.bridge.prefix_cache
        if cache is not None:
            body["prefix_cache"] = {
                "bytes": cache.num_bytes,
                "max_bytes": cache.max_bytes,
                "blocks": cache.num_blocks,
            }
        return JSONResponse(body)
    if stats.state == "failed":
        body["error"] = str(getattr(ctx.bridge, "failure", None) or ctx.bridge.load_error)
    return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})


@router.get("/metrics")
@router.head("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    return Response(get_context(request).metrics.render(), media_type=CONTENT_TYPE)
