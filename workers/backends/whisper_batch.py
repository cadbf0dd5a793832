"""Batched transcription: the speech pieces a voice activity detector found, decoded several at a time.

The sequential path (whisper.transcribe_chunks) decodes one 30 s window after another, each waiting
for the text of the one before (its prompt). Here every piece (at most 30 s, cut at silences by
workers/vad.py) is its own window: `batch_size` of them are encoded and decoded together
(whisper_decoder.py), each prompted only by the client's prompt, as faster-whisper's and WhisperX's
batched pipelines do. A piece whose text ends before its audio does (Whisper stopped at a timestamp
pair) has the rest decoded in a further round, so nothing in a piece is skipped.

One ChunkResult per batch: the job checkpoints, reports progress, can be cancelled and yields to
interactive work between batches, and a resumed job starts at the batch after the last one saved.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.whisper.audio import (
    HOP_LENGTH,
    N_SAMPLES,
)
from mlx_audio.stt.models.whisper.timing import add_word_timestamps

from workers.audio import AudioReader
from workers.backends import cpu_math, whisper, whisper_decoder, whisper_encoder
from workers.backends.segments import (
    FRAMES_PER_SECOND,
    MIN_REST_S,
    SpeechSpans,
    attach_logprobs,
    public_segment,
    split_segments,
    spoken_segments,
)

CPU_BATCH, GPU_BATCH = 8, 64
"""Pieces decoded at once by default (settings.speech_batch = 0), measured in bench/NOTES.md at 521c3a7: on a
CPU the encoder gains nothing from batching and the decoder little past 8; on a GPU a decoding step costs about
the same for 1 or 64 pieces (tiny.en on the H100: 53x real time at 1, 341x at 16, 605x at 64)."""

GPU_CACHE_BYTES = 2 << 30
"""At most this much for the batch's cross-attention keys and values (a large Whisper holds 30x tiny's)."""

GPU_ENCODE_BATCH = 16
"""Windows a GPU encodes at once (a CPU one): the attention holds a 1500 x 1500 matrix per head and window."""


def transcribe_batches(model, path, options: whisper.Options, start_state: whisper.ResumeState | None,
                       speech: Iterable[tuple[float, float]], batch_size: int) -> Iterator[whisper.ChunkResult]:
    """Transcribe the speech pieces of `path` from `start_state`, `batch_size` pieces per yielded ChunkResult."""
    state = start_state or whisper.initial_state(model, options)
    spans = SpeechSpans(speech)
    reader = AudioReader(path, state.offset_s)
    try:
        while True:
            windows = _next_windows(spans, reader, options, state.seek, batch_size)
            if not windows:
                yield whisper.ChunkResult([], state, True)
                return
            segments, language = decode_windows(model, windows, options, state)
            # A batch's buffers have sizes of their own (caches grown step by step): give them back rather
            # than keep them cached for batches that cannot reuse them (bench/NOTES.md at 521c3a7, memory on
            # the H100).
            mx.clear_cache()
            state = _advance(state, segments, windows[-1].end, language)
            yield whisper.ChunkResult([public_segment(seg) for seg in segments], state,
                                      spans.at_or_after(state.seek) is None)
            if spans.at_or_after(state.seek) is None:
                return
    finally:
        reader.close()
        spans.close()


def batch_size(settings, model) -> int:
    """How many pieces to decode at once: the setting, else the platform's default (on a GPU, as many as
    fit GPU_CACHE_BYTES of cross-attention cache for this model)."""
    if settings.speech_batch > 0:
        return settings.speech_batch
    if cpu_math.on_cpu():
        return CPU_BATCH
    dims = model.dims
    per_window = 2 * dims.n_text_layer * dims.n_audio_ctx * dims.n_audio_state * model.dtype.size
    return max(1, min(GPU_BATCH, GPU_CACHE_BYTES // per_window))


class Window:
    """A stretch of the file to decode as one Whisper window: its first and end frame, and its samples."""

    def __init__(self, start: int, end: int, samples: np.ndarray):
        self.start, self.end, self.samples = start, end, samples

    @property
    def frames(self) -> int:
        """Its length in mel frames."""
        return len(self.samples) // HOP_LENGTH

    def rest(self, seek: int) -> "Window":
        """The part of this window from frame `seek` on."""
        return Window(seek, self.end, self.samples[(seek - self.start) * HOP_LENGTH:])


def _next_windows(spans: SpeechSpans, reader: AudioReader, options: whisper.Options, seek: int, count: int
                  ) -> list[Window]:
    """Up to `count` speech pieces from frame `seek` on, read from the file."""
    windows = []
    while len(windows) < count:
        span = spans.at_or_after(seek)
        if span is None:
            break
        start = max(seek, span[0])
        samples = reader.read(start * HOP_LENGTH, min(N_SAMPLES, (span[1] - start) * HOP_LENGTH))
        whisper.check_length(options, start * HOP_LENGTH + len(samples))
        if len(samples) < HOP_LENGTH:  # less than a frame left of this piece (or of the file): nothing to decode
            seek = span[1]
            continue
        windows.append(Window(start, start + len(samples) // HOP_LENGTH, samples))
        seek = windows[-1].end  # a piece longer than a window goes on in the next one
    return windows


def decode_windows(model, windows: list[Window], options: whisper.Options, state: whisper.ResumeState
                   ) -> tuple[list[dict], str]:
    """Decode the windows together; their segments in file order, and the language they were decoded in."""
    mels = [whisper.window_mel(model, window.samples) for window in windows]
    features = _encode(model, mels)
    language = state.language or whisper.detect_language(model, features[0])
    tokenizer = model.get_tokenizer(language=language, task=options.task)
    segments: list[dict] = []
    last_speech_s = state.last_speech_s
    while windows:
        results = _decode_with_fallback(model, features, tokenizer, options, state, windows[0].start)
        scores = _logprobs(model, features, tokenizer, state, results) if options.logprobs else None
        rests = []
        for index, (window, mel, result) in enumerate(zip(windows, mels, results, strict=True)):
            if whisper.is_silence(result):
                continue
            found, next_seek = split_segments(np.array(result.tokens), tokenizer, result, window.start,
                                              window.frames, has_more=False)
            if scores is not None:
                attach_logprobs(found, scores[index], tokenizer)
            found = spoken_segments([_clamp(seg, window) for seg in found])
            if options.word_timestamps and found:
                add_word_timestamps(segments=found, model=model, tokenizer=tokenizer, mel=mel,
                                    num_frames=window.frames, last_speech_timestamp=last_speech_s)
                words = [w for seg in found for w in seg.get("words", ())]
                last_speech_s = words[-1]["end"] if words else last_speech_s
            segments += found
            if (window.end - next_seek) / FRAMES_PER_SECOND >= MIN_REST_S and next_seek > window.start:
                rests.append(window.rest(next_seek))
        windows = rests
        mels = [whisper.window_mel(model, window.samples) for window in windows]
        features = _encode(model, mels) if windows else None
    segments.sort(key=lambda seg: seg["start"])
    return segments, language


def _encode(model, mels: list[mx.array]) -> mx.array:
    """The encoder's output for the windows' log-mels, once for language detection, decoding and fallback."""
    return whisper_encoder.encode_windows(model, mx.stack(mels), 1 if cpu_math.on_cpu() else GPU_ENCODE_BATCH)


def _decode_with_fallback(model, features: mx.array, tokenizer, options: whisper.Options,
                          state: whisper.ResumeState, first_frame: int) -> list:
    """Decode encoded windows at the client's temperature; those whose text looks degenerate again, hotter."""
    results: list = [None] * features.shape[0]
    todo = list(range(features.shape[0]))
    for temperature in whisper.temperature_ladder(options.temperature):
        if temperature > 0:
            mx.random.seed(first_frame)  # a batch decodes the same whether or not the job was interrupted
        decoded = whisper_decoder.decode_features(model, features[mx.array(todo)], tokenizer,
                                                  state.prompt_tokens, temperature)
        for index, result in zip(todo, decoded, strict=True):
            results[index] = result
        todo = [index for index in todo if whisper.needs_fallback(results[index])]
        if not todo:
            break
    return results


def _logprobs(model, features: mx.array, tokenizer, state: whisper.ResumeState, results: list) -> list:
    """Each window's token log-probabilities (none for a window judged silent: it has no segment)."""
    sequences = [[] if whisper.is_silence(result) else list(result.tokens) for result in results]
    return whisper_decoder.token_logprobs(model, features, tokenizer, state.prompt_tokens, sequences)


def _clamp(seg: dict, window: Window) -> dict:
    """Keep a segment's times inside its window (Whisper may place its last timestamp in the padding)."""
    low, high = window.start / FRAMES_PER_SECOND, window.end / FRAMES_PER_SECOND
    seg["start"], seg["end"] = round(min(max(seg["start"], low), high), 2), round(min(max(seg["end"], low), high), 2)
    return seg


def _advance(state: whisper.ResumeState, segments: list[dict], end: int, language: str) -> whisper.ResumeState:
    """Number the batch's segments; the next batch starts at the end of its last piece."""
    for number, seg in enumerate(segments, start=state.next_id):
        seg["id"] = number
    words = [w for seg in segments for w in seg.get("words", ())]
    return replace(state, seek=end, next_id=state.next_id + len(segments), language=language,
                   last_speech_s=words[-1]["end"] if words else state.last_speech_s)
