"""Faults: a client leaving mid-stream, the worker killed mid-job, no worker at all, and the web tier's
MLX-free imports."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import redis

from jobs import keys
from jobs.events import read_log
from tests.conftest import REPO, wait_until

MODEL = "smollm2-135m"
LONG = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


def _open_stream(service, max_tokens: int):
    """Start a streamed chat that would run long; return (client, response context, response)."""
    client = httpx.Client(base_url=service.base_url, timeout=60)
    ctx = client.stream("POST", "/v1/chat/completions", json={
        "model": MODEL, "messages": LONG, "max_tokens": max_tokens, "temperature": 0.7, "seed": 1, "stream": True})
    return client, ctx, ctx.__enter__()


def _first_chunks(lines, n: int) -> tuple[str, list[dict]]:
    """Read SSE lines until `n` data chunks arrived; return the job id and the chunks."""
    chunks = []
    while len(chunks) < n:
        line = next(lines)
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks[0]["id"], chunks


def test_client_disconnect_cancels_the_job(service):
    conn = redis.Redis.from_url(service.redis_url)
    client, ctx, response = _open_stream(service, max_tokens=400)
    job_id, _ = _first_chunks(response.iter_lines(), 4)
    ctx.__exit__(None, None, None)
    client.close()  # the client goes away mid-stream
    terminal = wait_until(lambda: [e for e in read_log(conn, job_id) if e["type"] in ("done", "error")], 30,
                          what="the canceled job's terminal event")
    assert terminal[0]["type"] == "error" and terminal[0]["data"]["code"] == "canceled"
    generated = "".join(e["data"]["text"] for e in read_log(conn, job_id) if e["type"] == "delta")
    assert len(generated.split()) < 150, "the worker kept generating long after the client left"
    # The worker is free again: a new call is answered.
    answer = httpx.post(service.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert answer.status_code == 200


def test_worker_killed_mid_call_ends_a_stream_and_a_sync_call_with_worker_died_within_15s(service):
    # One kill -9 for both ways of waiting on a job (a stream and a synchronous call, decoding together
    # in one batch): each restart of the worker costs the suite a model load.
    conn = redis.Redis.from_url(service.redis_url)
    client, ctx, response = _open_stream(service, max_tokens=2000)
    sync: dict = {}

    def sync_call():
        sync["response"] = httpx.post(service.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": LONG, "max_tokens": 2000, "temperature": 0.7})
        sync["answered_at"] = time.monotonic()

    caller = threading.Thread(target=sync_call)
    try:
        lines = response.iter_lines()
        _first_chunks(lines, 2)
        before = set(conn.scan_iter(match=keys.event_log("chatcmpl-*")))
        caller.start()
        # The sync call's job logging its first event says the worker is generating it too.
        wait_until(lambda: set(conn.scan_iter(match=keys.event_log("chatcmpl-*"))) - before, 60,
                   what="the sync call's job to start")
        service.worker.kill9()
        killed_at = time.monotonic()
        error = None
        for line in lines:
            if line.startswith("data: {") and '"error"' in line:
                error = json.loads(line[6:])
                break
        waited = time.monotonic() - killed_at
        caller.join(70)
    finally:
        ctx.__exit__(None, None, None)
        client.close()
        service.restart_worker()
    assert error is not None and error["error"]["code"] == "worker_died"
    assert waited < 15, f"the stream's error took {waited:.1f}s"
    assert sync["response"].status_code == 500
    assert sync["response"].json()["error"]["code"] == "worker_died"
    assert sync["answered_at"] - killed_at < 15


NO_WORKER_S = 10
"""How soon a call that no worker can answer must be answered."""


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "streamed"])
def test_with_no_worker_a_chat_is_a_503_at_once(web_only, stream):
    started = time.monotonic()
    response = httpx.post(web_only.base_url + "/v1/chat/completions", timeout=NO_WORKER_S, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": stream})
    assert time.monotonic() - started < NO_WORKER_S
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "no_worker" and response.headers["Retry-After"] == "5"


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "streamed"])
def test_with_no_worker_the_openai_client_gets_the_503(web_only, stream):
    client = openai.OpenAI(base_url=web_only.base_url + "/v1", api_key="unused", timeout=NO_WORKER_S, max_retries=0)
    started = time.monotonic()
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       stream=stream)
        raise AssertionError("answered with no worker")
    except openai.APIStatusError as exc:
        error = exc
    assert time.monotonic() - started < NO_WORKER_S
    assert error.status_code == 503 and error.body["code"] == "no_worker"
    assert "No MLX worker is running" in error.message


def test_with_no_worker_an_async_job_is_accepted_and_says_it_waits(web_only):
    response = httpx.post(web_only.base_url + "/v1/jobs/chat/completions", timeout=NO_WORKER_S, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert response.status_code == 202, response.text
    job = response.json()
    assert job["status"] == "queued" and "waits in the queue" in job["warning"]
    record = httpx.get(web_only.base_url + job["links"]["self"], timeout=NO_WORKER_S).json()
    assert record["status"] == "queued"


def test_web_and_jobs_import_no_mlx():
    code = ("import sys, web.app, jobs.events, jobs.store, jobs.subscriber, jobs.lifecycle, jobs.contract, jobs.errors, mlxq.cli; "
            "web.app.create_app(); bad = [m for m in sys.modules if m.split('.')[0] in "
            "('mlx', 'mlx_lm', 'mlx_vlm', 'mlx_audio')]; print(bad); assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
