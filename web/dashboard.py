"""rq-dashboard mounted at /rq, reading the same Redis with RQ's JSON serializer."""

from __future__ import annotations

import rq_dashboard
import rq_dashboard.web
from flask import Flask
from rq.serializers import JSONSerializer


def mount_dashboard(app: Flask, redis_url: str) -> None:
    """Register rq-dashboard under /rq (authentication is applied by web.auth)."""
    app.config.setdefault("RQ_DASHBOARD_REDIS_URL", redis_url)
    app.config.setdefault("RQ_DASHBOARD_POLL_INTERVAL", 2500)
    rq_dashboard.web.config.serializer = JSONSerializer  # jobs are stored as JSON, never pickled
    rq_dashboard.web.setup_rq_connection(app)
    app.register_blueprint(rq_dashboard.blueprint, url_prefix="/rq")
