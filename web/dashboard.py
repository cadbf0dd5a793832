"""rq-dashboard mounted at /rq, reading the same Redis with RQ's JSON serializer.

Who may open it is web.auth's business (the admin key). Here: its routes that change state (delete,
requeue, empty, compact) answer only POSTs sent by the dashboard's own page. rq-dashboard accepts
`GET /rq/requeue/<queue>`, which a link or an image on any site could trigger in an operator's
browser; and a cross-site form could POST. The page sends its actions with jQuery, which marks
same-origin requests with `X-Requested-With`, a header no cross-site form or plain link can send.
"""

from __future__ import annotations

import re

import rq_dashboard
import rq_dashboard.web
from flask import Flask, request
from rq.serializers import JSONSerializer

from web.errors import APIError

_STATE_CHANGING = re.compile(
    r"^/rq/(job/[^/]+/(delete|requeue)|requeue/[^/]+|queue/[^/]+/[^/]+/empty|queue/[^/]+/compact)/?$")


def mount_dashboard(app: Flask, redis_url: str) -> None:
    """Register rq-dashboard under /rq, its state-changing routes reachable by its own page's POSTs only."""
    app.config.setdefault("RQ_DASHBOARD_REDIS_URL", redis_url)
    app.config.setdefault("RQ_DASHBOARD_POLL_INTERVAL", 2500)
    rq_dashboard.web.config.serializer = JSONSerializer  # jobs are stored as JSON, never pickled
    rq_dashboard.web.setup_rq_connection(app)
    app.register_blueprint(rq_dashboard.blueprint, url_prefix="/rq")
    app.before_request(_guard_actions)


def _guard_actions() -> None:
    """Refuse a dashboard action that is not a POST from the dashboard's page (405 / 403)."""
    if not _STATE_CHANGING.match(request.path):
        return
    if request.method != "POST":
        raise APIError(405, "This dashboard action changes state: it takes a POST from the dashboard's page.",
                       "method_not_allowed", headers={"Allow": "POST"})
    if request.headers.get("X-Requested-With") != "XMLHttpRequest":
        raise APIError(403, "Cross-site request refused: dashboard actions come from the dashboard's page.",
                       "cross_site_request")
