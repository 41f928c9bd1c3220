"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right
HTTP status, and the handlers that turn every failure path into one.

Under ``/v1/messages`` (the Anthropic Messages API) the same errors take Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``: clients of that API read that shape.
Every error response is built by ``APIError.response(path)``, so the shape follows the path
whichever layer (middleware, route, handler) refused the request."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mtplx.errors import InvalidParameter
from server.request_log import printable

__all__ = [
    "ANTHROPIC_PREFIX",
    "APIError",
    "anthropic_error_body",
    "error_body",
    "field_path",
    "from_validation_error",
    "from_value_error",
    "install_error_handlers",
    "is_anthropic_path",
]

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # loading or shutting down: try again later
    504: "timeout_error",
    529: "overloaded_error",
}

ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` belongs to the Anthropic Messages API (its errors take its shape)."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


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

    def anthropic_body(self) -> dict[str, Any]:
        """The JSON body in Anthropic's shape."""
        return anthropic_error_body(self.status, self.message)

    def response(self, path: str = "") -> JSONResponse:
        """The JSON response, in the shape of the API ``path`` belongs to."""
        body = self.anthropic_body() if is_anthropic_path(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """``{"error": {...}}`` for a status."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` for a status."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# Where FastAPI found a value (first in its error locations); not part of the field's name.
_SOURCES = ("body", "query", "path", "header", "cookie")

# Without the input at hand, union-member and validator tags in a location are told from
# field names by their look (``str``, ``list[str]``, ``function-after[...]``).
_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|literal|function)\b|[\[\-]|^\w+\[")

# The dict-key marker pydantic appends when a key (not its value) is invalid.
_KEY = "[key]"

# Plain ValueErrors (not InvalidParameter) still come from engines that do not raise the
# typed error; their message starts with one of these field names.
_UNTYPED_FIELDS = frozenset({"prompt", "prompt_ids", "drafter", "logit_bias", "stop_token_ids"})


@dataclass(frozen=True)
class _Location:
    """Where a pydantic error points: the field (``messages[0].content``), and, for a
    union, the field the union is declared on and the member that failed."""

    param: str | None
    union_param: str | None = None
    member: str | None = None
    bad_key: str | None = None


def field_path(parts: Sequence[str | int]) -> str | None:
    """``("messages", 0, "content")`` -> ``messages[0].content``; None when empty."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text or None


def _locate(error: Mapping[str, Any], data: Any) -> _Location:
    """Follow the error's ``loc`` through the request's own data: an item that is a key of
    the current object (or an index of the current list) is part of the field's name;
    anything else is a union-member or validator tag pydantic inserted. Without the data,
    tags are recognised by their look."""
    loc = list(error.get("loc", ()))
    bad_key = None
    if _KEY in loc:  # (..., "logit_bias", "²", "[key]"): the dict is the field, "²" the key
        at = loc.index(_KEY)
        bad_key = str(loc[at - 1]) if at > 0 else None
        loc = loc[: max(at - 1, 0)]
    missing = error.get("type") == "missing"
    parts: list[str | int] = []
    union_param, member = None, None
    node, known = data, data is not None
    for i, item in enumerate(loc):
        if known:
            if isinstance(node, dict) and isinstance(item, str) and item in node:
                parts.append(item)
                node = node[item]
                continue
            if isinstance(node, list) and isinstance(item, int) and 0 <= item < len(node):
                parts.append(item)
                node = node[item]
                continue
            is_field = missing and i == len(loc) - 1  # a missing field is not in the data
        else:
            is_field = isinstance(item, int) or not _TAG.search(str(item))
        if is_field:
            parts.append(item)
        elif member is None:
            union_param, member = field_path(parts), str(item)
    return _Location(field_path(parts), union_param, member, bad_key)


def from_validation_error(errors: Sequence[Mapping[str, Any]], data: Any = None) -> APIError:
    """400 for the first pydantic error, naming the field (``messages[0].role``).

    ``data`` is the validated input (the parsed JSON body); it tells field names from the
    tags pydantic puts in error locations. A union field (``prompt: str | list[str] |
    ...``) reports one error per member; those become one message listing the accepted
    forms."""
    error = errors[0]
    where = _locate(error, data)
    param = where.param
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
    if where.bad_key is not None:
        message = f"invalid key {where.bad_key!r}: {error.get('msg', 'invalid key')}"
    elif where.member is not None and len(errors) > 1:
        members: list[str] = []
        for other in errors:
            other_where = _locate(other, data)
            if other_where.union_param == where.union_param and other_where.member:
                tag = other_where.member.replace("constrained-int", "token id")
                if tag not in members:
                    members.append(tag)
        message = f"expected one of: {', '.join(members)}"
    elif kind == "value_error" and "error" in error.get("ctx", {}):
        message = str(error["ctx"]["error"])  # a validator's own words, without pydantic's tag
    else:
        message = str(error.get("msg", "invalid value"))
    return APIError(
        400, f"Invalid value for '{param}': {message}", param=param, code="invalid_value"
    )


def from_value_error(exc: ValueError, aliases: Mapping[str, str] | None = None) -> APIError:
    """400 for a ValueError from SamplerConfig / GenerationRequest / engine.validate.

    An ``InvalidParameter`` names its field and code; ``aliases`` maps engine field names
    to API names (``prompt_ids`` -> ``messages``). A plain ValueError (an engine that does
    not raise the typed error yet) is attributed to a field only when its message starts
    with a known engine field name."""
    message = str(exc)
    if isinstance(exc, InvalidParameter):
        field: str | None = exc.param
        code = exc.code
    else:
        match = re.match(r"[A-Za-z_]+", message)
        field = match.group(0) if match and match.group(0) in _UNTYPED_FIELDS else None
        context = "context length" in message or "context window" in message
        code = "context_length_exceeded" if context else "invalid_value"
    param = (aliases or {}).get(field, field) if field else None
    return APIError(400, message, param=param, code=code)


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception path to OpenAI error JSON (never FastAPI's 422 shape)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's locations start with where the value was: ("query", "n").
        errors = list(exc.errors())
        loc = tuple(errors[0].get("loc") or ()) if errors else ()
        source = loc[0] if loc and loc[0] in _SOURCES else None
        inputs = {
            "body": exc.body,
            "query": dict(request.query_params),
            "path": dict(request.path_params),
            "header": dict(request.headers),
            "cookie": dict(request.cookies),
        }
        if source is not None:
            errors = [
                {**e, "loc": tuple(e.get("loc", ()))[1:]}
                if tuple(e.get("loc", ()))[:1] == (source,)
                else e
                for e in errors
            ]
        return from_validation_error(errors, inputs.get(source or "")).response(request.url.path)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc.errors()).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Unknown request URL: {request.method} {request.url.path}"
            return APIError(404, message, code="unknown_url").response(request.url.path)
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed for {request.url.path}"
            # Starlette's 405 carries the Allow header (RFC 9110 requires it).
            error = APIError(405, message, code="method_not_allowed", headers=exc.headers)
            return error.response(request.url.path)
        error = APIError(exc.status_code, str(exc.detail), headers=exc.headers)
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception(
            "unhandled error on %s %s", printable(request.method), printable(request.url.path)
        )
        error = APIError(500, "The server had an error while processing your request.")
        return error.response(request.url.path)
