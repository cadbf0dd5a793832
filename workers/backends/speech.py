"""The speech backend (mlx-audio Whisper): transcription window by window, checkpointed, resumable.

After every 30 s window the run hands its checkpoint to its job (the window's segments and the state
to go on from; jobs/checkpoints.py keeps it), which publishes the segments; then a progress event,
and it yields to the scheduler, which may run interactive work before the next window. A run resumed
in another process (its worker died, or stopped) starts from the checkpoint and first republishes the
segments that were checkpointed but not yet published.

Events: `segment` {"segment": <verbose_json segment>, "words": [...] (word timestamps only), "logprobs":
[...] (include[]=logprobs only)},
`progress` {"done_s", "total_s", "percent", "eta_s"}, then `done` {"result": <verbose_json>}; before them, a job
given a `file_url` has `progress` {"stage": "download", ...} while the worker fetches it (workers/audio_fetch.py).
A request with task "translate" runs the same way; its segments and result are in English. A diarized one
(`diarize`) gives each segment and word a `speaker` as it goes (workers/speakers.py), its speakers' state in
the checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from jobs.contract import TranscriptionRequest
from jobs.errors import InvalidRequest
from jobs.events import SEGMENT
from jobs.lifecycle import JobRun
from workers import audio_fetch, speakers, vad
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

    def run(self, request: TranscriptionRequest, job: JobRun, models) -> Iterator[Outcome | None]:
        """Transcribe the spooled file (fetched first when it is a `file_url`) window by window; end with the
        verbose_json result."""
        if request.file_url:
            yield from audio_fetch.fetched(request.file_url, request.audio_path, job)
        saved = job.restore(request.resume)
        if saved is not None:  # a resumed run: what was checkpointed but never published goes out first
            job.publish(segment_events(saved.unpublished, request))
        saved_state = dict(saved.state) if saved is not None else {}
        saved_speakers = saved_state.pop("speakers", None)
        state = whisper.ResumeState.from_dict(saved_state) if saved is not None else None
        options = whisper.Options(language=request.language, prompt=request.prompt,
                                  temperature=request.temperature, word_timestamps=request.word_timestamps,
                                  max_duration_s=job.settings.max_audio_s, task=request.task,
                                  logprobs=request.logprobs)
        total_s = probe(request.audio_path, job.settings.max_audio_s)
        clock = _Clock(total_s, state.offset_s if state else 0.0)
        model = models.get(request.model).model
        check_task(model, request)
        diarizer = _diarizer(request, saved_speakers, state)
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
                checkpoint = chunk.state.to_dict()
                if diarizer is not None:
                    diarizer.label(chunk.segments)
                    checkpoint["speakers"] = diarizer.speakers.to_dict()  # a resumed run labels as this one
                job.checkpoint(checkpoint, chunk.segments, segment_events(chunk.segments, request))
                job.progress(clock.progress(total_s if chunk.finished else chunk.state.offset_s))
                if chunk.finished:
                    result = build_result(job.checkpointed(), chunk.state.language, total_s,
                                          request.word_timestamps, request.task, request.logprobs)
                    yield Outcome({"result": result}, result=result)
                    return
                yield
        finally:
            chunks.close()
            if diarizer is not None:
                diarizer.close()


def _diarizer(request: TranscriptionRequest, saved: dict | None, state) -> speakers.Diarizer | None:
    """The diarizer of a diarized transcription: a fresh one, or a resumed run's from its checkpoint."""
    if not request.diarize:
        return None
    if saved is not None:
        return speakers.Diarizer(request.audio_path, speakers.Speakers.from_dict(saved), state.offset_s)
    return speakers.Diarizer.starting(request.audio_path, request.min_speakers, request.max_speakers,
                                      request.speaker_names, request.speaker_references)


def check_task(model, request: TranscriptionRequest) -> None:
    """Refuse a translation on an English-only model (the web tier refuses it first when the model's config
    tells; this is for models whose config does not)."""
    if request.task == "translate" and not model.is_multilingual:
        raise InvalidRequest(f"Model '{request.model.id}' is English-only: it cannot translate. Use a "
                             "multilingual Whisper model.", code="translation_not_supported", param="model")


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


def segment_events(segments: list[dict], request: TranscriptionRequest) -> list[tuple[str, dict]]:
    """The `segment` events of checkpointed segments (with their words and logprobs when asked)."""
    events = []
    for seg in segments:
        data = {"segment": verbose_segment(seg)}
        if request.word_timestamps:
            data["words"] = seg.get("words", [])
        if request.logprobs:
            data["logprobs"] = seg.get("logprobs", [])
        events.append((SEGMENT, data))
    return events


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
