"""GET /health (the process is up) and GET /ready (Redis answers and a worker is alive)."""

from __future__ import annotations

import redis
from flask import jsonify

from jobs.lifecycle import any_worker_alive
from web.jsonbody import Blueprint
from web.response_schemas import HealthSchema, ReadySchema
from web.services import services

blp = Blueprint("health", __name__, description="Liveness and readiness probes")


@blp.route("/health", methods=["GET"])
@blp.response(200, HealthSchema)
@blp.doc(security=[])
def health():
    """Answer 200 while the web process runs (no dependency is checked)."""
    return jsonify({"status": "ok"})


@blp.route("/ready", methods=["GET"])
@blp.response(200, ReadySchema)
@blp.alt_response(503, schema=ReadySchema, description="Redis is unreachable or no worker is alive")
@blp.doc(security=[])
def ready():
    """Answer 200 when Redis answers and a worker is alive, else 503 saying which is missing."""
    svc = services()
    try:
        svc.redis.ping()
        worker = any_worker_alive(svc.redis)
    except redis.RedisError:
        return jsonify({"status": "unavailable", "redis": False, "worker": False}), 503, {"Retry-After": "5"}
    status = 200 if worker else 503
    headers = {} if worker else {"Retry-After": "5"}
    return jsonify({"status": "ready" if worker else "no_worker", "redis": True, "worker": worker}), status, headers
