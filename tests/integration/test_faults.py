"""Faults: a client leaving mid-stream, the worker killed mid-job (its calls fail, its transcription
resumes), no worker at all, and the web tier's MLX-free imports."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
import wave

import httpx
import openai
import pytest
import redis
from rq.job import JobStatus

from jobs import keys, workers
from jobs.events import read_log
from jobs.queues import INTERACTIVE, fetch_job, get_queue
from jobs.settings import load_settings
from tests.conftest import REPO, wait_until
from tests.integration.test_transcription import submit_job

MODEL = "smollm2-135m"
LONG = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]
BATCHED = {"chunking_strategy": "auto", "diarize": "true"}
"""A transcription on the batched path (speech pieces found by voice activity detection, decoded in batches
of two in the integration service: MLXQ_SPEECH_BATCH), diarized (its speakers are resume state too)."""
SPEECH = REPO / "tests" / "fixtures" / "speech"


def sparse_speech(seconds: float = 5, gap_s: float = 31) -> bytes:
    """Three short utterances `gap_s` apart (WAV), by two voices (A, B, A): three speech pieces, as no two fit one
    30 s window, so two batches with a checkpoint between them; little speech, so little to decode."""
    out = io.BytesIO()
    with wave.open(out, "wb") as dst:
        dst.setnchannels(1), dst.setsampwidth(2), dst.setframerate(16000)
        for i, name in enumerate(("garden", "voice_b/river", "train_journey")):
            if i:
                dst.writeframes(b"\0\0" * int(gap_s * 16000))
            with wave.open(str(SPEECH / f"{name}.wav")) as src:
                dst.writeframes(src.readframes(int(seconds * src.getframerate())))
    return out.getvalue()


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


@pytest.fixture(scope="module")
def sparse_result(service):
    """The uninterrupted transcript of `sparse_speech()` on the batched path: what a resumed run must give."""
    with httpx.Client(base_url=service.base_url, timeout=60) as api:
        record = _job_finished(api, submit_job(api, "sparse.wav", content=sparse_speech(), **BATCHED))
    assert record["status"] == "succeeded", record
    return record["result"]


def _job_finished(api: httpx.Client, job: dict, timeout: float = 300) -> dict:
    """Wait for an async job's terminal status and return its record."""
    def ended():
        record = api.get(job["links"]["self"]).json()
        return record if record["status"] in ("succeeded", "failed", "canceled") else None
    return wait_until(ended, timeout, interval=0.2, what=f"job {job['id']} to finish")


def _alive_key(conn: redis.Redis, pid: int) -> str:
    """The liveness key of the worker running as `pid`."""
    return keys.worker_alive(next(s["name"] for s in workers.states(conn) if s["pid"] == pid))


@pytest.mark.timeout(600)
def test_a_worker_killed_mid_work_fails_its_calls_within_15s_and_its_transcription_resumes(service, sparse_result):
    # The one end-to-end kill -9 of the worker (each restart costs the suite a model load), in the middle of
    # everything a kill can interrupt: a stream and a synchronous call decoding together in one batch, and
    # an async transcription on the batched path between two batches of its windows (the only resume state
    # otherwise never written to Redis by one process and read back by another). What each part does with
    # a dead worker is tested in process too: tests/jobs/test_lifecycle.py (a reader fails a dead worker's
    # call), tests/workers/test_worker_process.py (recovery fails it), tests/workers/test_speech*.py (resume).
    conn = redis.Redis.from_url(service.redis_url)
    dead_after = load_settings().worker_dead_after_s  # the service's too: it has no override
    api = httpx.Client(base_url=service.base_url, timeout=60)
    client, ctx, response = _open_stream(service, max_tokens=2000)
    sync: dict = {}

    def sync_call():
        sync["response"] = httpx.post(service.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": LONG, "max_tokens": 2000, "temperature": 0.7})
        sync["answered_at"] = time.monotonic()

    caller = threading.Thread(target=sync_call)
    try:
        lines = response.iter_lines()
        stream_id, _ = _first_chunks(lines, 2)
        before = set(conn.scan_iter(match=keys.event_log("chatcmpl-*")))
        caller.start()
        # The sync call's job logging its first event says the worker is generating it too.
        [sync_log] = wait_until(lambda: set(conn.scan_iter(match=keys.event_log("chatcmpl-*"))) - before, 60,
                                what="the sync call's job to start")
        sync_id = sync_log.decode()[len(keys.event_log("")):]
        # While the calls run, the heartbeat thread pushes their started-registry expiry forward.
        registry = get_queue(INTERACTIVE, conn).started_job_registry
        expiry = lambda: max(score for _, score in conn.zrange(registry.key, 0, -1, withscores=True))  # noqa: E731
        first_expiry = expiry()
        wait_until(lambda: expiry() > first_expiry, 30, interval=0.1, what="the running calls' RQ heartbeat")
        job = submit_job(api, "sparse.wav", content=sparse_speech(), **BATCHED)
        # Kill once the transcription's first batch of windows is checkpointed and published.
        wait_until(lambda: ((api.get(job["links"]["self"]).json().get("progress") or {}).get("done_s") or 0) > 0,
                   300, interval=0.1, what="the first batch of windows to be transcribed")
        alive_key = _alive_key(conn, service.worker.process.pid)
        service.worker.kill9()
        killed_at = time.monotonic()
        assert 0 < conn.pttl(alive_key) <= dead_after * 1000, "the liveness key must expire by itself"
        assert api.get(job["links"]["self"]).json()["status"] == "running"
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
    wait_until(lambda: not conn.exists(alive_key), max(0.0, killed_at + dead_after + 0.5 - time.monotonic())
               + 0.01, interval=0.05, what="the dead worker's liveness key to expire")

    # The restarted worker retires the dead one's calls in RQ and resumes the transcription from its checkpoint.
    for call_id in (stream_id, sync_id):
        assert fetch_job(conn, call_id).get_status() == JobStatus.FAILED
        assert call_id not in registry.get_job_ids(cleanup=False)
    record = _job_finished(api, job)
    api.close()
    assert record["status"] == "succeeded", record
    assert record["attempts"] >= 2, "the job should have been resumed by the restarted worker"
    assert record["result"]["text"] == sparse_result["text"]
    speakers = [s["speaker"] for s in record["result"]["segments"]]
    assert speakers == [s["speaker"] for s in sparse_result["segments"]], "a resumed run labels speakers the same"
    assert set(speakers) == {"A", "B"}
    starts = [s["start"] for s in record["result"]["segments"]]
    assert starts == sorted(starts), "timestamps must continue across the resume"


NO_WORKER_S = 10
"""How soon a call that no worker can answer must be answered."""


def test_each_web_worker_is_subscribed_to_the_events_before_its_first_call(web_only):
    # gunicorn's post_worker_init (web/gunicorn_conf.py) starts the event hub: before it did, the first call each
    # web worker served subscribed it on the way, ~20 ms later than the calls after it.
    conn = redis.Redis.from_url(web_only.redis_url)
    db = web_only.redis_url.rsplit("/", 1)[1]
    subscribed = [c for c in conn.client_list(_type="pubsub") if c["db"] == db and int(c.get("psub", 0))]
    assert len(subscribed) == 1, subscribed  # the fixture's gunicorn runs one worker; no call has followed a job


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
