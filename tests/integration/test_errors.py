"""Every error status the API promises, provoked for real, with its envelope checked."""

from __future__ import annotations

import pytest
import redis

from tests import worker_heartbeat
from tests.conftest import free_port
from web.app import create_app

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def assert_envelope(response, status: int, code: str | None = None, param: str | None = None):
    """The response has `status`, the error envelope, and a request id header matching the body."""
    assert response.status_code == status, response.text
    body = response.json() if hasattr(response, "json") and callable(response.json) else response.get_json()
    assert set(body) == {"error", "request_id"}
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
    assert response.headers["X-Request-ID"] == body["request_id"]
    if code:
        assert body["error"]["code"] == code
    if param:
        assert body["error"]["param"] == param
    return body


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),  # a text model cannot see images: refused before the URL is looked at
    ({"messages": QUESTION, "temperature": 3}, "temperature"),
    ({"messages": QUESTION, "top_p": 0}, "top_p"),
    ({"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ({"messages": QUESTION, "max_tokens": 10**7}, "max_tokens"),
    ({"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": QUESTION, "n": 9}, "n"),
    ({"messages": QUESTION, "presence_penalty": 2.5}, "presence_penalty"),
    ({"messages": QUESTION, "logit_bias": {"49152": -100}}, "logit_bias"),  # the demo model's vocabulary: 49,152
    ({"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": QUESTION, "top_logprobs": 3}, "top_logprobs"),  # needs logprobs: true
    ({"messages": QUESTION, "response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_invalid_chat_input_is_400_naming_the_field(api, body, param):
    assert_envelope(api.post("/v1/chat/completions", json={"model": MODEL, **body}), 400, param=param)


def test_unknown_harmless_fields_are_ignored(api):
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, "max_tokens": 2,
                                                      "temperature": 0, "metadata": {"x": 1}, "store": False})
    assert response.status_code == 200, response.text


def test_malformed_json_is_400(api):
    response = api.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert_envelope(response, 400, code="invalid_json")


def test_completions_input_errors(api):
    assert_envelope(api.post("/v1/completions", json={"model": MODEL}), 400, param="prompt")
    assert_envelope(api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True}), 400,
                    param="echo")


def test_unknown_model_is_404(api):
    body = assert_envelope(api.post("/v1/chat/completions", json={"model": "nope/nothing", "messages": QUESTION}),
                           404, code="model_not_found", param="model")
    assert "nope/nothing" in body["error"]["message"]


def test_speech_model_on_chat_is_400(api):
    assert_envelope(api.post("/v1/chat/completions", json={"model": "whisper-tiny.en", "messages": QUESTION}),
                    400, code="invalid_model", param="model")


def test_body_too_large_is_413(api):
    # Chat bodies may carry images and audio (their limit is tested in tests/web/test_media_parts.py);
    # completions keep MLXQ_MAX_BODY_KB.
    big = b'{"prompt": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    assert_envelope(api.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                    413, code="request_too_large")


def test_unknown_route_is_404_envelope(api):
    assert_envelope(api.get("/v1/nothing-here"), 404)


def test_api_keys_are_required_on_every_endpoint(redis_url):
    client = create_app({"redis_url": redis_url, "api_keys": "k1,k2"}).test_client()
    for method, path in [("get", "/v1/models"), ("post", "/v1/chat/completions"), ("post", "/v1/completions"),
                         ("get", "/openapi.json"), ("get", "/v1/jobs")]:
        assert_envelope(getattr(client, method)(path), 401, code="invalid_api_key")
        wrong = getattr(client, method)(path, headers={"Authorization": "Bearer nope"})
        assert_envelope(wrong, 401, code="invalid_api_key")
    assert client.get("/v1/models", headers={"Authorization": "Bearer k2"}).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code in (200, 503)  # probes need no key (503: no worker here)


def test_dashboard_needs_the_admin_key(redis_url):
    client = create_app({"redis_url": redis_url, "api_keys": "k1", "admin_key": "adm"}).test_client()
    assert client.get("/rq/", headers={"Authorization": "Bearer k1"}).status_code == 401
    assert client.get("/rq/", headers={"Authorization": "Bearer adm"}).status_code == 200


def test_redis_unreachable_is_503_with_retry_after():
    client = create_app({"redis_url": f"redis://127.0.0.1:{free_port()}/0"}).test_client()
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
    body = assert_envelope(response, 503, code="queue_unavailable")
    assert response.headers["Retry-After"]
    assert "redis" in body["error"]["message"].lower()
    assert client.get("/ready").status_code == 503


def test_queue_over_its_limit_is_503_and_the_refused_job_leaves_no_trace(redis_url):
    # Database 6 has no worker draining it, only a heartbeat: the first job stays queued (its caller gets a 504).
    url = redis_url.rsplit("/", 1)[0] + "/6"
    conn = redis.Redis.from_url(url)
    conn.flushdb()
    worker_heartbeat.beat(conn)
    app = create_app({"redis_url": url, "max_queued": 1, "sync_timeout_s": 0.2})
    client = app.test_client()
    first = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
    app.extensions["mlxq"].close()  # its event hub: the one call that follows a job is done
    queued = assert_envelope(first, 504, code="timeout")["error"]["job_id"]

    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
    body = assert_envelope(response, 503, code="queue_full")
    assert response.headers["Retry-After"]
    assert "holds 1 jobs (limit 1)" in body["error"]["message"]
    # The refused job was taken back whole: only the first is queued, and no other job hash exists.
    assert conn.lrange("rq:queue:interactive", 0, -1) == [queued.encode()]
    assert conn.keys("rq:job:*") == [f"rq:job:{queued}".encode()]


def test_sync_call_past_its_limit_is_504_with_job_id(redis_url):
    # Database 5 has no worker draining it, only a heartbeat, so the job waits in its queue past the 1 s limit.
    url = redis_url.rsplit("/", 1)[0] + "/5"
    redis.Redis.from_url(url).flushdb()
    worker_heartbeat.beat(redis.Redis.from_url(url))
    app = create_app({"redis_url": url, "sync_timeout_s": 1})
    response = app.test_client().post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
    app.extensions["mlxq"].close()  # its event hub: the call that followed the job is done
    body = assert_envelope(response, 504, code="timeout")
    assert body["error"]["job_id"].startswith("chatcmpl-")
    assert body["error"]["job_id"] in body["error"]["message"]


def test_clients_cannot_name_server_directories(api, models_dir):
    body = assert_envelope(api.post("/v1/chat/completions", json={
        "model": str(models_dir / "smollm2-135m"), "messages": QUESTION}), 404, code="model_not_found")
    assert "directory" not in body["error"]["message"].split("looked for:")[-1]
