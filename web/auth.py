"""Bearer-key authentication (MLXQ_API_KEYS) and the admin key (MLXQ_ADMIN_KEY) for /rq."""

from __future__ import annotations

import base64
import hmac

from flask import Flask, current_app, request

from web.errors import APIError

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a key: the liveness probe reveals nothing."""


def _presented_key() -> str | None:
    """The key the client sent: `Authorization: Bearer KEY`, or Basic auth's password (browsers)."""
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        return value.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return None
    return None


def _matches(key: str | None, accepted) -> bool:
    return key is not None and any(hmac.compare_digest(key.encode(), a.encode()) for a in accepted)


def register_auth(app: Flask) -> None:
    """Check keys before every request when keys are configured."""

    @app.before_request
    def _check_key():
        settings = current_app.extensions["mlxq"].settings
        if request.path in OPEN_PATHS:
            return None
        is_admin_path = request.path == "/rq" or request.path.startswith("/rq/")
        accepted = (settings.admin_key,) if is_admin_path and settings.admin_key else settings.api_keys
        if not accepted or _matches(_presented_key(), accepted):
            return None
        headers = {"WWW-Authenticate": 'Basic realm="mlxq"'} if is_admin_path else {}
        message = "Missing or invalid API key: send 'Authorization: Bearer <key>'."
        raise APIError(401, message, "invalid_api_key", headers=headers)
