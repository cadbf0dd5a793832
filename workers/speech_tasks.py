"""The transcription job (`workers.speech_tasks.transcribe`): chunked, checkpointed, yielding, resumable.

Events, all on the LOGICAL job id (payload["job_id"]), numbered by jobs.events:
  `segment`  {"segment": <verbose_json segment>, "words": [{"word", "start", "end"}]  (word timestamps only)}
  `progress` {"done_s", "total_s", "percent", "eta_s"}  after every chunk
  `done`     {"result": <verbose_json result>}   or   `error` {"message", "code", "status"}
(400 invalid_audio, 400 invalid_model, 404 model_not_found, 499 canceled, 507, 500 internal_error).

An async job (mode "async", queue `batch`) checkpoints after every chunk: its segments so far, the
resume state and how many segments were published. When interactive work is waiting, it enqueues
a continuation (this function, payload + {"resume": true}, RQ id "<job_id>_<n>") at the FRONT of
`batch` and returns, so chat waits at most one chunk and batch jobs still finish in order. A sync
job (queue `interactive`) never yields. Errors publish the error event, then re-raise (RQ: failed).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

import redis
from rq import get_current_job

from jobs import keys, records, spool
from jobs.events import DONE, ERROR, PROGRESS, SEGMENT, EventPublisher
from jobs.queues import BATCH, INTERACTIVE, TRANSCRIPTION, get_queue
from jobs.settings import Settings
from jobs.store import ModelInfo, resolve
from jobs.webhooks import finish_record
from workers import speech
from workers.audio import AudioError, probe
from workers.engine import Canceled
from workers.tasks import InvalidModel, describe_error, get_runtime

CONTINUATION_TIMEOUT_S = 3600
"""RQ timeout of a continuation when the interrupted job's own timeout is unknown."""


def transcribe(payload: dict) -> dict:
    """RQ job: transcribe payload["audio_path"] chunk by chunk; return the result (or how it yielded)."""
    job = get_current_job()
    runtime = get_runtime()
    run = Transcription(job, runtime, payload)
    try:
        return run.execute()
    except Exception as exc:
        run.fail(exc)
        raise


class Transcription:
    """One RQ run of a transcription job: a first run, or a continuation resuming a checkpoint."""

    def __init__(self, job, runtime, payload: dict):
        self.job, self.runtime, self.payload = job, runtime, payload
        self.conn: redis.Redis = job.connection
        self.settings: Settings = runtime.settings
        self.job_id: str = payload.get("job_id") or job.id
        self.is_async = payload.get("mode") == "async"
        self.publisher = EventPublisher(self.conn, self.settings.result_ttl_s, self.settings.event_log_max)
        self.options = speech.Options(language=payload.get("language"), prompt=payload.get("prompt"),
                                      temperature=float(payload.get("temperature") or 0.0),
                                      word_timestamps=bool(payload.get("word_timestamps")),
                                      max_duration_s=self.settings.max_audio_s)
        self.total_s = 0.0
        self._clock = (time.monotonic(), 0.0)  # (when, done_s) this run started: for the ETA

    def execute(self) -> dict:
        """Run chunks until the end, a cancel, or a reason to yield."""
        state = self._start()
        info = self._resolve_model()
        self.total_s = probe(self.payload["audio_path"], self.settings.max_audio_s)
        self._clock = (time.monotonic(), state.offset_s if state else 0.0)
        model = self.runtime.warm(info).model
        chunks = speech.transcribe_chunks(model, self.payload["audio_path"], self.options, state)
        try:
            while True:
                self._check_cancel()
                chunk = self.runtime.engine.call(lambda: next(chunks))
                self._save_chunk(chunk)
                if chunk.finished:
                    return self._finish(chunk.state)
                if self.is_async and interactive_waiting(self.conn):
                    return self._yield()
        finally:
            chunks.close()

    def fail(self, exc: Exception) -> None:
        """Mark the record failed (or canceled), notify the webhook, publish the error event."""
        status, code, message = _describe(exc)
        error = {"message": message, "code": code, "status": status}
        finish_record(self.conn, self.settings, self.job_id, records.status_of_error(error), error)
        self.publisher.publish(self.job_id, ERROR, error)
        self.conn.delete(records.checkpoint_key(self.job_id), segments_key(self.job_id))  # nothing to resume
        spool.discard(self.settings.spool_dir, self.job_id)  # a timeout or a cancel too: nobody needs it now

    def _start(self) -> speech.ResumeState | None:
        """Mark the record running; on a continuation, load the checkpoint and republish what was lost."""
        if records.load(self.conn, self.job_id) is not None:
            records.set_status(self.conn, self.settings, self.job_id, records.RUNNING)
            records.update(self.conn, self.job_id, rq_job_id=self.job.id, audio_path=self.payload["audio_path"])
            if not self.payload.get("resume"):
                records.update(self.conn, self.job_id, attempts=1)
        if not self.payload.get("resume"):
            self.conn.delete(records.checkpoint_key(self.job_id), segments_key(self.job_id))
            return None
        state, published = load_checkpoint(self.conn, self.job_id)
        self._publish_segments(saved_segments(self.conn, self.job_id)[published:])
        return state

    def _resolve_model(self) -> ModelInfo:
        """The client's model, by name only, which must be a speech model."""
        info = resolve(self.payload.get("model"), self.settings, allow_paths=False)
        if info.kind != "speech":
            raise InvalidModel(f"model {info.id!r} is a {info.kind} model; transcription needs a speech model")
        return info

    def _check_cancel(self) -> None:
        if self.conn.exists(keys.cancel_flag(self.job_id)):
            raise Canceled("the job was canceled")

    def _save_chunk(self, chunk: speech.ChunkResult) -> None:
        """Checkpoint first (segments and state in one transaction), then publish, then record progress."""
        ttl = self.settings.result_ttl_s * records.PENDING_TTL_FACTOR
        pipe = self.conn.pipeline()
        if chunk.segments:
            pipe.rpush(segments_key(self.job_id), *(json.dumps(seg) for seg in chunk.segments))
        pipe.hset(records.checkpoint_key(self.job_id), "state", json.dumps(chunk.state.to_dict()))
        pipe.expire(segments_key(self.job_id), ttl)
        pipe.expire(records.checkpoint_key(self.job_id), ttl)
        pipe.execute()
        self._publish_segments(chunk.segments)
        self.conn.hset(records.checkpoint_key(self.job_id), "published", chunk.state.next_id)
        progress = self._progress(chunk.state.offset_s if not chunk.finished else self.total_s)
        self.publisher.publish(self.job_id, PROGRESS, progress)
        records.update(self.conn, self.job_id, progress=progress)
        self.job.heartbeat(datetime.now(timezone.utc), int(self.job.timeout or CONTINUATION_TIMEOUT_S) + 60)

    def _publish_segments(self, segments: list[dict]) -> None:
        for seg in segments:
            data = {"segment": verbose_segment(seg)}
            if self.options.word_timestamps:
                data["words"] = seg.get("words", [])
            self.publisher.publish(self.job_id, SEGMENT, data)

    def _progress(self, done_s: float) -> dict:
        """Progress with an ETA from this run's own speed (None until it has done something)."""
        done_s = min(done_s, self.total_s)
        started, start_done = self._clock
        rate = (done_s - start_done) / max(time.monotonic() - started, 1e-6)
        eta = round((self.total_s - done_s) / rate, 1) if rate > 0 else None
        percent = round(100.0 * done_s / self.total_s, 1) if self.total_s else 100.0
        return {"done_s": round(done_s, 2), "total_s": round(self.total_s, 2), "percent": percent, "eta_s": eta}

    def _yield(self) -> dict:
        """Hand the worker to interactive work: continue from the checkpoint at the front of `batch`."""
        continuation = enqueue_continuation(self.conn, self.settings, self.payload, self.job_id,
                                            self.job.timeout or CONTINUATION_TIMEOUT_S)
        records.update(self.conn, self.job_id, rq_job_id=continuation.id)
        return {"status": "yielded", "job_id": self.job_id, "continuation": continuation.id}

    def _finish(self, state: speech.ResumeState) -> dict:
        """Store the result, mark the record succeeded, publish `done`, notify the webhook."""
        result = build_result(saved_segments(self.conn, self.job_id), state.language, self.total_s,
                              self.options.word_timestamps)
        finish_record(self.conn, self.settings, self.job_id, records.SUCCEEDED, result=result)
        self.publisher.publish(self.job_id, DONE, {"result": result})
        self.conn.delete(records.checkpoint_key(self.job_id), segments_key(self.job_id))
        spool.discard(self.settings.spool_dir, self.job_id)
        return result


def segments_key(job_id: str) -> str:
    """List of a job's finished segments (JSON, with their words), kept across continuations."""
    return records.checkpoint_key(job_id) + ":segments"


def saved_segments(conn: redis.Redis, job_id: str) -> list[dict]:
    """Every segment checkpointed so far, in order."""
    return [json.loads(raw) for raw in conn.lrange(segments_key(job_id), 0, -1)]


def load_checkpoint(conn: redis.Redis, job_id: str) -> tuple[speech.ResumeState | None, int]:
    """(resume state, number of segments already published); (None, 0) before the first checkpoint."""
    raw = conn.hgetall(records.checkpoint_key(job_id))
    if b"state" not in raw:
        conn.delete(segments_key(job_id))  # nothing to resume from: start clean
        return None, 0
    return speech.ResumeState.from_dict(json.loads(raw[b"state"])), int(raw.get(b"published", 0))


def interactive_waiting(conn: redis.Redis) -> bool:
    """Whether a job waits on `interactive` (a chat call that must not wait behind a long job)."""
    return get_queue(INTERACTIVE, conn).count > 0


def continuation_id(job_id: str, number: int) -> str:
    """RQ id of a job's n-th continuation (RQ ids allow no dots: "<job_id>_<n>")."""
    return f"{job_id}_{number}"


def enqueue_continuation(conn: redis.Redis, settings: Settings, payload: dict, job_id: str, timeout_s: int,
                         func: str = TRANSCRIPTION):
    """Enqueue `func(payload + resume)` at the front of `batch` as "<job_id>_<n>" (never refused)."""
    number = conn.hincrby(records.checkpoint_key(job_id), "continuations", 1)
    # Not jobs.queues.enqueue: its queue-length limit is for new work, not work already accepted.
    return get_queue(BATCH, conn).enqueue(
        func, {**payload, "resume": True}, job_id=continuation_id(job_id, number), at_front=True,
        job_timeout=int(timeout_s), result_ttl=settings.result_ttl_s, failure_ttl=settings.result_ttl_s,
        ttl=settings.result_ttl_s, description=f"{func.rsplit('.', 1)[-1]} {job_id} (continuation {number})",
        meta={"job_id": job_id, "continuation": number},
    )


def verbose_segment(seg: dict) -> dict:
    """A checkpointed segment as verbose_json shows it (words are listed apart)."""
    return {k: v for k, v in seg.items() if k != "words"}


def build_result(segments: list[dict], language: str | None, duration_s: float, words: bool) -> dict:
    """The canonical verbose_json result from the checkpointed segments."""
    result = {"task": "transcribe", "language": speech.language_name(language), "duration": round(duration_s, 2),
              "text": "".join(seg["text"] for seg in segments).strip(),
              "segments": [verbose_segment(seg) for seg in segments]}
    if words:
        result["words"] = [w for seg in segments for w in seg.get("words", [])]
    return result


def _describe(exc: Exception) -> tuple[int, str, str]:
    """(status, code, message) of the error event; undecodable audio is the client's fault (400)."""
    if isinstance(exc, AudioError):
        if exc.reason == "not_audio":
            return 415, "unsupported_media_type", str(exc)
        return 400, "audio_too_long" if exc.reason == "too_long" else "invalid_audio", str(exc)
    return describe_error(exc)
