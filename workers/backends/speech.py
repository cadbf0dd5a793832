"""The speech backend (mlx-audio Whisper): transcription window by window, checkpointed, resumable.

After every 30 s window the run checkpoints (the segments so far and the state to go on from),
publishes the window's segments and a progress event, then yields to the scheduler, which may run
interactive work before the next window. A run resumed in another process (its worker died, or
stopped) starts from the checkpoint and republishes the segments that were not yet published.

Events: `segment` {"segment": <verbose_json segment>, "words": [...] (word timestamps only), "logprobs":
[...] (include[]=logprobs only)},
`progress` {"done_s", "total_s", "percent", "eta_s"}, then `done` {"result": <verbose_json>}.
A request with task "translate" runs the same way; its segments and result are in English.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

from jobs import keys, records
from jobs.contract import TranscriptionRequest
from jobs.errors import InvalidRequest
from jobs.events import SEGMENT
from jobs.settings import Settings
from workers import vad
from workers.audio import probe
from workers.backends import whisper, whisper_batch
from workers.backends.base import Outcome


class SpeechBackend:
    """Whisper transcription behind the backend interface (workers/backends/base.py)."""

    model_kind = "speech"
    resumable = True

    def load(self, path: Path, float32: bool):
        """Load an mlx-audio Whisper model (its tokenizer included)."""
        return whisper.load(path, float32)

    def run(self, request: TranscriptionRequest, job, models) -> Iterator[Outcome | None]:
        """Transcribe the spooled file window by window; end with the verbose_json result."""
        checkpoint = Checkpoint(job, request.word_timestamps, request.logprobs)
        state = checkpoint.resume() if request.resume else checkpoint.clear()
        options = whisper.Options(language=request.language, prompt=request.prompt,
                                  temperature=request.temperature, word_timestamps=request.word_timestamps,
                                  max_duration_s=job.settings.max_audio_s, task=request.task,
                                  logprobs=request.logprobs)
        total_s = probe(request.audio_path, job.settings.max_audio_s)
        clock = _Clock(total_s, state.offset_s if state else 0.0)
        model = models.get(request.model).model
        check_task(model, request)
        speech = vad.speech_pieces(request.audio_path) if request.chunking == "auto" else None
        if speech is not None:
            chunks = whisper_batch.transcribe_batches(model, request.audio_path, options, state, speech,
                                                      whisper_batch.batch_size(job.settings, model))
        else:
            chunks = whisper.transcribe_chunks(model, request.audio_path, options, state)
        try:
            while True:
                job.check_cancel()
                chunk = next(chunks)
                checkpoint.save(chunk)
                job.progress(clock.progress(total_s if chunk.finished else chunk.state.offset_s))
                if chunk.finished:
                    result = build_result(checkpoint.segments(), chunk.state.language, total_s,
                                          request.word_timestamps, request.task, request.logprobs)
                    yield Outcome({"result": result}, result=result)
                    return
                yield
        finally:
            chunks.close()


def check_task(model, request: TranscriptionRequest) -> None:
    """Refuse a translation on an English-only model (the web tier refuses it first when the model's config
    tells; this is for models whose config does not)."""
    if request.task == "translate" and not model.is_multilingual:
        raise InvalidRequest(f"Model '{request.model.id}' is English-only: it cannot translate. Use a "
                             "multilingual Whisper model.", code="translation_not_supported", param="model")


class Checkpoint:
    """A transcription's resume state in Redis: its segments by id, the state after the last window,
    and how many segments were published (they may be written and the worker die before publishing)."""

    def __init__(self, job, words: bool, logprobs: bool = False):
        self.job, self.words, self.logprobs = job, words, logprobs
        self.conn, self.settings = job.conn, job.settings
        self.key, self.segments_key = keys.checkpoint_key(job.job_id), keys.checkpoint_segments(job.job_id)

    def clear(self) -> None:
        """Start from the beginning: no state, no segments."""
        self.conn.delete(self.key, self.segments_key)

    def resume(self) -> whisper.ResumeState | None:
        """The state to go on from (None before the first window), after republishing what was lost."""
        raw = self.conn.hgetall(self.key)
        if b"state" not in raw:
            self.clear()
            return None
        self._publish(self.segments()[int(raw.get(b"published", 0)):])
        return whisper.ResumeState.from_dict(json.loads(raw[b"state"]))

    def save(self, chunk: whisper.ChunkResult) -> None:
        """Checkpoint a window (segments by id, then the state, in one transaction), then publish it.

        Segments are stored by id, so writing a window again (a retried command) changes nothing.
        """
        ttl = _checkpoint_ttl(self.settings)
        with self.conn.pipeline() as pipe:
            if chunk.segments:
                pipe.hset(self.segments_key, mapping={str(seg["id"]): json.dumps(seg) for seg in chunk.segments})
            pipe.hset(self.key, "state", json.dumps(chunk.state.to_dict()))
            pipe.expire(self.segments_key, ttl)
            pipe.expire(self.key, ttl)
            pipe.execute()
        self._publish(chunk.segments)
        self.conn.hset(self.key, "published", chunk.state.next_id)

    def segments(self) -> list[dict]:
        """Every segment checkpointed so far, in order."""
        stored = self.conn.hgetall(self.segments_key)
        return [json.loads(stored[k]) for k in sorted(stored, key=int)]

    def _publish(self, segments: list[dict]) -> None:
        events = []
        for seg in segments:
            data = {"segment": verbose_segment(seg)}
            if self.words:
                data["words"] = seg.get("words", [])
            if self.logprobs:
                data["logprobs"] = seg.get("logprobs", [])
            events.append((SEGMENT, data))
        self.job.publish(events)


class _Clock:
    """Progress with an ETA from this run's own speed (None until it has done something)."""

    def __init__(self, total_s: float, start_s: float):
        self.total_s, self.start_s, self.started = total_s, start_s, time.monotonic()

    def progress(self, done_s: float) -> dict:
        """The progress event's data when `done_s` seconds of audio are transcribed."""
        done_s = min(done_s, self.total_s)
        rate = (done_s - self.start_s) / max(time.monotonic() - self.started, 1e-6)
        eta = round((self.total_s - done_s) / rate, 1) if rate > 0 else None
        percent = round(100.0 * done_s / self.total_s, 1) if self.total_s else 100.0
        return {"done_s": round(done_s, 2), "total_s": round(self.total_s, 2), "percent": percent, "eta_s": eta}


def _checkpoint_ttl(settings: Settings) -> int:
    """Checkpoints live as long as a record that never ends (they are deleted when the job ends)."""
    return settings.result_ttl_s * records.PENDING_TTL_FACTOR


def verbose_segment(seg: dict) -> dict:
    """A checkpointed segment as verbose_json shows it (words and token logprobs are listed apart)."""
    return {k: v for k, v in seg.items() if k not in ("words", "logprobs")}


def build_result(segments: list[dict], language: str | None, duration_s: float, words: bool,
                 task: str = "transcribe", logprobs: bool = False) -> dict:
    """The canonical verbose_json result from the checkpointed segments."""
    # A translation's `language` is that of its text, always English, as OpenAI reports it.
    language = "en" if task == "translate" else language
    result = {"task": task, "language": whisper.language_name(language), "duration": round(duration_s, 2),
              "text": "".join(seg["text"] for seg in segments).strip(),
              "segments": [verbose_segment(seg) for seg in segments]}
    if words:
        result["words"] = [w for seg in segments for w in seg.get("words", [])]
    if logprobs:
        result["logprobs"] = [entry for seg in segments for entry in seg.get("logprobs", [])]
    return result
