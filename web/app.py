"""The Flask application factory: wires settings, clients, blueprints, auth and errors."""

from __future__ import annotations

import re
import uuid

from flask import Flask, g, request
from werkzeug.exceptions import ClientDisconnected

from jobs.settings import Settings, load_settings
from web import (
    adapters_api,
    admin_api,
    audio_api,
    embeddings_api,
    health,
    jobs_api,
    messages_api,
    models_api,
    openai_api,
    pages,
    responses_api,
)
from web.auth import register_auth
from web.dashboard import mount_dashboard
from web.errors import error_response, register_error_handlers
from web.headers import register_security_headers
from web.metrics import register_metrics
from web.openapi import MlxqApi
from web.ratelimit import register_rate_limits
from web.services import Services

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def create_app(settings: Settings | dict | None = None) -> Flask:
    """Build the app: defaults, then environment, then `settings` (a Settings or a dict of overrides)."""
    if not isinstance(settings, Settings):
        settings = load_settings(settings or {})
    app = Flask(__name__)
    app.config.update(
        API_TITLE="mlxq",
        API_VERSION="v1",
        OPENAPI_VERSION="3.0.3",
        OPENAPI_URL_PREFIX="/",
        OPENAPI_JSON_PATH="openapi.json",
        MAX_CONTENT_LENGTH=settings.max_body_kb * 1024,
        **pages.SWAGGER_UI_CONFIG,
    )
    app.extensions["mlxq"] = Services(settings)
    _register_request_id(app)
    register_security_headers(app)
    _register_body_timeout(app, settings.body_timeout_s)
    register_auth(app)
    register_rate_limits(app)
    register_metrics(app)
    register_error_handlers(app)
    api = MlxqApi(app, settings)
    for module in (openai_api, responses_api, messages_api, embeddings_api, models_api, health, audio_api, jobs_api,
                   admin_api, adapters_api):
        api.register_blueprint(module.blp)
    app.register_blueprint(pages.bp)
    mount_dashboard(app, settings.redis_url)
    register_error_handlers(app)  # again: Api() installs its own handlers; ours must win
    return app


def _register_request_id(app: Flask) -> None:
    """Give every request an id (the client's X-Request-ID if sane) and echo it on every response."""

    @app.before_request
    def _assign():
        incoming = request.headers.get("X-Request-ID", "")
        g.request_id = incoming if _REQUEST_ID.match(incoming) else f"req_{uuid.uuid4().hex}"

    @app.after_request
    def _echo(response):
        response.headers["X-Request-ID"] = getattr(g, "request_id", "") or f"req_{uuid.uuid4().hex}"
        return response


def _register_body_timeout(app: Flask, timeout_s: float) -> None:
    """Give up on a request body that stops arriving: each read waits at most `timeout_s` (then 408).

    gunicorn's gevent workers wait for a body without limit, so a client that announces a body and
    never sends it would hold its connection (and its memory) until the client itself gives up.
    The timeout covers reading the request only; the response is written without one.
    """

    def _socket():
        return request.environ.get("gunicorn.socket")

    @app.before_request
    def _limit_reads():
        sock = _socket()
        if sock is not None and request.content_length != 0:
            sock.settimeout(timeout_s)

    @app.after_request
    def _unlimit(response):
        sock = _socket()
        if sock is not None:
            sock.settimeout(None)
        return response

    @app.errorhandler(TimeoutError)
    def _body_stalled(exc: TimeoutError):
        return error_response(408, f"The request body stopped arriving (nothing for {timeout_s:g}s).",
                              "request_timeout", headers={"Connection": "close"})

    @app.errorhandler(ClientDisconnected)
    def _body_cut(exc: ClientDisconnected):
        cause = exc.__cause__ or exc.__context__  # werkzeug raises it while handling the socket's timeout
        if isinstance(cause, TimeoutError):
            return _body_stalled(cause)
        return error_response(400, "The request body ended before its Content-Length.", "incomplete_body",
                              headers={"Connection": "close"})
