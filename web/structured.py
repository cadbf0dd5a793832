"""`response_format`: JSON mode and JSON schemas, compiled to an llguidance grammar and checked here,
before anything is queued; the worker enforces the grammar while decoding (workers/backends/grammar.py).

llguidance is a grammar engine (Rust, no MLX): the web tier uses it only to compile and validate.
"""

from __future__ import annotations

import json

from llguidance import LLMatcher
from marshmallow import Schema, fields, validate

from web.errors import APIError

MAX_SCHEMA_BYTES = 64 * 1024
"""The largest JSON schema accepted (as JSON text)."""

JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON, as OpenAI's structured outputs write it: no run of whitespace for a model to get lost
in. A schema's own "x-guidance" options come after these."""

PARAM = "response_format.json_schema.schema"


class JsonSchemaFormatSchema(Schema):
    """response_format.json_schema (OpenAI's shape)."""

    name = fields.String(required=True, validate=validate.Regexp(r"^[A-Za-z0-9_-]{1,64}$"))
    description = fields.String(load_default=None, allow_none=True)
    schema = fields.Dict(load_default=None, allow_none=True)
    strict = fields.Boolean(load_default=None, allow_none=True)


class ResponseFormatSchema(Schema):
    """response_format: text, json_object or json_schema."""

    type = fields.String(required=True, validate=validate.OneOf(["text", "json_object", "json_schema"]))
    json_schema = fields.Nested(JsonSchemaFormatSchema, load_default=None, allow_none=True)


def answer_schema(response_format: dict | None) -> dict | None:
    """The JSON schema a response_format holds answers to (None: free text); 400 naming what is wrong."""
    kind = (response_format or {}).get("type") or "text"
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not spec:
        raise APIError(400, "response_format of type 'json_schema' needs a 'json_schema' object.",
                       "invalid_value", "response_format.json_schema")
    schema = spec.get("schema") or {}  # OpenAI: no schema means any JSON value
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise APIError(400, f"The JSON schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB.", "invalid_value",
                       PARAM)
    return schema


def grammar_for(response_format: dict | None) -> str | None:
    """The llguidance grammar a response_format asks for (None: free text); 400 naming what is wrong."""
    schema = answer_schema(response_format)
    if schema is None:
        return None
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise APIError(400, f"Invalid JSON schema: {exc}", "invalid_value", PARAM) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"The JSON schema cannot be enforced: {error}", "unsupported_schema", PARAM)
    return grammar
