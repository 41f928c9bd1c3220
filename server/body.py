"""Reading a JSON request body into a pydantic model, refusing everything the model itself
cannot: a content type other than JSON (415: a page's cross-site ``text/plain`` POST needs
no CORS preflight), nesting deep enough to exhaust the parser's recursion, and strings that
cannot be encoded as UTF-8 (lone surrogates, which JSON's ``\\ud800`` escape allows).

Parsing and validating run in a worker thread: a body near the size limit takes long
enough to decode that doing it on the event loop would stall every other request.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from server.errors import APIError, field_path, from_validation_error

__all__ = [
    "MAX_JSON_DEPTH",
    "check_json_values",
    "decode_json",
    "parse_json_body",
    "validate_part",
]

M = TypeVar("M", bound=BaseModel)

# No request needs more than a handful of levels (chat content parts are 4 deep).
MAX_JSON_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")


def _bad_string(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _has_problem(data: Any, max_depth: int, max_len: int | None = None) -> bool:
    """Whether ``check_json_values`` would raise: the same walk without building the path
    of every value (a body of a million short strings takes a fraction of the time)."""
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth or (depth == max_depth and isinstance(value, dict | list) and value):
            return True  # the value, or its items, are nested too deep
        if max_len is not None and isinstance(value, dict | list) and len(value) > max_len:
            return True  # before its items are walked
        if isinstance(value, dict):
            for key, item in value.items():
                if _bad_string(key):
                    return True
                if isinstance(item, str):
                    if _bad_string(item):
                        return True
                elif isinstance(item, dict | list):
                    stack.append((item, depth + 1))
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, str):
                    if _bad_string(item):
                        return True
                elif isinstance(item, dict | list):
                    stack.append((item, depth + 1))
        elif isinstance(value, str) and _bad_string(value):
            return True
    return False


def check_json_values(
    data: Any, max_depth: int = MAX_JSON_DEPTH, max_len: int | None = None
) -> None:
    """Raise a 400 APIError for nesting deeper than ``max_depth`` or a string (value or
    key) holding a lone surrogate, naming where. Iterative: depth costs no recursion. A
    quick walk first; the one that tracks where each value is runs only when it finds
    something. ``max_len``: the most items any array or object may hold (None: any),
    checked before its items are walked."""
    if _has_problem(data, max_depth, max_len):
        _locate_problem(data, max_depth, max_len)


def _locate_problem(data: Any, max_depth: int, max_len: int | None = None) -> None:
    """The APIError naming the first problem ``_has_problem`` found."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if max_len is not None and isinstance(value, dict | list) and len(value) > max_len:
            kind = "array" if isinstance(value, list) else "object"
            raise APIError(
                400,
                f"Invalid '{field_path(path)}': {kind} too long. Expected at most {max_len} "
                f"items, but got {len(value)} instead.",
                param=field_path(path),
                code=f"{kind}_above_max_length",
            )
        if len(path) > max_depth:
            raise APIError(
                400,
                f"The JSON body is nested more than {max_depth} levels deep.",
                param=field_path(path[:1]),
                code="invalid_json",
            )
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise APIError(
                    400,
                    f"Invalid value for '{field_path(path)}': the string contains a lone UTF-16 "
                    "surrogate (\\ud800-\\udfff), which is not a character",
                    param=field_path(path),
                    code="invalid_value",
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii() and _SURROGATE.search(key):
                    where = field_path(path)
                    place = f"in '{where}'" if where else "at the top level of the body"
                    raise APIError(
                        400,
                        f"Invalid key {json.dumps(key)} {place}: it contains a lone UTF-16 "
                        "surrogate (\\ud800-\\udfff), which is not a character",
                        param=where,
                        code="invalid_value",
                    )
                stack.append((item, (*path, key)))
        elif isinstance(value, list):
            stack.extend((item, (*path, i)) for i, item in enumerate(value))


def decode_json(
    raw: bytes,
    model: type[M],
    max_items: Mapping[str, int] | None = None,
    max_len: int | None = None,
) -> M:
    """``raw`` parsed, checked and validated as ``model``; 400 APIErrors otherwise.
    ``max_items``: the most items a top-level list field may hold; ``max_len``: the most
    any array or object in the body may hold. Both are checked before validation, which
    holds the GIL (every other request waits) for seconds on a list of 400k items."""
    try:
        data = json.loads(raw)
    except RecursionError as exc:  # the C parser recurses once per nesting level
        raise APIError(
            400,
            f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.",
            code="invalid_json",
        ) from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(
            400, "We could not parse the JSON body of your request.", code="invalid_json"
        ) from exc
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    for name, limit in (max_items or {}).items():
        value = data.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise APIError(
                400,
                f"Invalid '{name}': array too long. Expected an array with maximum length "
                f"{limit} (the model's context in tokens), but got an array with length "
                f"{len(value)} instead.",
                param=name,
                code="array_above_max_length",
            )
    check_json_values(data, max_len=max_len)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc.errors(), data) from exc


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json"


async def parse_json_body(
    request: Request,
    model: type[M],
    max_items: Mapping[str, int] | None = None,
    max_len: int | None = None,
) -> M:
    """The body validated as ``model``: 415 unless it is sent as ``application/json``, 400
    (never 422) for malformed JSON or values, or lists longer than ``max_items`` and
    ``max_len`` allow (``decode_json``)."""
    content_type = request.headers.get("content-type", "")
    if not _is_json(content_type):
        raise APIError(
            415,
            "Unsupported Content-Type "
            f"{content_type[:100]!r}: send the body as 'application/json'.",
            code="unsupported_media_type",
        )
    raw = await request.body()
    return await run_in_threadpool(decode_json, raw, model, max_items, max_len)


def validate_part(model: type[M], value: Any, path: tuple[str | int, ...]) -> M:
    """``value``, the part of a request at ``path`` (``("tools", 0)``), validated as
    ``model``: a 400 naming the field under ``path`` otherwise. For parts whose shape
    depends on a ``type`` the route reads first (a tool, a content block, an input item),
    so a type MTPLX does not implement gets a message saying so, not a schema error."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**e, "loc": (*path, *e.get("loc", ()))} for e in exc.errors()]
        data = value  # the request around the part, as far as the error's location needs
        for part in reversed(path):
            data = [None] * part + [data] if isinstance(part, int) else {part: data}
        raise from_validation_error(errors, data) from exc
