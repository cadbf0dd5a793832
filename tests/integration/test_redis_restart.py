"""Redis restarts under the real service, with Redis run as `mlxq up` runs it (an append-only file).

Nothing accepted is lost: jobs queued when Redis goes down are all there and done once it is back;
a transcription running through the restart completes, with the same text as an uninterrupted run.
The worker rides it out (it used to exit on the first Redis error). A stream open through a short
restart gets every chunk and its [DONE] (it used to be cut); one started while Redis is away is a 503.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from jobs.events import read_log
from tests.conftest import REPO, RedisServer, wait_until
from tests.integration.conftest import Service
from tests.long_audio import build

MODEL = "whisper-tiny.en"
CLIP = REPO / "tests" / "fixtures" / "speech" / "garden.wav"
OUTAGE_S = 10
"""How long Redis stays away: past redis-py's own retries (about 7 s: 1 + 2 + 4 s of backoff), well within the
worker's (about 70 s, jobs/connection.py)."""

BLIP_S = 1.5
"""A short outage (a quick restart), which a stream must ride out."""


@pytest.fixture(scope="module")
def durable_service(models_dir):
    """A durable Redis of its own and the service on it, shared by this module's tests; both go at the end."""
    server = RedisServer(durable=True).start()
    service = Service(server.url, models_dir).start()
    yield server, service
    service.stop()
    server.stop()


@pytest.fixture()
def durable(durable_service):
    """The module's Redis and service, both up (a test that failed halfway may have left either down)."""
    server, service = durable_service
    if server.process.poll() is not None:
        server.start()
    if not service.worker.alive():
        service.worker.start()
    service.wait_ready()
    return server, service


def _transcribe_async(api: httpx.Client, path) -> str:
    with open(path, "rb") as f:
        response = api.post("/v1/jobs/transcriptions", data={"model": MODEL}, files={"file": (path.name, f)})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _chat_async(api: httpx.Client) -> str:
    response = api.post("/v1/jobs/chat/completions", json={
        "model": "smollm2-135m", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _finished(api: httpx.Client, job_id: str, timeout: float = 300) -> dict:
    """Poll the job (riding out 503s while Redis is away) until it ends; return its record."""
    def ended():
        try:
            response = api.get(f"/v1/jobs/{job_id}")
        except httpx.HTTPError:
            return None
        if response.status_code == 503:
            return None
        assert response.status_code == 200, response.text
        return response.json() if response.json()["status"] in ("succeeded", "failed", "canceled") else None
    return wait_until(ended, timeout, interval=0.5, what=f"job {job_id} to end")


@pytest.mark.timeout(600)
def test_a_restart_during_a_transcription_changes_nothing_in_its_result(durable):
    server, service = durable
    audio = build(1)
    with httpx.Client(base_url=service.base_url, timeout=60) as api:
        reference = _finished(api, _transcribe_async(api, audio))
        assert reference["status"] == "succeeded"
        job_id = _transcribe_async(api, audio)
        wait_until(lambda: (api.get(f"/v1/jobs/{job_id}").json().get("progress") or {}).get("percent"), 120,
                   interval=0.2, what="the transcription to be under way")
        server.halt()  # a clean shutdown, as a restart does
        time.sleep(OUTAGE_S)
        server.start()
        record = _finished(api, job_id)
        assert service.worker.alive(), service.worker.tail()
        assert record["status"] == "succeeded", record
        assert record["result"]["text"] == reference["result"]["text"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kill", [False, True], ids=["shutdown", "kill-9"])
def test_jobs_queued_before_a_restart_are_all_done_after_it(durable, kill):
    server, service = durable
    service.worker.stop()  # nothing drains the queue: the jobs wait in Redis
    with httpx.Client(base_url=service.base_url, timeout=60) as api:
        # What is kept is the queue, whatever the jobs hold: a 15 s recording is as good as a long one.
        job_ids = [_transcribe_async(api, CLIP) for _ in range(2)] + [_chat_async(api) for _ in range(5)]
        time.sleep(1.5)  # the append-only file is synced every second
        server.halt(kill=kill)
        server.start()
        service.worker.start()
        for job_id in job_ids:
            assert _finished(api, job_id)["status"] == "succeeded"


@pytest.mark.timeout(300)
def test_a_stream_rides_out_a_short_restart_and_one_started_meanwhile_is_a_503(durable):
    server, service = durable
    body = {"model": "smollm2-135m", "max_tokens": 80, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon who bakes bread."}]}
    with httpx.Client(base_url=service.base_url, timeout=60) as api:
        with api.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            data: list[str] = []
            while len(data) < 3:
                line = next(lines)
                if line.startswith("data: "):
                    data.append(line[6:])
            server.halt()  # a clean shutdown, as a restart does
            refused = api.post("/v1/chat/completions", json=body)
            time.sleep(BLIP_S)  # the outage itself: the stream must carry on through it
            server.start()
            data += [line[6:] for line in lines if line.startswith("data: ")]
    assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
    assert refused.json()["error"]["code"] == "queue_unavailable"
    assert data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # Every chunk arrived, in order: the text is all the worker generated.
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    logged = read_log(redis.Redis.from_url(server.url), chunks[0]["id"])
    assert text == "".join(e["data"]["text"] for e in logged if e["type"] == "delta")
    assert len(text.split()) > 20
