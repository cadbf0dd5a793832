"""Which API's error envelope a request is answered in: the one place that chooses it.

Errors on /v1/messages, wherever they arise (auth, validation, the worker, an unknown route under it),
leave in Anthropic's shape; every other path answers in OpenAI's (the Responses API's included).
"""

from __future__ import annotations

from web.render import anthropic, openai

ANTHROPIC_PREFIX = "/v1/messages"
"""Where Anthropic's clients call: its errors follow their shape."""


def error_body(path: str, status: int, error: dict, request_id: str | None) -> dict:
    """The error body for a request to `path` (`error`: message, code, param and any extra fields)."""
    api = anthropic if path.startswith(ANTHROPIC_PREFIX) else openai
    return api.error_body(status, error, request_id)
