"""Calls with no live worker, through the real app on a real Redis: a synchronous call is refused at once
(503 no_worker), an async job queues with a warning, and a call whose worker goes away while it waits
in the queue is taken out of it and answered 503. Workers appear only as their heartbeats
(tests/worker_heartbeat.py): nothing drains the queues here.
"""

from __future__ import annotations

import io
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from jobs.queues import INTERACTIVE, fetch_job
from tests import worker_heartbeat
from tests.conftest import REPO

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SPEECH = REPO / "tests" / "fixtures" / "speech"


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis (flushed: no worker's heartbeat in it)."""
    return app_for().test_client()


def _spooled(settings) -> set:
    """The files in the spool directory (the module's tests share it)."""
    return {p for p in settings.spool_dir.rglob("*") if p.is_file()} if settings.spool_dir.exists() else set()


def _audio(model: str = "whisper-tiny.en") -> dict:
    return {"model": model, "file": (io.BytesIO((SPEECH / "numbers.wav").read_bytes()), "numbers.wav")}


SYNC_CALLS = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION}),
    "chat stream": ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "stream": True}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "Paris is"}),
    "responses stream": ("/v1/responses", {"model": MODEL, "input": "Hi", "stream": True}),
    "messages": ("/v1/messages", {"model": MODEL, "messages": QUESTION, "max_tokens": 5}),
    "transcription": ("/v1/audio/transcriptions", None),
    "translation stream": ("/v1/audio/translations", None),
}


@pytest.mark.parametrize("name", list(SYNC_CALLS))
def test_a_synchronous_call_with_no_worker_is_a_503_at_once(client, redis_conn, module_settings, name):
    path, body = SYNC_CALLS[name]
    spooled_before = _spooled(module_settings)
    started = time.monotonic()
    if body is None:
        model = "whisper-base" if "translation" in name else "whisper-tiny.en"  # tiny.en cannot translate
        response = client.post(path, data={**_audio(model), "stream": str("stream" in name).lower()})
    else:
        response = client.post(path, json=body)
    assert time.monotonic() - started < 5
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.headers["Retry-After"] == "5"
    error = response.get_json()["error"]
    if path == "/v1/messages":  # Anthropic's envelope
        assert error["type"] == "overloaded_error"
    else:
        assert error["code"] == "no_worker"
    assert "no mlx worker" in error["message"].lower()
    # Nothing was queued for a worker that starts later, and no upload was left in the spool.
    assert not redis_conn.keys("rq:job:*") and not redis_conn.llen(f"rq:queue:{INTERACTIVE}")
    assert _spooled(module_settings) == spooled_before


def test_an_async_job_with_no_worker_is_queued_with_a_warning(client, redis_conn):
    response = client.post("/v1/jobs/chat/completions", json={"model": MODEL, "messages": QUESTION})
    assert response.status_code == 202, response.get_data(as_text=True)
    body = response.get_json()
    assert body["status"] == "queued" and "no mlx worker is running" in body["warning"].lower()
    assert redis_conn.lrange("rq:queue:batch", 0, -1) == [body["id"].encode()]

    transcription = client.post("/v1/jobs/transcriptions", data=_audio())
    assert transcription.status_code == 202 and transcription.get_json()["warning"] == body["warning"]


def test_with_a_live_worker_an_async_job_has_no_warning(client, redis_conn):
    worker_heartbeat.beat(redis_conn)
    response = client.post("/v1/jobs/chat/completions", json={"model": MODEL, "messages": QUESTION})
    assert response.status_code == 202 and "warning" not in response.get_json()


def _job_ids(redis_conn) -> list[str]:
    return [k.decode().split(":", 2)[2] for k in redis_conn.keys("rq:job:*")]


def test_a_call_and_a_stream_whose_worker_goes_away_while_they_are_queued_end_with_no_worker(client, redis_conn):
    """A call is answered 503, a stream ends with an error event; both are taken out of their queue. Sent at
    once: each waits for the heartbeat to expire and the web tier to see it (about 2 s)."""
    worker_heartbeat.beat(redis_conn, ttl_s=1.5)  # a worker that dies at once: its heartbeat expires
    body = {"model": MODEL, "messages": QUESTION}

    def call():
        started = time.monotonic()
        response = client.application.test_client().post("/v1/chat/completions", json=body)
        return response, time.monotonic() - started

    def stream():
        return client.application.test_client().post("/v1/chat/completions", json={**body, "stream": True})

    with ThreadPoolExecutor(2) as pool:
        called, streamed = pool.submit(call), pool.submit(stream)
        (response, waited), streamed = called.result(), streamed.result()
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.get_json()["error"]["code"] == "no_worker" and response.headers["Retry-After"] == "5"
    assert 1.0 < waited < 10, f"answered after {waited:.1f}s"

    assert streamed.status_code == 200
    frames = [line[6:] for line in streamed.get_data(as_text=True).splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["code"] == "no_worker" and "no mlx worker" in error["message"].lower()

    # Taken out of their queue: a worker that starts later does not run them.
    job_ids = _job_ids(redis_conn)
    assert len(job_ids) == 2 and not redis_conn.llen(f"rq:queue:{INTERACTIVE}")
    assert {fetch_job(redis_conn, job_id).get_status() for job_id in job_ids} == {"canceled"}
