"""The pages a person opens in a browser: mlxq's page at `/` (web/static/) and Swagger UI at `/docs`,
every asset served from this server (Swagger UI's from the swagger-ui-bundle package): no CDN.

They hold no data: the page asks for an API key (kept in the browser's localStorage) and sends it
with each API call, so they are open to anyone (web/auth.py PAGE_PATHS).
"""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, send_from_directory
from swagger_ui_bundle import swagger_ui_path

STATIC = Path(__file__).resolve().parent / "static"

bp = Blueprint("pages", __name__, static_folder=str(STATIC), static_url_path="/ui")

SWAGGER_UI_CONFIG = {"OPENAPI_SWAGGER_UI_PATH": "/docs", "OPENAPI_SWAGGER_UI_URL": "/docs/assets/"}
"""flask-smorest serves Swagger UI at /docs (web/templates/swagger_ui.html), its assets from here."""


@bp.route("/")
def index():
    """mlxq's page: transcribe (upload or record) with a live transcript, recent jobs, a chat."""
    return send_from_directory(STATIC, "index.html")


@bp.route("/docs/assets/<path:filename>")
def swagger_assets(filename: str):
    """Swagger UI's JavaScript and CSS, from the swagger-ui-bundle package."""
    return send_from_directory(str(swagger_ui_path), filename, max_age=86400)
