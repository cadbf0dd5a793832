"""Schemathesis against the running service: what /openapi.json promises is what every answer is.

Every operation gets generated requests, valid and invalid, over real HTTP (gunicorn, gevent, the
worker, Redis). An answer fails the test if it is a server error, a status or content type the
document does not declare, a body or header that violates its schema, or slower than a bound (a
hang). Bounded to about a minute here; the same checks run for longer by hand (docs/operations.md):

    schemathesis run http://127.0.0.1:8000/openapi.json --checks not_a_server_error,\
status_code_conformance,content_type_conformance,response_schema_conformance,\
response_headers_conformance --max-examples 2000 --request-timeout 60 -H "Authorization: Bearer KEY"
"""

from __future__ import annotations

import httpx
import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import max_response_time, not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.integration.conftest import Service
from web.app import create_app

KEY = "fuzz-key"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, max_response_time]
EXAMPLES = 15
"""Generated requests per operation in the fuzzing phase (on top of the examples and coverage phases)."""


@pytest.fixture(scope="module")
def fuzzed_service(redis_url, models_dir):
    """A service of its own (database 3) with small generation limits, so each generated call is quick."""
    url = redis_url.rsplit("/", 1)[0] + "/3"
    redis.Redis.from_url(url).flushdb()
    service = Service(url, models_dir, MLXQ_API_KEYS=KEY, MLXQ_MAX_TOKENS_LIMIT=4, MLXQ_SYNC_TIMEOUT_S=20,
                      MLXQ_MAX_AUDIO_S=60, MLXQ_BODY_TIMEOUT_S=5).start()
    yield service
    service.stop()


def _document() -> dict:
    """The OpenAPI document the service serves with these settings (rendered in-process: no Redis needed)."""
    app = create_app({"api_keys": KEY})
    return app.test_client().get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).get_json()


CONFIG = schemathesis.Config.from_dict({
    "headers": {"Authorization": f"Bearer {KEY}"},
    "request-timeout": 60,
    "generation": {"max-examples": EXAMPLES},
    "checks": {"max_response_time": 30.0},  # a hang fails the test instead of holding the suite
})
schema = schemathesis.openapi.from_dict(_document(), config=CONFIG)


def test_the_service_serves_the_document_fuzzed_here(fuzzed_service):
    served = httpx.get(fuzzed_service.base_url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})
    assert served.status_code == 200 and served.json() == _document()


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_every_answer_matches_the_document(case, fuzzed_service):
    case.call_and_validate(base_url=fuzzed_service.base_url, checks=CHECKS)
