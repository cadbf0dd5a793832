"""Several MLX workers on one Redis, each dedicated to its models (`mlxq worker --models ...`): every job
goes to a worker that holds its model, and a model nobody serves is a clear 503."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
import pytest
import redis

from mlxq.cli import gunicorn_argv
from tests import speech_clips
from tests.conftest import free_port, wait_until
from tests.integration.conftest import Proc, service_env, stop_all

TEXT, SPEECH = "smollm2-135m", "whisper-tiny.en"


@pytest.fixture(scope="module")
def two_workers(redis_url, models_dir, tmp_path_factory):
    """A web tier and two workers, one for the text demo model, one for Whisper, on their own database."""
    url = redis_url.rsplit("/", 1)[0] + "/4"
    redis.Redis.from_url(url).flushdb()
    env = service_env(url, models_dir, tmp_path_factory.mktemp("spool"))
    port = free_port()
    procs = [Proc("worker-text", [sys.executable, "-m", "workers.main", "--name", "w-text", "--models", TEXT], env),
             Proc("worker-speech", [sys.executable, "-m", "workers.main", "--name", "w-speech", "--models", SPEECH],
                  env),
             Proc("web-two-workers", gunicorn_argv("127.0.0.1", port, 1), env)]
    for proc in procs:
        proc.start()
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)

    def both_up():
        assert all(p.alive() for p in procs), "\n".join(p.tail() for p in procs)
        try:
            states = api.get("/v1/admin/workers").json()["data"]
        except httpx.HTTPError:
            return False
        return {s["name"]: s["serves"] for s in states} == {"w-text": [TEXT], "w-speech": [SPEECH]} and states

    wait_until(both_up, 180, interval=0.3, what="both workers to be up")
    yield api, redis.Redis.from_url(url)
    api.close()
    stop_all(procs)


@pytest.fixture(scope="module")
def audio(tmp_path_factory) -> bytes:
    """A recording to transcribe: the first sentence of numbers.wav (~5 s; what is checked is where it ran)."""
    path = speech_clips.write(speech_clips.sentences("numbers", 0), tmp_path_factory.mktemp("audio") / "n.wav")
    return path.read_bytes()


def _chat(api, i: int) -> int:
    return api.post("/v1/chat/completions", json={"model": TEXT, "max_tokens": 3, "temperature": 0,
                                                  "messages": [{"role": "user", "content": f"Say {i}."}]}).status_code


def _transcribe(api, i: int, audio: bytes) -> int:
    return api.post("/v1/audio/transcriptions", data={"model": SPEECH},
                    files={"file": (f"n{i}.wav", audio)}).status_code


CHATS, TRANSCRIPTIONS = 4, 2
"""Calls sent at once: enough that both workers have work while the other's calls are queued (which is what
routing is about); each transcription costs seconds of a CPU shared with the text worker."""


def test_mixed_requests_each_go_to_the_worker_of_their_model(two_workers, audio):
    api, conn = two_workers
    calls = [partial(_chat, api, i) for i in range(CHATS)] + [partial(_transcribe, api, i, audio)
                                                              for i in range(TRANSCRIPTIONS)]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        statuses = list(pool.map(lambda call: call(), calls))
    assert statuses == [200] * len(calls)

    ran = {}
    for key in conn.scan_iter(match="rq:job:*", count=1000):
        job = conn.hgetall(key)
        if b"origin" in job and b"worker_name" in job:
            ran[key] = (job[b"origin"].decode(), job[b"worker_name"].decode())
    by_queue = {}
    for origin, worker in ran.values():
        by_queue.setdefault(origin, set()).add(worker)
    assert by_queue == {f"interactive@{TEXT}": {"w-text"}, f"interactive@{SPEECH}": {"w-speech"}}, by_queue
    assert sum(origin == f"interactive@{TEXT}" for origin, _ in ran.values()) == CHATS
    assert sum(origin == f"interactive@{SPEECH}" for origin, _ in ran.values()) == TRANSCRIPTIONS


def test_a_model_no_worker_serves_is_503(two_workers):
    api, conn = two_workers
    before = sorted(conn.scan_iter(match="rq:job:*", count=1000))
    response = api.post("/v1/chat/completions", json={"model": "shapes-vlm-toy", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_served" and error["param"] == "model"
    assert "shapes-vlm-toy" in error["message"] and TEXT in error["message"]
    assert response.headers["Retry-After"] == "5"
    assert sorted(conn.scan_iter(match="rq:job:*", count=1000)) == before  # nothing queued


def test_admin_load_goes_to_the_models_worker(two_workers):
    api, _ = two_workers
    response = api.post("/v1/admin/models/load", json={"model": SPEECH})
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["resident"]] == [SPEECH]  # w-speech answered, not w-text
    queues = {q["queue"] for q in api.get("/v1/admin/queues").json()["data"]}
    assert {f"interactive@{TEXT}", f"interactive@{SPEECH}"} <= queues
