"""Who is calling: bearer keys (MLXQ_API_KEYS), the admin key (MLXQ_ADMIN_KEY), and what each may see.

- No key configured at all: the server is open (a local or trusted deployment), the dashboard too.
- API keys: every endpoint but /health and /ready needs one of them (or the admin key). A key owns the async
  jobs it creates: another key cannot see, follow, fetch or cancel them (they answer 404).
- The admin key sees every job, and it alone opens the dashboard at /rq (which shows every user's
  jobs, results and the server's internals), the admin API (/v1/admin/) and /metrics. With API keys
  but no admin key, those are closed; a user key there is a 403.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass

from flask import Flask, current_app, g, request

from web.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready", "/", "/docs"})
"""Paths answered without a key: the probes an orchestrator calls and the pages (web/pages.py), which
reveal nothing (the pages ask for a key and send it with their API calls)."""

OPEN_PREFIXES = ("/ui/", "/docs/assets/")
"""The pages' static assets, also answered without a key."""

ANONYMOUS = ""
"""The owner of jobs created without a key (an open server's callers all share it)."""


@dataclass(frozen=True)
class Caller:
    """The authenticated caller of the current request."""

    owner: str  # whose jobs this caller sees: a digest of its key, or ANONYMOUS
    admin: bool  # presented the admin key: sees every job, opens the dashboard

    def may_see(self, record: dict) -> bool:
        """Whether this caller may see (follow, fetch, cancel) the job of `record`."""
        return self.admin or (record.get("owner") or ANONYMOUS) == self.owner


def caller() -> Caller:
    """The current request's caller (set before every view)."""
    return g.mlxq_caller


def owner_of(key: str) -> str:
    """A stable, non-reversible name for a key, stored with the jobs it creates (never the key itself)."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _presented_key() -> str | None:
    """The key the client sent: `Authorization: Bearer KEY`, Basic auth's password (browsers), or
    `x-api-key` (Anthropic's clients)."""
    if request.headers.get("x-api-key"):
        return request.headers["x-api-key"].strip()
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
    return key is not None and any(hmac.compare_digest(key.encode(), a.encode()) for a in accepted if a)


def is_dashboard_path(path: str) -> bool:
    """Whether `path` belongs to rq-dashboard."""
    return path == "/rq" or path.startswith("/rq/")


def is_admin_path(path: str) -> bool:
    """Whether `path` is for operators only: the admin API (and its adapters, /v1/adapters) and /metrics."""
    return path in ("/metrics", "/v1/admin", "/v1/adapters") or path.startswith(("/v1/admin/", "/v1/adapters/"))


def _identify(settings) -> Caller:
    """The caller of this request, or an APIError saying why it is refused."""
    key = _presented_key()
    if settings.admin_key and _matches(key, (settings.admin_key,)):
        return Caller(owner_of(key), admin=True)
    if is_dashboard_path(request.path):
        if not settings.admin_key and not settings.api_keys:
            return Caller(ANONYMOUS, admin=True)  # an open server: its operator is whoever is there
        if not settings.admin_key:
            raise APIError(403, "The dashboard is closed: it opens with the admin key (set MLXQ_ADMIN_KEY).",
                           "dashboard_closed")
        raise APIError(401, "The dashboard needs the admin key (HTTP Basic: any user name, the key as password).",
                       "invalid_api_key", headers={"WWW-Authenticate": 'Basic realm="mlxq"'})
    if is_admin_path(request.path):
        return _admin_only(settings, key)
    if not settings.api_keys:
        return Caller(ANONYMOUS, admin=False)
    if _matches(key, settings.api_keys):
        return Caller(owner_of(key), admin=False)
    raise APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.", "invalid_api_key")


def _admin_only(settings, key: str | None) -> Caller:
    """The caller of an operators' path (the admin key did not match): open only on an open server."""
    if not settings.admin_key and not settings.api_keys:
        return Caller(ANONYMOUS, admin=True)
    if not settings.admin_key:
        raise APIError(403, "The admin API and /metrics are closed: they open with the admin key (set "
                            "MLXQ_ADMIN_KEY).", "admin_closed")
    if _matches(key, settings.api_keys):
        raise APIError(403, "This needs the admin key (MLXQ_ADMIN_KEY), not a user's key.", "admin_only")
    raise APIError(401, "Missing or invalid admin key: send 'Authorization: Bearer <MLXQ_ADMIN_KEY>'.",
                   "invalid_api_key")


def register_auth(app: Flask) -> None:
    """Identify the caller before every request; refuse it when keys are configured and none matches."""

    @app.before_request
    def _check_key():
        if request.path in OPEN_PATHS or request.path.startswith(OPEN_PREFIXES):
            g.mlxq_caller = Caller(ANONYMOUS, admin=False)
            return
        g.mlxq_caller = _identify(current_app.extensions["mlxq"].settings)
