"""Every failure answered in its API's error envelope (OpenAI's `{"error": {message, type, param, code},
"request_id"}`, Anthropic's on /v1/messages: web/render/errors.py chooses); never a traceback."""

from __future__ import annotations

import logging

import redis
from flask import Flask, g, jsonify, request
from werkzeug.exceptions import HTTPException

from jobs.queues import QueueFull
from web.render.errors import error_body

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error answered with the envelope: raise it from any view."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}
        self.extra = extra


def error_response(status: int, message: str, code=None, param=None, headers=None, **extra):
    """A JSON error response in the envelope of the API called (web/render/errors.py), with `headers`."""
    error = {"message": message, "code": code, "param": param, **extra}
    response = jsonify(error_body(request.path, status, error, getattr(g, "request_id", None)))
    response.status_code = status
    for name, value in (headers or {}).items():
        response.headers[name] = value
    return response


_LOCATIONS = frozenset({"json", "form", "files", "multipart", "query", "headers", "view_args", "cookies", "_schema"})
"""webargs' top-level keys: where the field was, not part of its name."""


def _first_field_error(messages, prefix: str = "") -> tuple[str, str]:
    """Flatten marshmallow's nested messages to (dotted field name, first message)."""
    if isinstance(messages, dict):
        for key, value in messages.items():
            if key in _LOCATIONS and not prefix:
                return _first_field_error(value, "")
            name = f"{prefix}.{key}" if prefix else str(key)
            return _first_field_error(value, name)
    if isinstance(messages, list) and messages:
        first = messages[0]
        if isinstance(first, (dict, list)):
            return _first_field_error(first, prefix)
        return prefix, str(first)
    return prefix, str(messages)


def _is_unparsable_json(messages) -> bool:
    """webargs' answer to a body that is not JSON at all: {"json": ["Invalid JSON body."]}."""
    return isinstance(messages, dict) and list(messages) == ["json"] and isinstance(messages["json"], list)


def _too_large():
    """The 413 answer, naming the limit that was actually passed: the body's size or its form parts."""
    limit = request.max_content_length
    if request.content_length is not None and limit is not None and request.content_length <= limit:
        # Under the size limit: werkzeug refused the multipart form's parts (count or field memory).
        parts, memory = request.max_form_parts, request.max_form_memory_size
        return error_response(413, f"The form has too many parts or too large a text field (limits: {parts} "
                                   f"parts, {memory} bytes of non-file fields).", "form_too_large")
    return error_response(413, f"Request body too large (limit {limit} bytes).", "request_too_large")


def register_error_handlers(app: Flask) -> None:
    """Turn every exception into the envelope; never leak a traceback."""

    @app.errorhandler(APIError)
    def _api_error(exc: APIError):
        return error_response(exc.status, exc.message, exc.code, exc.param, exc.headers, **exc.extra)

    @app.errorhandler(QueueFull)
    def _queue_full(exc: QueueFull):
        return error_response(503, f"The server is busy: {exc}. Retry later.", "queue_full",
                              headers={"Retry-After": "5"})

    @app.errorhandler(redis.RedisError)
    def _redis_down(exc: redis.RedisError):
        log.warning("redis unavailable: %s", exc)
        return error_response(503, "The queue (Redis) is unreachable. Retry later.", "queue_unavailable",
                              headers={"Retry-After": "5"})

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException):
        messages = (getattr(exc, "data", None) or {}).get("messages")
        if messages and exc.code in (400, 422):  # webargs/flask-smorest validation: 400 naming the field
            if _is_unparsable_json(messages):
                return error_response(400, "Malformed request body: expected a JSON object.", "invalid_json")
            field, message = _first_field_error(messages)
            text = f"Invalid value for '{field}': {message}" if field else message
            return error_response(400, text, "invalid_value", field or None)
        if exc.code == 413:
            return _too_large()
        if exc.code == 400 and request.mimetype == "application/json":
            return error_response(400, "Malformed request body: expected a JSON object.", "invalid_json")
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}  # e.g. 405's Allow
        return error_response(exc.code or 500, exc.description or exc.name, exc.name.lower().replace(" ", "_"),
                              headers=headers)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error")
        return error_response(500, "Internal server error.", "internal_error")
