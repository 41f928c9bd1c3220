"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right
HTTP status, and the handlers that turn every failure path into one."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

__all__ = [
    "APIError",
    "error_body",
    "from_validation_error",
    "from_value_error",
    "install_error_handlers",
]

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """An error the client sees as OpenAI error JSON with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        """The JSON response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for a status."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Pydantic inserts union-member and validator tags into error locations; they are not fields.
_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|literal|function)\b|[\[\-]|^\w+\[")


# Where FastAPI found a value; not part of the field's name.
_SOURCES = ("body", "query", "path", "header", "cookie")


def _field_loc(error: Mapping[str, Any]) -> list[Any]:
    loc = list(error.get("loc", ()))
    return loc[1:] if loc and loc[0] in _SOURCES else loc


def _param(loc: Sequence[Any]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif (item in _SOURCES and not parts) or (isinstance(item, str) and _TAG.search(item)):
            continue
        else:
            parts.append(f".{item}" if parts else str(item))
    return "".join(parts) or None


def _union_members(errors: Sequence[Mapping[str, Any]], prefix_len: int) -> list[str]:
    """Union member tags found right after the failing field, in order, deduplicated."""
    members: list[str] = []
    for error in errors:
        loc = _field_loc(error)
        if (
            len(loc) > prefix_len
            and isinstance(loc[prefix_len], str)
            and _TAG.search(loc[prefix_len])
        ):
            tag = loc[prefix_len].replace("constrained-int", "token id")
            if tag not in members:
                members.append(tag)
    return members


def from_validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """400 for the first pydantic error, naming the field (``messages[0].role``).

    A union field (``prompt: str | list[str] | ...``) reports one error per member; those
    become one message listing the accepted forms."""
    error = errors[0]
    loc = _field_loc(error)
    param = _param(loc)
    kind = error.get("type", "")
    if kind == "json_invalid":
        return APIError(
            400, "We could not parse the JSON body of your request.", code="invalid_json"
        )
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if kind == "missing":
        return APIError(
            400,
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    prefix_len = next(
        (i for i, item in enumerate(loc) if isinstance(item, str) and _TAG.search(item)), None
    )
    if prefix_len is not None and len(errors) > 1:
        members = _union_members(errors, prefix_len)
        message = f"expected one of: {', '.join(members)}"
    else:
        message = str(error.get("msg", "invalid value"))
    return APIError(
        400, f"Invalid value for '{param}': {message}", param=param, code="invalid_value"
    )


def from_value_error(exc: ValueError, aliases: Mapping[str, str] | None = None) -> APIError:
    """400 for a ValueError from SamplerConfig / GenerationRequest / engine.validate, whose
    message starts with the field name; ``aliases`` maps engine names to API names."""
    message = str(exc)
    match = re.match(r"[A-Za-z_]+", message)
    field = match.group(0) if match else None
    param = (aliases or {}).get(field or "", field)
    if "context length" in message or "context window" in message:
        return APIError(400, message, param=param, code="context_length_exceeded")
    return APIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception path to OpenAI error JSON (never FastAPI's 422 shape)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc.errors()).response()

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
            return APIError(404, message, code="unknown_url").response()
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
            return APIError(405, message, code="method_not_allowed").response()
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, "The server had an error while processing your request.").response()
