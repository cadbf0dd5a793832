"""Chunked Whisper transcription and transcription jobs, with the real tiny.en model, Redis, RQ and scheduler.

Audio comes from the speech fixtures (tests/speech_clips.py): two recordings back to back where a window
must be cut through speech, two sentences far apart where a job only needs two windows.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
import wave

import jiwer
import mlx.core as mx
import numpy as np
import pytest
from rq.executions import Execution
from rq.job import JobStatus

from jobs import contract, keys, records
from jobs.events import read_log
from jobs.queues import (
    BATCH,
    CHAT_COMPLETION,
    INTERACTIVE,
    TRANSCRIPTION,
    WEBHOOKS,
    enqueue,
    fetch_job,
    get_queue,
)
from jobs.store import resolve
from jobs.webhooks import delivery_id
from tests.conftest import REPO
from tests.speech_clips import Clip, sentences, spaced, write
from workers import admission
from workers.backends import whisper
from workers.recovery import MAX_ATTEMPTS, clean_spool, recover
from workers.scheduler import Scheduler

SPEECH = REPO / "tests" / "fixtures" / "speech"
MODEL = "whisper-tiny.en"
DEAD_WORKER = "mlxq-test-dead-worker"


def normalized(text: str) -> str:
    """Lowercase words without punctuation, for word error rates."""
    return " ".join(re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of `hypothesis` against `reference`, both normalized."""
    return jiwer.wer(normalized(reference), normalized(hypothesis))


@pytest.fixture(scope="module")
def worker_parts(text_worker_parts):
    """The session's model manager and backends (models stay loaded; the chat probe's text model too)."""
    return text_worker_parts


@pytest.fixture(scope="module")
def ref(whisper_ref) -> contract.ModelRef:
    """Whisper tiny.en as a request carries it."""
    return whisper_ref


@pytest.fixture(scope="module")
def model(whisper_model):
    """The resident Whisper model (the session's: one load for every speech module)."""
    return whisper_model


@pytest.fixture(scope="module")
def half_minute(tmp_path_factory):
    """37 s: two sentences 26 s apart, so two speech pieces: two windows, a checkpoint between them."""
    # Far enough apart that the detector cannot merge them into one piece (at most 30 s); a sentence each,
    # not a 15 s recording each: a window's decoding is what a job test pays for, its length proves nothing.
    clip = spaced([sentences("garden", 2), sentences("train_journey", 2)], gap_s=26.0)
    return write(clip, tmp_path_factory.mktemp("speech") / "half-minute.wav")


@pytest.fixture(scope="module")
def half_minute_text(model, half_minute):
    """The uninterrupted chunked transcript of `half_minute` (what every job run must reproduce)."""
    return "".join(seg["text"] for chunk in run_chunks(model, half_minute) for seg in chunk.segments).strip()


def run_chunks(model, path, options: whisper.Options | None = None) -> list[whisper.ChunkResult]:
    """Transcribe a whole file window by window, uninterrupted."""
    return list(whisper.transcribe_chunks(model, path, options or whisper.Options()))


def assert_timeline(segments: list[dict]) -> None:
    """Ids 0..n-1 in order; times increase and never overlap."""
    assert [seg["id"] for seg in segments] == list(range(len(segments)))
    for seg in segments:
        assert 0 <= seg["start"] < seg["end"]
    for before, after in zip(segments, segments[1:], strict=False):
        assert after["start"] >= before["end"] - 1e-6


def test_chunked_transcript_matches_one_pass(model, tmp_path):
    # Two sentences that start 26 s in, just over one window: two windows, so a seam cut through speech (the
    # second sentence), which is what is compared (a longer file only repeats the seam: a minute took twice as
    # long to show the same; speech before the seam too only doubled the words to decode, twice; a whole
    # recording after 20 s only added a sentence past the seam to decode, on both paths).
    speech = spaced([Clip(np.zeros(26 * 16000, np.int16), ""), sentences("train_journey", 0, 2)], gap_s=0.0)
    path, length_s = write(speech, tmp_path / "continuous.wav"), speech.duration_s
    assert length_s > 30.0  # Whisper's window
    started = time.monotonic()
    # Every window decoded (no voice activity detection): Whisper's own seams, window after window.
    chunks = run_chunks(model, path, whisper.Options(vad=False))
    chunked_s = time.monotonic() - started
    segments = [seg for chunk in chunks for seg in chunk.segments]
    chunked = "".join(seg["text"] for seg in segments)
    started = time.monotonic()
    one_pass = model.generate(str(path), fp16=model.dtype == mx.float16).text
    one_pass_s = time.monotonic() - started
    vs_one_pass, vs_script = wer(one_pass, chunked), wer(speech.text, chunked)
    print(f"\n{length_s:.0f} s file: {len(chunks)} chunks in {chunked_s:.1f}s (one pass {one_pass_s:.1f}s); "
          f"WER vs one pass {vs_one_pass:.3%}, vs script {vs_script:.3%} "
          f"(one pass vs script {wer(speech.text, one_pass):.3%})")
    assert len(chunks) >= 2 and chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert vs_one_pass <= 0.02
    assert vs_script <= 0.20
    assert_timeline(segments)
    assert segments[-1]["end"] == pytest.approx(length_s, abs=3.0)
    for before, after in zip(chunks, chunks[1:], strict=False):  # each window starts where the last kept segment ended
        if before.segments:
            assert after.segments[0]["seek"] == before.state.seek == round(before.segments[-1]["end"] * 100)


def clip(source, target, seconds: float):
    """The first `seconds` of a fixture, as a WAV of its own."""
    with wave.open(str(source)) as src, wave.open(str(target), "wb") as out:
        out.setparams(src.getparams())
        out.writeframes(src.readframes(int(seconds * src.getframerate())))
    return target


def request_for(settings, ref, job_id: str, source, is_async: bool = True, **extra) -> contract.TranscriptionRequest:
    """The request the web tier builds for an upload of `source` (copied into the spool as it does)."""
    folder = settings.spool_dir / job_id
    folder.mkdir(parents=True)
    path = shutil.copy(source, folder / os.path.basename(source))
    return contract.TranscriptionRequest(job_id, extra.pop("model", ref), str(path), os.path.basename(source),
                                         is_async=is_async, request_id=f"req-{job_id}", **extra)


def submit(conn, settings, ref, job_id: str, source, webhook_url: str | None = None, **extra):
    """Create the record and enqueue an async transcription on `batch`, as POST /v1/jobs does."""
    request = request_for(settings, ref, job_id, source, **extra)
    records.create(conn, settings, job_id, "transcription",
                   {"model": MODEL, "filename": request.filename, "webhook_url": webhook_url,
                    "params": {"response_format": "json"}})
    enqueue(conn, settings, BATCH, TRANSCRIPTION, contract.to_payload(request), job_id, timeout_s=600)
    return request


def scheduler(conn, settings, worker_parts, name: str | None = None) -> Scheduler:
    """A burst-mode scheduler on the test Redis with the module's models."""
    models, backends = worker_parts
    return Scheduler(conn, settings, models, backends, name or f"test-{uuid.uuid4().hex[:6]}", burst=True)


def work(conn, settings, worker_parts) -> None:
    """Drain the queues with the worker's scheduler in burst mode."""
    scheduler(conn, settings, worker_parts).run()


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
    assert not conn.exists(keys.checkpoint_key(job_id))
    return result


def test_sync_job_with_word_timestamps(redis_conn, settings, ref, worker_parts, tmp_path):
    coat = sentences("weather", 2)  # one sentence, in Ogg: a compressed upload decoded as the web tier spools it
    audio = write(coat, tmp_path / "coat.ogg")
    request = request_for(settings, ref, "sync-weather", audio, is_async=False, word_timestamps=True)
    enqueue(redis_conn, settings, INTERACTIVE, TRANSCRIPTION, contract.to_payload(request), request.id)
    work(redis_conn, settings, worker_parts)
    log = events(redis_conn, request.id)
    assert log[-1]["type"] == "done"
    result = log[-1]["data"]["result"]
    assert result["task"] == "transcribe" and result["language"] == "english"
    assert result["duration"] == pytest.approx(coat.duration_s, abs=0.05)
    assert wer(coat.text, result["text"]) <= 0.2
    words = result["words"]
    assert len(words) >= len(coat.text.split()) - 3
    assert all(w["word"] == w["word"].strip() and w["start"] <= w["end"] for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)
    segment_events = [e["data"] for e in log if e["type"] == "segment"]
    assert [w for e in segment_events for w in e["words"]] == words
    for event in segment_events:
        seg = event["segment"]
        assert all(seg["start"] - 0.5 <= w["start"] <= w["end"] <= seg["end"] + 0.5 for w in event["words"])
    assert records.get(redis_conn, request.id) is None  # sync calls have no job record
    assert fetch_job(redis_conn, request.id).get_status() == JobStatus.FINISHED
    assert not (settings.spool_dir / request.id).exists()  # the upload went with the job


def _chat(settings, job_id: str) -> dict:
    """A one-token chat request: what stands for interactive work here."""
    info = resolve("smollm2-135m", settings)
    ref = contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)
    return contract.to_payload(contract.TextRequest(job_id, ref, contract.Sampling(max_tokens=1),
                                                    messages=[{"role": "user", "content": "Hi"}]))


def test_a_long_job_lets_interactive_work_go_first_and_then_carries_on(redis_conn, settings, ref, worker_parts,
                                                                         half_minute, half_minute_text, tmp_path,
                                                                         monkeypatch):
    # The chat's own steps (a prompt turn, then its token) must not hand the next window its turn on a
    # slow machine: what is tested is that it goes between two windows, not the turn's length.
    monkeypatch.setattr(admission, "SPEECH_TURN_S", 60.0)
    short = clip(SPEECH / "garden.wav", tmp_path / "short.wav", 3.0)
    submit(redis_conn, settings, ref, "job-long", half_minute, webhook_url="http://127.0.0.1:9/hook")
    submit(redis_conn, settings, ref, "job-next", short)
    run = scheduler(redis_conn, settings, worker_parts)
    assert run.step()  # job-long starts and decodes its first window
    assert events(redis_conn, "job-long", "segment") and records.get(redis_conn, "job-long")["status"] == "running"
    enqueue(redis_conn, settings, INTERACTIVE, CHAT_COMPLETION, _chat(settings, "chat-probe"), "chat-probe")
    run.run()
    first, chat, following = (fetch_job(redis_conn, j) for j in ("job-long", "chat-probe", "job-next"))
    assert first.started_at <= chat.started_at <= chat.ended_at <= first.ended_at  # chat went between two windows
    assert first.ended_at <= following.started_at  # and the long job kept its place in batch
    result = assert_succeeded(redis_conn, "job-long")
    assert result["text"] == half_minute_text
    assert records.get(redis_conn, "job-long")["attempts"] == 1
    assert fetch_job(redis_conn, delivery_id("job-long")).origin == WEBHOOKS
    assert_succeeded(redis_conn, "job-next")


def test_cancel_flag_cancels_the_job(redis_conn, settings, ref, worker_parts, half_minute):
    submit(redis_conn, settings, ref, "job-cancel", half_minute)
    run = scheduler(redis_conn, settings, worker_parts)
    run.step()
    redis_conn.set(keys.cancel_flag("job-cancel"), 1, ex=60)
    run.run()
    log = events(redis_conn, "job-cancel")
    assert log[-1]["type"] == "error" and "done" not in [e["type"] for e in log]
    assert log[-1]["data"]["code"] == "canceled" and log[-1]["data"]["status"] == 499
    record = records.get(redis_conn, "job-cancel")
    assert record["status"] == "canceled" and record["error"]["code"] == "canceled"
    assert fetch_job(redis_conn, "job-cancel").get_status() == JobStatus.FAILED
    assert not (settings.spool_dir / "job-cancel").exists()


def test_resume_from_checkpoint_after_worker_death(redis_conn, settings, ref, worker_parts, half_minute,
                                                   half_minute_text):
    submit(redis_conn, settings, ref, "job-crash", half_minute)
    scheduler(redis_conn, settings, worker_parts, name=DEAD_WORKER).step()  # one window, then its worker "dies"
    assert redis_conn.hexists(keys.checkpoint_key("job-crash"), "state")
    assert events(redis_conn, "job-crash", "segment")
    assert recover(redis_conn, settings, own_name="a-live-worker") == ["job-crash"]
    assert get_queue(BATCH, redis_conn).job_ids == ["job-crash_1"]
    assert fetch_job(redis_conn, "job-crash").get_status() == JobStatus.FAILED
    record = records.load(redis_conn, "job-crash")
    assert record["attempts"] == 2 and record["rq_job_id"] == "job-crash_1"
    work(redis_conn, settings, worker_parts)
    result = assert_succeeded(redis_conn, "job-crash")
    assert result["text"] == half_minute_text


def leave_started_by_dead_worker(conn, rq_id: str) -> None:
    """Take an RQ job off its queue and mark it started by a worker that no longer exists."""
    job = fetch_job(conn, rq_id)
    get_queue(BATCH, conn).remove(job)
    with conn.pipeline() as pipe:
        job.prepare_for_execution(DEAD_WORKER, pipe)
        Execution.create(job, ttl=600, pipeline=pipe, worker_name=DEAD_WORKER)
        pipe.execute()


def test_recovery_gives_up_after_max_attempts(redis_conn, settings, ref):
    request = contract.TranscriptionRequest("job-doomed", ref, "/nonexistent.wav", is_async=True, resume=True,
                                            attempts=MAX_ATTEMPTS)
    records.create(redis_conn, settings, "job-doomed", "transcription",
                   {"model": MODEL, "webhook_url": "http://127.0.0.1:9/hook"})
    records.update(redis_conn, "job-doomed", attempts=MAX_ATTEMPTS, rq_job_id="job-doomed_4")
    enqueue(redis_conn, settings, BATCH, TRANSCRIPTION, contract.to_payload(request), "job-doomed_4")
    leave_started_by_dead_worker(redis_conn, "job-doomed_4")
    assert recover(redis_conn, settings, own_name="a-live-worker") == ["job-doomed"]
    error = events(redis_conn, "job-doomed")[-1]
    assert error["type"] == "error"
    assert error["data"] == {"message": f"the job crashed the worker {MAX_ATTEMPTS} times",
                             "code": "worker_crashed", "status": 500}
    record = records.get(redis_conn, "job-doomed")
    assert record["status"] == "failed" and record["error"]["code"] == "worker_crashed"
    assert get_queue(BATCH, redis_conn).count == 0
    assert fetch_job(redis_conn, delivery_id("job-doomed")) is not None


def test_recovery_leaves_live_workers_alone(redis_conn, settings):
    enqueue(redis_conn, settings, BATCH, TRANSCRIPTION, {"id": "job-fine"}, "job-fine")
    leave_started_by_dead_worker(redis_conn, "job-fine")
    redis_conn.set(keys.worker_alive(DEAD_WORKER), "{}", ex=60)  # ...which is alive after all
    assert recover(redis_conn, settings, own_name="a-live-worker") == []
    assert fetch_job(redis_conn, "job-fine").get_status() == JobStatus.STARTED


def test_a_file_that_is_not_audio_fails_with_415(redis_conn, settings, ref, worker_parts, tmp_path):
    fake = tmp_path / "notes.wav"
    fake.write_text("not audio at all\n" * 100)
    submit(redis_conn, settings, ref, "job-bad", fake)
    work(redis_conn, settings, worker_parts)
    error = events(redis_conn, "job-bad")[-1]
    assert error["type"] == "error" and error["data"]["code"] == "unsupported_media_type"
    assert error["data"]["status"] == 415 and error["data"]["message"].startswith("not an audio file")
    assert records.get(redis_conn, "job-bad")["error"]["code"] == "unsupported_media_type"


def test_a_model_gone_from_the_store_fails_with_404(redis_conn, settings, ref, worker_parts):
    gone = contract.ModelRef("no-such-whisper", str(settings.models_dir / "no-such-whisper"), "speech")
    submit(redis_conn, settings, ref, "job-nomodel", SPEECH / "garden.wav", model=gone)
    work(redis_conn, settings, worker_parts)
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


def test_decoding_stops_at_the_duration_limit_whatever_the_header_said(model, tmp_path):
    # The probe at upload checks the declared length; a file running past it is cut off while decoding.
    fence = sentences("garden", 1)  # 4.2 s
    audio = write(fence, tmp_path / "fence.wav")
    with pytest.raises(whisper.AudioError) as refused:
        run_chunks(model, audio, whisper.Options(max_duration_s=2))
    assert refused.value.reason == "too_long" and "past 2 s" in str(refused.value)
    chunks = run_chunks(model, audio, whisper.Options(max_duration_s=fence.duration_s))  # within it
    assert chunks[-1].finished


def test_a_warm_stop_hands_a_long_job_back_to_the_queue(redis_conn, settings, ref, worker_parts, half_minute,
                                                        half_minute_text):
    submit(redis_conn, settings, ref, "job-handed", half_minute)
    first = scheduler(redis_conn, settings, worker_parts)
    first.step()
    first.stop()  # SIGTERM: the window in progress was the last one this worker decodes
    first.run()
    assert get_queue(BATCH, redis_conn).job_ids == ["job-handed_1"]
    assert fetch_job(redis_conn, "job-handed").return_value() == {"handed_back_to": "job-handed_1"}
    assert records.get(redis_conn, "job-handed")["status"] == "running"
    work(redis_conn, settings, worker_parts)  # the next worker carries on from the checkpoint
    assert assert_succeeded(redis_conn, "job-handed")["text"] == half_minute_text
