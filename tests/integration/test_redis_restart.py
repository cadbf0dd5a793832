"""Redis restarts under the real service, with Redis run as `mlxq up` runs it (an append-only file).

Nothing accepted is lost: jobs queued when Redis goes down (a clean shutdown, then a kill -9) are all
there and done once it is back; a transcription running through the restart completes, with the same
text as an uninterrupted run. The worker rides it out (it used to exit on the first Redis error). A
stream open through a short restart gets every chunk and its [DONE] (it used to be cut); one started
while Redis is away is a 503.

Each outage lasts until the worker has run into it (every thread of it asleep between retries), then
Redis comes back: as long as the property needs, on a busy machine as on an idle one. How long an outage
the worker's retries cover (about a minute) is tests/workers/test_scheduler_outage.py's to check.
"""

from __future__ import annotations

import io
import json
import time
import wave
from pathlib import Path

import httpx
import pytest
import redis

from jobs import keys, workers
from jobs.events import read_log
from jobs.queues import fetch_job
from tests import speech_clips
from tests.conftest import REPO, RedisServer, wait_until
from tests.integration.conftest import Proc, Service

MODEL = "whisper-tiny.en"
CLIP = REPO / "tests" / "fixtures" / "speech" / "garden.wav"
TWO_WINDOWS = speech_clips.spaced([speech_clips.sentences("garden"), speech_clips.sentences("train_journey")], 31)
"""Two sentences 31 s apart: two speech pieces, so two windows (no 30 s window holds both), each of one sentence
(a window of 28 s of speech costs several times as much to decode, and proves no more)."""
ASLEEP_S = 0.5
"""How long every thread of the worker must sleep to count as waiting for Redis (a decoding worker
always has a thread running or waiting for a CPU)."""

MARKER = "mlxq-test-aof-marker"
"""A key written after the jobs: once the append-only file holds it, it holds them (one writer, in order)."""


@pytest.fixture(scope="module")
def durable_service(models_dir):
    """A durable Redis of its own and the service on it, shared by this module's tests; both go at the end.

    The web tier starts here, the worker when a test first needs it: the first test wants jobs queued
    with no worker, so the module pays for one worker start, not two.
    """
    server = RedisServer(durable=True).start()
    service = Service(server.url, models_dir)
    service.web.start()
    yield server, service
    service.stop()
    server.stop()


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, str]:
    """The text of an uninterrupted transcription of TWO_WINDOWS, once a test of this module has one: jobs
    queued before the restarts run with Redis up throughout, so the first test's makes the second test's
    reference without a run of its own (a test run alone makes its own)."""
    return {}


@pytest.fixture()
def no_worker(durable_service):
    """The module's Redis and web tier up, no worker: queued jobs stay queued."""
    server, service = durable_service
    if server.process.poll() is not None:  # a test that failed halfway may have left it down
        server.start()
    service.worker.stop()
    service.wait_web()
    return server, service


@pytest.fixture()
def durable(durable_service):
    """The module's Redis and whole service, up, the worker beating again since the last outage."""
    server, service = durable_service
    if server.process.poll() is not None:
        server.start()
    if not service.worker.alive():
        service.worker.start()
    service.wait_ready()
    _wait_beat(redis.Redis.from_url(server.url), service.worker)
    return server, service


def _wait_beat(conn: redis.Redis, worker: Proc) -> None:
    """Wait until the worker's heartbeat next sets its liveness key.

    Right after an outage the key may be near its expiry: a second outage would then outlast it. Each test
    starts from a fresh beat (after a failed beat the worker tries again every 0.1 s: tests/workers/test_heartbeat.py).
    """
    key = keys.worker_alive(next(s["name"] for s in workers.states(conn) if s["pid"] == worker.process.pid))
    before = conn.pttl(key)
    wait_until(lambda: conn.pttl(key) > before, 30, interval=0.05, what="the worker's next heartbeat")


def _transcribe_async(api: httpx.Client, name: str, content: bytes) -> str:
    response = api.post("/v1/jobs/transcriptions", data={"model": MODEL}, files={"file": (name, content)})
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
    return wait_until(ended, timeout, interval=0.2, what=f"job {job_id} to end")


def _asleep(pid: int) -> bool:
    """Whether every thread of the process sleeps (state S): none runs, none waits for a CPU."""
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):  # a thread that just ended
            continue
    return bool(states) and all(state == "S" for state in states)


def _wait_blocked_on_redis(worker: Proc, timeout: float = 120) -> None:
    """Wait until the worker, with work in progress and Redis away, has run into the outage: all its
    threads asleep for ASLEEP_S (its scheduler between two retries of a Redis command)."""
    since: list[float] = []

    def blocked() -> bool:
        if not worker.alive():
            raise AssertionError(f"the worker exited during the outage:\n{worker.tail()}")
        if not _asleep(worker.process.pid):
            since.clear()
            return False
        since[:] = since or [time.monotonic()]
        return time.monotonic() - since[0] >= ASLEEP_S
    wait_until(blocked, timeout, interval=0.02, what="the worker to wait for Redis")


def _ended_after(conn: redis.Redis, job_id: str, moment: float) -> bool:
    """Whether the worker ended the job after `moment` (a time.time()): it ran through what happened then."""
    # The worker ends the RQ job just after the terminal event is out (the answer first).
    ended_at = wait_until(lambda: fetch_job(conn, job_id).ended_at, 30, what=f"RQ to record the end of {job_id}")
    return ended_at.timestamp() > moment


def _clip(path: Path, seconds: float) -> bytes:
    """The first `seconds` of a WAV fixture, as WAV bytes."""
    out = io.BytesIO()
    with wave.open(str(path)) as src, wave.open(out, "wb") as dst:
        dst.setparams(src.getparams())
        dst.writeframes(src.readframes(int(seconds * src.getframerate())))
    return out.getvalue()


def _wav(clip: speech_clips.Clip) -> bytes:
    """A clip as WAV bytes."""
    out = io.BytesIO()
    with wave.open(out, "wb") as dst:
        dst.setnchannels(1), dst.setsampwidth(2), dst.setframerate(speech_clips.SAMPLE_RATE)
        dst.writeframes(clip.samples.tobytes())
    return out.getvalue()


def _in_append_only_file(server: RedisServer, needle: str) -> bool:
    """Whether Redis has written `needle` to its append-only files (what a kill -9 of it keeps)."""
    return any(needle.encode() in path.read_bytes() for path in Path(server.dir).rglob("*") if path.is_file())


@pytest.mark.timeout(600)
def test_jobs_queued_before_a_clean_restart_and_a_kill_9_are_all_done_after_them(no_worker, uninterrupted):
    server, service = no_worker
    # What is kept is the queue, whatever the jobs hold: a 4 s recording is as good as a long one. The first
    # transcription is the next test's recording: its text, once done, is that test's uninterrupted reference.
    clip = _clip(CLIP, 4)
    with httpx.Client(base_url=service.base_url, timeout=60) as api:
        def queue_some(name: str, audio: bytes) -> list[str]:
            return [_transcribe_async(api, name, audio)] + [_chat_async(api) for _ in range(2)]

        before_shutdown = queue_some("two-windows.wav", _wav(TWO_WINDOWS))
        server.halt()  # a clean shutdown, as a restart does
        server.start()
        before_kill = queue_some(CLIP.name, clip)
        client = redis.Redis.from_url(server.url)
        client.set(MARKER, 1)
        # appendfsync everysec acknowledges a write before it reaches the file (by up to 2 s when a sync
        # lags); what a kill -9 of the process keeps is what the file holds.
        wait_until(lambda: _in_append_only_file(server, MARKER), 30, interval=0.05,
                   what="the append-only file to hold the jobs")
        client.close()
        server.halt(kill=True)
        server.start()
        service.worker.start()
        records = [_finished(api, job_id) for job_id in before_shutdown + before_kill]
    assert [r["status"] for r in records] == ["succeeded"] * len(records), records
    uninterrupted["text"] = records[0]["result"]["text"]


@pytest.mark.timeout(600)
def test_a_restart_during_a_transcription_changes_nothing_in_its_result(durable, uninterrupted):
    server, service = durable
    audio = _wav(TWO_WINDOWS)  # two windows; Redis goes down between them
    conn = redis.Redis.from_url(server.url)
    with httpx.Client(base_url=service.base_url, timeout=60) as api:
        if "text" not in uninterrupted:
            reference = _finished(api, _transcribe_async(api, "two-windows.wav", audio))
            assert reference["status"] == "succeeded", reference
            uninterrupted["text"] = reference["result"]["text"]
        job_id = _transcribe_async(api, "two-windows.wav", audio)
        seen = wait_until(lambda: [e["data"]["segment"] for e in read_log(conn, job_id) if e["type"] == "segment"],
                          120, interval=0.02, what="the first window's segments")
        halted_at = time.time()
        server.halt()  # a clean shutdown, as a restart does
        _wait_blocked_on_redis(service.worker)
        server.start()
        record = _finished(api, job_id)
    assert service.worker.alive(), service.worker.tail()
    assert record["status"] == "succeeded", record
    assert _ended_after(conn, job_id, halted_at), "the job ended before the restart: it proves nothing"
    # Redis went down between the windows: the second sentence (31 s after the first) was decoded after it.
    assert all(seg["start"] < 30 for seg in seen) and record["result"]["segments"][-1]["start"] > 30, (seen, record)
    assert record["result"]["text"] == uninterrupted["text"] and uninterrupted["text"].strip()


@pytest.mark.timeout(300)
def test_a_stream_rides_out_a_short_restart_and_one_started_meanwhile_is_a_503(durable):
    server, service = durable
    # 24 tokens (17 words): a stream still going when Redis goes down, at a few tokens a second on a busy machine.
    body = {"model": "smollm2-135m", "max_tokens": 24, "temperature": 0, "stream": True,
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
            halted_at = time.time()
            server.halt()  # a clean shutdown, as a restart does
            refused = api.post("/v1/chat/completions", json=body)
            _wait_blocked_on_redis(service.worker)  # the outage itself: the stream must carry on through it
            server.start()
            data += [line[6:] for line in lines if line.startswith("data: ")]
    assert refused.status_code == 503 and refused.headers["Retry-After"], refused.text
    assert refused.json()["error"]["code"] == "queue_unavailable"
    assert data[-1] == "[DONE]", data[-3:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    conn = redis.Redis.from_url(server.url)
    assert _ended_after(conn, chunks[0]["id"], halted_at), "the stream ended before the restart: it proves nothing"
    # Every chunk arrived, in order: the text is all the worker generated, to its last token.
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    logged = read_log(conn, chunks[0]["id"])
    assert text == "".join(e["data"]["text"] for e in logged if e["type"] == "delta")
    assert len(text.split()) > 10
