"""`response_format`: JSON mode and JSON schemas, compiled to an llguidance grammar and checked here,
before anything is queued; the worker enforces the grammar while decoding (workers/backends/grammar.py).

llguidance is a grammar engine (Rust, no MLX): the web tier uses it only to compile and validate.
"""

from __future__ import annotations

import functools
import json

from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper
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
    check_options(schema, PARAM)
    return schema


def check_options(schema: dict, param: str) -> None:
    """A schema's own llguidance options ("x-guidance") must be an object (llguidance checks its keys)."""
    options = schema.get("x-guidance")
    if options is not None and not isinstance(options, dict):
        raise APIError(400, "'x-guidance' (llguidance's options for this schema) must be an object, such as "
                            "{\"whitespace_flexible\": true}.", "invalid_value", f"{param}.x-guidance")


def options_of(schema: dict) -> dict:
    """The llguidance options a schema is compiled with: mlxq's defaults, then the schema's own."""
    return {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}


def unenforceable(grammar: str) -> str | None:
    """Why llguidance cannot hold an answer to `grammar`, or None when it can.

    Besides compiling it, the grammar is started on a tokenizer of single bytes, as the worker will
    start it on the model's: a schema no value satisfies (`{"$ref": "#"}`, a `$ref` loop) allows
    nothing at all, and one whose required properties recurse forces an endless prefix. Both would
    only fail in the worker, mid-answer; here they cost a millisecond."""
    error = LLMatcher.validate_grammar(grammar)
    if error:
        return error.strip()
    matcher = LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    forced = matcher.compute_ff_bytes()
    if not matcher.is_error():
        matcher.consume_tokens(list(forced))
        matcher.compute_bitmask()
    if not matcher.is_error():
        return None
    reason = matcher.get_error().strip().splitlines()[0]
    if reason == "NoExtensionBias":
        return "no JSON value satisfies it (does a $ref refer to itself?)"
    if "Too many items" in reason:
        return "it never ends (a required property that contains itself?)"
    return reason


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes, plus an end-of-sequence token (for `unenforceable`)."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]

    def __call__(self, text) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> LLTokenizer:
    """llguidance's tokenizer over single bytes (built once)."""
    return LLTokenizer(TokenizerWrapper(_Bytes()))


def grammar_for(response_format: dict | None) -> str | None:
    """The llguidance grammar a response_format asks for (None: free text); 400 naming what is wrong."""
    schema = answer_schema(response_format)
    if schema is None:
        return None
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise APIError(400, f"Invalid JSON schema: {exc}", "invalid_value", PARAM) from None
    error = unenforceable(grammar)
    if error:
        raise APIError(400, f"The JSON schema cannot be enforced: {error}", "unsupported_schema", PARAM)
    return grammar
