"""The Flask application factory: wires settings, clients, blueprints, auth and errors."""

from __future__ import annotations

import re
import uuid

from flask import Flask, g, request
from flask_smorest import Api

from jobs.settings import Settings, load_settings
from web import audio_api, health, jobs_api, models_api, openai_api
from web.auth import register_auth
from web.dashboard import mount_dashboard
from web.errors import register_error_handlers
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
    )
    app.extensions["mlxq"] = Services(settings)
    _register_request_id(app)
    register_auth(app)
    register_error_handlers(app)
    api = Api(app)
    for module in (openai_api, models_api, health, audio_api, jobs_api):
        api.register_blueprint(module.blp)
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
