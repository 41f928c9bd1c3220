"""Structured output: OpenAI's ``response_format`` and the ``mtplx`` grammar extension,
turned into the engine's GrammarSpec (the engine masks sampling with it).

- ``{"type": "text"}`` (or absent): no constraint.
- ``{"type": "json_object"}``: any JSON object.
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``:
  JSON valid under ``schema`` (the constraint is always enforced). With ``strict`` an object
  has only the properties its schema declares unless the schema allows more
  (``declared_properties_only``), as OpenAI's strict mode reads a schema.
- ``"mtplx": {"regex": "..."}`` or ``{"grammar": "<Lark>"}``: llguidance's regex / Lark.

JSON is generated without free-form whitespace (``{"a": 1, "b": [2, 3]}`` style), so a small
model cannot wander into endless newlines inside an object.
"""

from __future__ import annotations

import json
from typing import Any

from mtplx.grammar import GrammarSpec
from server.errors import APIError

__all__ = ["JSON_OPTIONS", "declared_properties_only", "grammar_for", "json_schema_spec"]

# llguidance's JSON options, in the schema's "x-guidance" key (a schema's own wins).
JSON_OPTIONS = {"whitespace_flexible": False}


def _bad(message: str, param: str = "response_format") -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """GrammarSpec of a JSON schema (a dict or a boolean), with MTPLX's JSON options."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise _bad(f"the JSON schema must be an object, got {type(schema).__name__}", param)
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise _bad(f"the schema's 'x-guidance' must be an object, got {type(own).__name__}", param)
    options = {**JSON_OPTIONS, **own}
    return GrammarSpec.json_schema({**schema, "x-guidance": options}, param=param)


# Keywords whose values are schemas, or maps / lists of schemas.
_SCHEMA_VALUES = ("items", "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")


def declared_properties_only(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that declares
    ``properties`` and says nothing of others (no ``additionalProperties``,
    ``patternProperties`` or ``unevaluatedProperties``): JSON Schema's default admits any
    other key, which lets a small model write keys no one asked for. Recurses through
    nested schemas, ``$defs`` included; returns a new schema."""
    if isinstance(schema, list):
        return [declared_properties_only(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_VALUES:
        if isinstance(out.get(key), (dict, list)):
            out[key] = declared_properties_only(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: declared_properties_only(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = declared_properties_only(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = declared_properties_only(out["additionalProperties"])
    says_more = {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out)
    if isinstance(out.get("properties"), dict) and not says_more:
        out["additionalProperties"] = False
    return out


def _response_format(value: Any) -> GrammarSpec | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format must be an object with a 'type'")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise _bad(f"response_format has unknown fields: {sorted(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_spec({"type": "object"}, "response_format")
    if kind != "json_schema":
        raise _bad(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema is required", "response_format.json_schema")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise _bad(f"unknown fields {sorted(unknown)}", "response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise _bad("json_schema.name is required", "response_format.json_schema.name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _bad("json_schema.strict must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema", {})
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise _bad(f"schema is not JSON: {exc}", "response_format.json_schema.schema") from exc
    if spec.get("strict"):
        schema = declared_properties_only(schema)
    return json_schema_spec(schema, "response_format.json_schema.schema")


def grammar_for(response_format: Any, regex: str | None, grammar: str | None) -> GrammarSpec | None:
    """The request's constraint (at most one of the three), not yet validated: the engine's
    GenerationRequest validates it and names the field."""
    chosen = [
        name
        for name, value in (
            ("response_format", response_format),
            ("regex", regex),
            ("grammar", grammar),
        )
        if value is not None and value != {"type": "text"}
    ]
    if len(chosen) > 1:
        raise _bad(f"send one constraint, not {' and '.join(chosen)}", chosen[1])
    if regex is not None:
        return GrammarSpec("regex", regex, param="mtplx.regex")
    if grammar is not None:
        return GrammarSpec("lark", grammar, param="mtplx.grammar")
    if response_format is None:
        return None
    return _response_format(response_format)
