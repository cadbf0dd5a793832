"""Chunked Whisper transcription and the transcription job, with the real tiny.en model, Redis and RQ.

Audio comes from the speech fixtures; longer files are concatenations made by bench/make_long_audio.py.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import wave

import jiwer
import mlx.core as mx
import pytest
from rq import SimpleWorker
from rq.executions import Execution
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from bench.make_long_audio import build, script_for
from jobs import keys, records
from jobs.events import read_log
from jobs.queues import BATCH, INTERACTIVE, TRANSCRIPTION, WEBHOOKS, get_queue
from jobs.settings import load_settings
from jobs.status import fetch_job
from jobs.store import ModelNotFound, resolve
from jobs.webhooks import delivery_id
from tests.conftest import REPO, wait_until
from workers import speech, tasks
from workers.engine import Runtime, default_loaders
from workers.recovery import MAX_ATTEMPTS, clean_spool, recover_batch_jobs

SPEECH = REPO / "tests" / "fixtures" / "speech"
MODEL = "whisper-tiny.en"
DEAD_WORKER = "mlxq-test-dead-worker"


def interactive_probe(payload: dict) -> dict:
    """An interactive job (run by the burst worker by name): stands for a chat call."""
    return {"ok": True}


def normalized(text: str) -> str:
    """Lowercase words without punctuation, for word error rates."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of `hypothesis` against `reference`, both normalized."""
    return jiwer.wer(normalized(reference), normalized(hypothesis))


@pytest.fixture(scope="module")
def runtime(redis_url, models_dir):
    """The worker's runtime (registry + engine) with the speech backend, installed for jobs."""
    runtime = Runtime.create(load_settings({"redis_url": redis_url, "models_dir": models_dir}),
                             loaders={**default_loaders(), "speech": speech.load})
    tasks.set_runtime(runtime)
    yield runtime
    tasks.set_runtime(None)


@pytest.fixture(scope="module")
def whisper(runtime):
    """The resident Whisper tiny.en model (from the store: `mlxq models pull-demo`)."""
    try:
        info = resolve(MODEL, runtime.settings)
    except ModelNotFound as exc:
        pytest.fail(f"{exc}\nImport the demo models first: mlxq models pull-demo")
    return runtime.warm(info).model


@pytest.fixture(scope="module")
def half_minute():
    """31 s: two fixtures, so two windows and one chunk boundary."""
    return build(0.5)


@pytest.fixture(scope="module")
def half_minute_text(runtime, whisper, half_minute):
    """The uninterrupted chunked transcript of `half_minute` (what every job run must reproduce)."""
    chunks = run_chunks(runtime, whisper, half_minute)
    return "".join(seg["text"] for chunk in chunks for seg in chunk.segments).strip()


def run_chunks(runtime, whisper, path) -> list[speech.ChunkResult]:
    """Transcribe a whole file with default options on the engine thread, uninterrupted."""
    return runtime.engine.call(lambda: list(speech.transcribe_chunks(whisper, path, speech.Options())))


def assert_timeline(segments: list[dict]) -> None:
    """Ids 0..n-1 in order; times increase and never overlap."""
    assert [seg["id"] for seg in segments] == list(range(len(segments)))
    for seg in segments:
        assert 0 <= seg["start"] < seg["end"]
    for before, after in zip(segments, segments[1:], strict=False):
        assert after["start"] >= before["end"] - 1e-6


@pytest.mark.timeout(900)  # two minutes of audio decoded; ~1 min with OpenBLAS, far longer with MLX's own BLAS
def test_chunked_transcript_matches_one_pass(runtime, whisper):
    path = build(1)
    started = time.monotonic()
    chunks = run_chunks(runtime, whisper, path)
    chunked_s = time.monotonic() - started
    segments = [seg for chunk in chunks for seg in chunk.segments]
    chunked = "".join(seg["text"] for seg in segments)
    started = time.monotonic()
    one_pass = runtime.engine.call(lambda: whisper.generate(str(path), fp16=whisper.dtype == mx.float16)).text
    one_pass_s = time.monotonic() - started
    vs_one_pass, vs_script = wer(one_pass, chunked), wer(script_for(path), chunked)
    print(f"\n1-minute file: {len(chunks)} chunks in {chunked_s:.1f}s (one pass {one_pass_s:.1f}s); "
          f"WER vs one pass {vs_one_pass:.3%}, vs script {vs_script:.3%} "
          f"(one pass vs script {wer(script_for(path), one_pass):.3%})")
    assert len(chunks) >= 3 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert vs_one_pass <= 0.02
    assert vs_script <= 0.20
    assert_timeline(segments)
    assert segments[-1]["end"] == pytest.approx(63.0, abs=3.0)
    for before, after in zip(chunks, chunks[1:], strict=False):  # each window starts where the last kept segment ended
        if before.segments:
            assert after.segments[0]["seek"] == before.state.seek == round(before.segments[-1]["end"] * 100)


def clip(source, target, seconds: float):
    """The first `seconds` of a fixture, as a WAV of its own."""
    with wave.open(str(source)) as src, wave.open(str(target), "wb") as out:
        out.setparams(src.getparams())
        out.writeframes(src.readframes(int(seconds * src.getframerate())))
    return target


def spool(settings, job_id: str, source) -> str:
    """Copy audio into the spool as the web tier does: <spool_dir>/<job_id>/<name>."""
    folder = settings.spool_dir / job_id
    folder.mkdir(parents=True)
    return str(shutil.copy(source, folder / os.path.basename(source)))


def payload(settings, job_id: str, source, mode: str = "async", **extra) -> dict:
    """The worker payload the web tier builds for an upload of `source`."""
    return {"job_id": job_id, "model": MODEL, "audio_path": spool(settings, job_id, source),
            "filename": os.path.basename(source), "language": None, "prompt": None, "temperature": 0.0,
            "word_timestamps": False, "mode": mode, "request_id": f"req-{job_id}", **extra}


def submit(conn, settings, job_id: str, source, webhook_url: str | None = None, **extra) -> dict:
    """Create the record and enqueue an async transcription on `batch`, as POST /v1/jobs does."""
    body = payload(settings, job_id, source, **extra)
    records.create(conn, settings, job_id, "transcription",
                   {"model": MODEL, "filename": body["filename"], "webhook_url": webhook_url,
                    "params": {"response_format": "json"}})
    get_queue(BATCH, conn).enqueue(TRANSCRIPTION, body, job_id=job_id, job_timeout=600)
    return body


def work(conn, queues=(INTERACTIVE, BATCH), **options) -> None:
    """Drain the queues with a real SimpleWorker in burst mode."""
    worker = SimpleWorker([get_queue(q, conn) for q in queues], connection=conn, serializer=JSONSerializer)
    worker.work(burst=True, **options)


def when_running(conn, job_id: str, action) -> threading.Thread:
    """Do `action()` as soon as the job's record says running (from another thread)."""
    def watch():
        """Poll the record, then act."""
        wait_until(lambda: (records.get(conn, job_id) or {}).get("status") == "running", 120, 0.005,
                   what=f"{job_id} to run")
        action()
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def events(conn, job_id: str, kind: str | None = None) -> list[dict]:
    """The job's logged events (of one type, if given)."""
    return [e for e in read_log(conn, job_id) if kind is None or e["type"] == kind]


def assert_succeeded(conn, job_id: str) -> dict:
    """The job ended once, with `done`, its segments published exactly once, its record succeeded."""
    log = events(conn, job_id)
    assert [e["type"] for e in log].count("done") == 1 and log[-1]["type"] == "done"
    assert not [e for e in log if e["type"] == "error"]
    result = log[-1]["data"]["result"]
    assert [e["data"]["segment"] for e in log if e["type"] == "segment"] == result["segments"]
    assert_timeline(result["segments"])
    progress = [e["data"]["done_s"] for e in log if e["type"] == "progress"]
    assert progress == sorted(progress) and progress[-1] == result["duration"]
    record = records.get(conn, job_id)
    assert record["status"] == "succeeded" and record["progress"]["percent"] == 100.0
    assert records.get_result(conn, job_id) == result
    assert not conn.exists(records.checkpoint_key(job_id))
    return result


def test_sync_job_with_word_timestamps(redis_conn, settings, runtime, whisper):
    job_id = "sync-weather"
    body = payload(settings, job_id, SPEECH / "weather.ogg", mode="sync", word_timestamps=True)
    get_queue(INTERACTIVE, redis_conn).enqueue(TRANSCRIPTION, body, job_id=job_id)
    work(redis_conn)
    log = events(redis_conn, job_id)
    assert log[-1]["type"] == "done"
    result = log[-1]["data"]["result"]
    assert result["task"] == "transcribe" and result["language"] == "english"
    assert result["duration"] == pytest.approx(15.54, abs=0.05)
    assert wer((SPEECH / "weather.txt").read_text(), result["text"]) <= 0.2
    words = result["words"]
    assert len(words) >= 30 and all(w["word"] == w["word"].strip() and w["start"] <= w["end"] for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)
    segment_events = [e["data"] for e in log if e["type"] == "segment"]
    assert [w for e in segment_events for w in e["words"]] == words
    for event in segment_events:
        seg = event["segment"]
        assert all(seg["start"] - 0.5 <= w["start"] <= w["end"] <= seg["end"] + 0.5 for w in event["words"])
    assert records.get(redis_conn, job_id) is None  # sync calls have no job record
    assert fetch_job(redis_conn, job_id).get_status() == JobStatus.FINISHED


def test_async_job_yields_to_interactive_work(redis_conn, settings, runtime, whisper, half_minute,
                                              half_minute_text, tmp_path):
    short = clip(SPEECH / "garden.wav", tmp_path / "short.wav", 3.0)
    submit(redis_conn, settings, "job-long", half_minute, webhook_url="http://127.0.0.1:9/hook")
    submit(redis_conn, settings, "job-next", short)
    probe = get_queue(INTERACTIVE, redis_conn)
    watcher = when_running(redis_conn, "job-long", lambda: probe.enqueue(f"{__name__}.interactive_probe", {},
                                                                         job_id="chat-probe"))
    work(redis_conn)
    watcher.join(5)
    first, continuation = fetch_job(redis_conn, "job-long"), fetch_job(redis_conn, "job-long_1")
    chat, following = fetch_job(redis_conn, "chat-probe"), fetch_job(redis_conn, "job-next")
    assert first.return_value()["status"] == "yielded" and continuation is not None
    assert first.ended_at <= chat.started_at <= chat.ended_at <= continuation.started_at  # chat went first
    assert continuation.ended_at <= following.started_at  # and the yielded job kept its place in batch
    result = assert_succeeded(redis_conn, "job-long")
    assert result["text"] == half_minute_text
    assert records.get(redis_conn, "job-long")["attempts"] == 1
    assert fetch_job(redis_conn, delivery_id("job-long")).origin == WEBHOOKS
    assert_succeeded(redis_conn, "job-next")


def test_cancel_flag_cancels_the_job(redis_conn, settings, runtime, whisper, half_minute):
    submit(redis_conn, settings, "job-cancel", half_minute)
    watcher = when_running(redis_conn, "job-cancel",
                           lambda: redis_conn.set(keys.cancel_flag("job-cancel"), 1, ex=60))
    work(redis_conn)
    watcher.join(5)
    log = events(redis_conn, "job-cancel")
    assert log[-1]["type"] == "error" and "done" not in [e["type"] for e in log]
    assert log[-1]["data"]["code"] == "canceled" and log[-1]["data"]["status"] == 499
    record = records.get(redis_conn, "job-cancel")
    assert record["status"] == "canceled" and record["error"]["code"] == "canceled"
    assert fetch_job(redis_conn, "job-cancel").get_status() == JobStatus.FAILED


def leave_started_by_dead_worker(conn, rq_id: str) -> None:
    """Take an RQ job off its queue and mark it started by a worker that no longer exists."""
    job = fetch_job(conn, rq_id)
    get_queue(BATCH, conn).remove(job)
    with conn.pipeline() as pipe:
        job.prepare_for_execution(DEAD_WORKER, pipe)
        Execution.create(job, ttl=600, pipeline=pipe, worker_name=DEAD_WORKER)
        pipe.execute()


def test_resume_from_checkpoint_after_worker_death(redis_conn, settings, runtime, whisper, half_minute,
                                                   half_minute_text):
    submit(redis_conn, settings, "job-crash", half_minute)
    get_queue(INTERACTIVE, redis_conn).enqueue(f"{__name__}.interactive_probe", {}, job_id="chat-waiting")
    work(redis_conn, queues=(BATCH,), max_jobs=1)  # one chunk, then it yields (a chat is waiting)
    assert redis_conn.hexists(records.checkpoint_key("job-crash"), "state")
    published = len(events(redis_conn, "job-crash", "segment"))
    assert published > 0
    leave_started_by_dead_worker(redis_conn, "job-crash_1")  # its worker died in the next chunk
    assert recover_batch_jobs(redis_conn, settings) == ["job-crash"]
    assert get_queue(BATCH, redis_conn).job_ids == ["job-crash_2"]
    assert fetch_job(redis_conn, "job-crash_1").get_status() == JobStatus.FAILED
    record = records.load(redis_conn, "job-crash")
    assert record["attempts"] == 2 and record["rq_job_id"] == "job-crash_2"
    work(redis_conn)
    result = assert_succeeded(redis_conn, "job-crash")
    assert result["text"] == half_minute_text


def test_recovery_gives_up_after_max_attempts(redis_conn, settings):
    body = {"job_id": "job-doomed", "model": MODEL, "audio_path": "/nonexistent.wav", "mode": "async",
            "resume": True}
    records.create(redis_conn, settings, "job-doomed", "transcription",
                   {"model": MODEL, "webhook_url": "http://127.0.0.1:9/hook"})
    records.update(redis_conn, "job-doomed", attempts=MAX_ATTEMPTS, rq_job_id="job-doomed_4")
    get_queue(BATCH, redis_conn).enqueue(TRANSCRIPTION, body, job_id="job-doomed_4")
    leave_started_by_dead_worker(redis_conn, "job-doomed_4")
    assert recover_batch_jobs(redis_conn, settings) == ["job-doomed"]
    error = events(redis_conn, "job-doomed")[-1]
    assert error["type"] == "error"
    assert error["data"] == {"message": f"the job crashed the worker {MAX_ATTEMPTS} times",
                             "code": "worker_crashed", "status": 500}
    record = records.get(redis_conn, "job-doomed")
    assert record["status"] == "failed" and record["error"]["code"] == "worker_crashed"
    assert get_queue(BATCH, redis_conn).count == 0
    assert fetch_job(redis_conn, delivery_id("job-doomed")) is not None


def test_recovery_leaves_live_workers_alone(redis_conn, settings):
    get_queue(BATCH, redis_conn).enqueue(TRANSCRIPTION, {"job_id": "job-fine"}, job_id="job-fine")
    leave_started_by_dead_worker(redis_conn, "job-fine")
    redis_conn.set(keys.worker_alive(DEAD_WORKER), "{}", ex=60)  # ...which is alive after all
    assert recover_batch_jobs(redis_conn, settings) == []
    assert fetch_job(redis_conn, "job-fine").get_status() == JobStatus.STARTED


def test_undecodable_audio_fails_with_400(redis_conn, settings, runtime, tmp_path):
    fake = tmp_path / "notes.wav"
    fake.write_text("not audio at all\n" * 100)
    submit(redis_conn, settings, "job-bad", fake)
    work(redis_conn)
    error = events(redis_conn, "job-bad")[-1]
    assert error["type"] == "error" and error["data"]["code"] == "invalid_audio"
    assert error["data"]["status"] == 400 and error["data"]["message"].startswith("not an audio file")
    assert records.get(redis_conn, "job-bad")["error"]["code"] == "invalid_audio"


def test_unknown_model_fails_with_404(redis_conn, settings, runtime):
    submit(redis_conn, settings, "job-nomodel", SPEECH / "garden.wav", model="no-such-whisper")
    work(redis_conn)
    error = events(redis_conn, "job-nomodel")[-1]
    assert error["type"] == "error" and error["data"]["code"] == "model_not_found"
    assert error["data"]["status"] == 404


def test_clean_spool(redis_conn, settings):
    now = time.time()
    long_ago = now - settings.result_ttl_s - 60
    folders = {name: settings.spool_dir / name for name in ("job-old", "job-running", "job-recent",
                                                             "sync-orphan", "sync-fresh")}
    for folder in folders.values():
        folder.mkdir(parents=True)
        (folder / "audio.wav").write_bytes(b"RIFF")
    partial = settings.spool_dir / ".upload-abc"
    partial.write_bytes(b"x")
    for job_id in ("job-old", "job-running", "job-recent"):
        records.create(redis_conn, settings, job_id, "transcription", {"model": MODEL})
    records.set_status(redis_conn, settings, "job-old", records.SUCCEEDED)
    records.update(redis_conn, "job-old", finished_at=long_ago)
    records.set_status(redis_conn, settings, "job-recent", records.FAILED)
    records.update(redis_conn, "job-running", created_at=long_ago, status="running")
    for path in (folders["sync-orphan"], partial):
        os.utime(path, (long_ago, long_ago))
    removed = clean_spool(settings, now=now)
    assert sorted(p.name for p in removed) == [".upload-abc", "job-old", "sync-orphan"]
    assert sorted(p.name for p in settings.spool_dir.iterdir()) == ["job-recent", "job-running", "sync-fresh"]


def test_decoding_stops_at_the_duration_limit_whatever_the_header_said(runtime, whisper):
    # The probe at upload checks the declared length; a file running past it is cut off while decoding.
    options = speech.Options(max_duration_s=10)
    with pytest.raises(speech.AudioError) as refused:
        runtime.engine.call(lambda: list(speech.transcribe_chunks(whisper, SPEECH / "garden.wav", options)))
    assert refused.value.reason == "too_long" and "past 10 s" in str(refused.value)
    chunks = runtime.engine.call(lambda: list(speech.transcribe_chunks(
        whisper, SPEECH / "garden.wav", speech.Options(max_duration_s=15))))  # 14.96 s: within the limit
    assert chunks[-1].finished
