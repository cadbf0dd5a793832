"""Hardening through the real service: one bad request never hurts others, and unwanted work stops.

Each test is the regression test of a finding of the fuzzing and fault probes (issue 13).
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import threading
import time
import wave

import httpx
import numpy as np
import pytest
import redis

from jobs import contract, keys, queues
from jobs.events import read_log
from jobs.settings import load_settings
from jobs.store import resolve
from tests.conftest import REPO, wait_until
from tests.long_audio import build

MODEL = "smollm2-135m"
SPEECH = REPO / "tests" / "fixtures" / "speech"
STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]


def _terminal(conn, job_id: str, timeout: float = 30) -> dict:
    """The job's terminal event, once it is logged."""
    found = wait_until(lambda: [e for e in read_log(conn, job_id) if e["type"] in ("done", "error")], timeout,
                       what=f"the terminal event of {job_id}")
    return found[0]


def _new_job(conn, before: set, pattern: str, timeout: float = 60) -> str:
    """The id of the job whose event log appeared since `before` was taken."""
    fresh = wait_until(lambda: set(conn.scan_iter(match=keys.event_log(pattern))) - before, timeout,
                       what="a new job to start")
    return next(iter(fresh)).decode().rsplit(":", 1)[-1]


def test_a_top_k_of_the_whole_vocabulary_does_not_break_sampling_for_anyone(api):
    whole = api.post("/v1/chat/completions", json={
        "model": MODEL, "messages": STORY, "max_tokens": 4, "temperature": 0.8, "top_k": 49152})
    assert whole.status_code == 200, whole.text
    over = api.post("/v1/chat/completions", json={"model": MODEL, "messages": STORY, "top_k": 49153})
    assert over.status_code == 400 and over.json()["error"]["param"] == "top_k"
    for _ in range(2):  # what used to fail for every client afterwards: any sampled request
        sampled = api.post("/v1/chat/completions", json={
            "model": MODEL, "messages": STORY, "max_tokens": 4, "temperature": 0.7})
        assert sampled.status_code == 200, sampled.text


def test_a_non_streamed_chat_whose_client_hangs_up_is_canceled(service):
    conn = redis.Redis.from_url(service.redis_url)
    before = set(conn.scan_iter(match=keys.event_log("chatcmpl-*")))

    def impatient_client():
        with pytest.raises(httpx.ReadTimeout):  # gives up after 2 s and closes its connection
            httpx.post(service.base_url + "/v1/chat/completions", timeout=httpx.Timeout(60, read=2), json={
                "model": MODEL, "messages": STORY, "max_tokens": 3000, "temperature": 0.7, "seed": 3})

    client = threading.Thread(target=impatient_client)
    client.start()
    job_id = _new_job(conn, before, "chatcmpl-*")
    client.join(30)
    left_at = time.monotonic()
    terminal = _terminal(conn, job_id)
    assert terminal["type"] == "error" and terminal["data"]["code"] == "canceled"
    assert time.monotonic() - left_at < 10
    generated = "".join(e["data"]["text"] for e in read_log(conn, job_id) if e["type"] == "delta")
    assert len(generated.split()) < 1500, "the worker kept generating long after the client left"


def test_a_body_that_stops_arriving_gets_a_408(service):
    timeout_s = float(service.env["MLXQ_BODY_TIMEOUT_S"])
    with socket.create_connection(("127.0.0.1", service.port), timeout=timeout_s + 10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"messages\": ")
        started = time.monotonic()
        reader = sock.makefile("rb")
        status = reader.readline().decode()
        waited = time.monotonic() - started
        headers = dict(line.decode().split(":", 1) for line in iter(reader.readline, b"\r\n"))
        body = reader.read(int(headers["Content-Length"])).decode()
    assert status.startswith("HTTP/1.1 408"), status
    assert '"request_timeout"' in body and timeout_s - 0.5 < waited < timeout_s + 5


def _sneaky_wav() -> bytes:
    """200 KB of samples at 1 Hz: a WAV declaring 27.8 hours."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(1)
        w.writeframes(np.zeros(100_000, np.int16).tobytes())
    return out.getvalue()


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/jobs/transcriptions"])
def test_audio_longer_than_the_limit_is_refused_before_it_is_queued(api, path):
    response = api.post(path, data={"model": "whisper-tiny.en"}, files={"file": ("long.wav", _sneaky_wav())})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["reason"]) == ("audio_too_long", "file", "too_long")


def test_a_truncated_file_is_refused_not_half_transcribed(api):
    ogg = (SPEECH / "weather.ogg").read_bytes()
    response = api.post("/v1/audio/transcriptions", data={"model": "whisper-tiny.en"},
                        files={"file": ("cut.ogg", ogg[: len(ogg) // 2])})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["reason"] == "truncated"


def test_a_sync_transcription_killed_by_its_timeout_leaves_no_upload_behind(service):
    conn = redis.Redis.from_url(service.redis_url)
    settings = load_settings({"redis_url": service.redis_url, "models_dir": service.env["MLXQ_MODELS_DIR"],
                              "spool_dir": service.spool_dir})
    job_id = queues.new_job_id("transcr")
    spooled = settings.spool_dir / job_id
    spooled.mkdir(parents=True)
    audio = shutil.copy(build(1), spooled / "minute.wav")  # takes the worker well over a second
    info = resolve("whisper-tiny.en", settings)
    model = contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)
    request = contract.TranscriptionRequest(job_id, model, str(audio), "minute.wav")
    queues.enqueue(conn, settings, queues.INTERACTIVE, queues.TRANSCRIPTION, contract.to_payload(request), job_id,
                   timeout_s=1)
    terminal = _terminal(conn, job_id, timeout=60)
    assert terminal["type"] == "error" and terminal["data"]["code"] == "job_timeout"
    assert not spooled.exists()


# --- issue 29's probe findings, over real HTTP ----------------------------------------------------

QUICK = [{"role": "user", "content": "Say hi."}]


def _nested(depth: int):
    """A JSON value `depth` levels deep (arrays in arrays)."""
    value = 1
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
def test_a_body_nested_one_under_the_limit_or_in_utf16_gets_a_prompt_answer(api, encoding):
    body = {"model": MODEL, "messages": QUICK, "max_tokens": 1, "extra": _nested(30)}  # the body: 31 levels
    started = time.monotonic()
    response = api.post("/v1/chat/completions", content=json.dumps(body).encode(encoding),
                        headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1 and time.monotonic() - started < 30


@pytest.mark.parametrize("stream", [False, True])
def test_megabytes_of_text_in_a_chat_are_refused_before_the_worker_sees_them(api, stream):
    body = {"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": "hello world " * 700_000}]}
    started = time.monotonic()
    response = api.post("/v1/chat/completions", json=body, timeout=30)  # 8.4 MB: under the room for images
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large" and time.monotonic() - started < 10
