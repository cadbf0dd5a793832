"""The OpenAPI document's extras: the real error envelope, the bearer scheme, the HTTP server's refusals."""

from __future__ import annotations

from apispec import BasePlugin
from flask_smorest import Api

from jobs.settings import Settings
from web.ratelimit import WORK_PATHS
from web.response_schemas import ErrorEnvelopeSchema

SERVER_REFUSALS = {
    "414": "Request line too long (over 4094 bytes): refused by the HTTP server itself, in HTML",
    "431": "Request headers too large: refused by the HTTP server itself, in HTML",
}
"""What gunicorn answers before the app sees a request (its own page, not the JSON envelope)."""


class MlxqApi(Api):
    """flask-smorest's Api documenting mlxq's real error envelope as every operation's error answer."""

    ERROR_SCHEMA = ErrorEnvelopeSchema

    def __init__(self, app, settings: Settings):
        app.config["API_SPEC_OPTIONS"] = spec_options(settings)
        super().__init__(app, spec_kwargs={"extra_plugins": [ServerRefusals(), RateLimited(), AnthropicErrors()]})


def spec_options(settings: Settings) -> dict:
    """Document extras: the bearer scheme, required on every operation when keys are set."""
    options = {
        "info": {"description": "OpenAI-compatible API for MLX models, with a Redis job queue. Every error the "
                                "app answers is the envelope `{\"error\": {message, type, param, code}, "
                                "\"request_id\"}`."},
        "components": {"securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}}},
    }
    if settings.api_keys:
        options["security"] = [{"bearerAuth": []}]
    return options


class ServerRefusals(BasePlugin):
    """Adds to every operation the answers the HTTP server gives on its own (see SERVER_REFUSALS)."""

    def operation_helper(self, path=None, operations=None, **kwargs):
        """Called by apispec for each path."""
        html = {"text/html": {"schema": {"type": "string"}}}
        for operation in (operations or {}).values():
            responses = operation.setdefault("responses", {})
            for status, description in SERVER_REFUSALS.items():
                responses.setdefault(status, {"description": description, "content": html})


class RateLimited(BasePlugin):
    """Documents the 429 of the operations that start work, where a key's limits apply (web/ratelimit.py)."""

    def operation_helper(self, path=None, operations=None, **kwargs):
        """Called by apispec for each path."""
        operation = (operations or {}).get("post")
        if path not in WORK_PATHS or operation is None:
            return
        operation.setdefault("responses", {})["429"] = {
            "description": "The key is over one of its limits (MLXQ_KEY_LIMITS, the admin API): `error.limit` names "
                           "it; requests per minute, requests at once, async jobs queued, tokens or audio seconds "
                           "of the UTC day",
            "headers": {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "integer"}},
                        "x-ratelimit-remaining-requests": {"description": "The minute's requests left",
                                                           "schema": {"type": "string"}}},
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
        }


ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"type": "string", "enum": ["error"]},
                   "error": {"type": "object", "required": ["type", "message"],
                             "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
                   "request_id": {"type": "string", "nullable": True}},
}
"""Anthropic's error shape, which /v1/messages answers with (web/render/anthropic.py)."""


class AnthropicErrors(BasePlugin):
    """Documents /v1/messages's error answers in Anthropic's shape instead of the envelope."""

    def operation_helper(self, path=None, operations=None, **kwargs):
        """Called by apispec for each path."""
        if not (path or "").startswith("/v1/messages"):
            return
        for operation in (operations or {}).values():
            responses = operation.get("responses", {})
            for status in list(responses):
                if not str(status).startswith("2") and str(status) not in SERVER_REFUSALS:
                    responses[status] = {"description": "An error, in Anthropic's shape",
                                         "content": {"application/json": {"schema": ANTHROPIC_ERROR}}}

