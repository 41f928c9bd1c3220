"""The OpenAPI document, with the request bodies the routes really take.

The generation routes read their body by hand (``server.body``: content type, depth and
surrogate checks, our own 400s), so FastAPI cannot see their pydantic models; this adds
each model's JSON schema as the route's ``requestBody`` and its nested models under
``components/schemas``, so schema-driven clients see the real request shape.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

__all__ = ["document_request_bodies"]

_REF = "#/components/schemas/{model}"


def document_request_bodies(
    app: FastAPI, bodies: Mapping[tuple[str, str], type[BaseModel]]
) -> Callable[[], dict[str, Any]]:
    """Make ``app.openapi`` declare ``bodies`` (``(method, path) -> model``) as JSON request
    bodies; returns the new ``app.openapi``."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        document = get_openapi(
            title=app.title,
            version=app.version,
            openapi_version=app.openapi_version,
            description=app.description,
            routes=app.routes,
        )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for (method, path), model in bodies.items():
            schema = model.model_json_schema(ref_template=_REF)
            for name, definition in schema.pop("$defs", {}).items():
                schemas.setdefault(name, definition)
            schemas[model.__name__] = schema
            operation = document["paths"][path][method.lower()]
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
        app.openapi_schema = document
        return document

    app.openapi = openapi  # type: ignore[method-assign]
    return openapi
