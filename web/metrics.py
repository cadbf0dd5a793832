"""GET /metrics in Prometheus's text format: the web tier's HTTP figures and the workers' (from Redis).

Under gunicorn every worker process counts its own requests; with PROMETHEUS_MULTIPROC_DIR set (web/
gunicorn_conf.py sets it) prometheus_client adds them up across processes at scrape time. Without it
(a single process, the tests' test_client) the process's own registry is served.
"""

from __future__ import annotations

import os
import time

from flask import Flask, Response, g, request
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)

from jobs.metrics import RedisCollector
from web.services import services

HTTP_REQUESTS = Counter("mlxq_http_requests", "HTTP requests answered, by route, method and status",
                        ["endpoint", "method", "status"])
HTTP_LATENCY = Histogram("mlxq_http_request_duration_seconds",
                         "Time to answer a request (for a stream: until its headers go out)", ["endpoint"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))


def register_metrics(app: Flask) -> None:
    """Count and time every request, and serve GET /metrics (behind the admin key: web/auth.py)."""

    @app.before_request
    def _start_clock():
        g.metrics_started = time.perf_counter()

    @app.after_request
    def _count(response):
        started = g.get("metrics_started")
        if started is not None and request.path != "/metrics":
            endpoint = request.url_rule.rule if request.url_rule is not None else "<unmatched>"
            HTTP_REQUESTS.labels(endpoint, request.method, str(response.status_code)).inc()
            HTTP_LATENCY.labels(endpoint).observe(time.perf_counter() - started)
        return response

    app.add_url_rule("/metrics", "metrics", metrics_view)


def metrics_view() -> Response:
    """Every mlxq metric, in Prometheus's text exposition format."""
    svc = services()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        web = CollectorRegistry()
        multiprocess.MultiProcessCollector(web)
    else:
        web = REGISTRY
    workers = CollectorRegistry(auto_describe=False)
    workers.register(RedisCollector(svc.redis, svc.settings))
    return Response(generate_latest(web) + generate_latest(workers), content_type=CONTENT_TYPE_LATEST)
