"""Whisper on mlx-audio: load a model and transcribe a file window by window.

This is Whisper's own seek loop (as in `Model.generate`), turned inside out: instead of decoding the
whole file in one call, `transcribe_chunks` yields after every 30 s window with the segments it
finished and the state needed to go on (`ResumeState`), so a job can checkpoint, yield to
interactive work, or resume after a crash in another process, and audio is streamed from disk.

Boundaries lose and double nothing because a window is only ever cut at a segment boundary: of a
window's segments we keep those that end before its last timestamp token (Whisper's rule) and, in a
window followed by more audio, before its end minus `segments.EDGE_MARGIN_S`; the next window starts where
the last kept segment ends, and the text so far is its prompt (condition_on_previous_text).

Silence is never decoded (Options.vad, the default): the voice activity detector's speech pieces
(workers/vad.py) say where windows start and end, so a window never holds a long silence, where Whisper
invents text ("you", or the last sentence again, with a likelihood that passes its own no-speech rule).
Whisper's own safeguards stay for what a piece still holds: the no-speech rule, the temperature fallback,
and a prompt dropped after a window judged silent or decoded hot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.whisper.audio import (
    FRAMES_PER_SECOND,
    HOP_LENGTH,
    N_FRAMES,
    N_SAMPLES,
    log_mel_spectrogram,
    pad_or_trim,
)
from mlx_audio.stt.models.whisper.decoding import DecodingOptions, DecodingResult
from mlx_audio.stt.models.whisper.timing import add_word_timestamps
from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

from workers import vad
from workers.audio import SAMPLE_RATE, AudioError, AudioReader
from workers.backends import cpu_math, whisper_decoder, whisper_encoder
from workers.backends.segments import (
    MIN_REST_S,
    SpeechSpans,
    attach_logprobs,
    public_segment,
    split_segments,
    spoken_segments,
)

LENGTH_SLACK_S = 1.0
"""How far past settings.max_audio_s decoding may go before the file is refused (rounding in headers)."""

_FALLBACK_STEP = 0.2  # temperature increments of the fallback ladder (Whisper's defaults below)
_COMPRESSION_RATIO_MAX = 2.4
_LOGPROB_MIN = -1.0
_NO_SPEECH_MIN = 0.6
_PROMPT_KEEP = 223  # Whisper's decoder only reads the last n_text_ctx // 2 - 1 prompt tokens


@dataclass(frozen=True)
class Options:
    """What a client may ask of a transcription (OpenAI's parameters)."""

    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    max_duration_s: float | None = None  # decoding stops with an error past this point of the file
    task: str = "transcribe"  # or "translate": English text from speech in any language (multilingual models)
    logprobs: bool = False  # each segment's text tokens with their log-probabilities (include[]=logprobs)
    vad: bool = True  # decode only the speech pieces the voice activity detector finds (False: every window)


@dataclass
class ResumeState:
    """Where a transcription stands between windows; JSON-serializable (see to_dict/from_dict)."""

    seek: int = 0  # start of the next window, in mel frames (10 ms)
    next_id: int = 0  # id of the next segment
    prompt_tokens: list[int] = field(default_factory=list)  # the previous text, as the next prompt
    last_speech_s: float = 0.0  # end of the last word (word-timestamp heuristics)
    language: str | None = None

    @property
    def offset_s(self) -> float:
        """The next window's start in seconds."""
        return self.seek / FRAMES_PER_SECOND

    def to_dict(self) -> dict:
        """A JSON-serializable copy (checkpoints)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ResumeState":
        """Rebuild from `to_dict`'s output."""
        return cls(**data)


@dataclass
class ChunkResult:
    """What one window produced: new segments (each with its `words` when asked) and the state after it."""

    segments: list[dict]
    state: ResumeState
    finished: bool


def load(path: Path, float32: bool = False):
    """Load an mlx-audio Whisper model (tokenizer included); (model, None) as the model manager expects."""
    from mlx_audio.stt import load as load_stt

    model = load_stt(str(path))
    # MLX has no fast float16 kernels on CPU: there, float32 is several times faster for Whisper.
    if float32 or cpu_math.on_cpu():
        to_float32(model)
    mx.eval(model.parameters())
    return model, None


def window_mel(model, samples: np.ndarray) -> mx.array:
    """The log-mel spectrogram of up to 30 s of samples, padded to Whisper's window, in the model's dtype."""
    frames = len(samples) // HOP_LENGTH
    # Zeros to a whole window first, then Whisper's 30 s of padding: the same frames as padding the samples
    # alone (a frame sees 200 samples either side), but every window's FFT has one shape. On a GPU each length
    # would get a cuFFT plan of its own (MLX keeps 128; speech pieces come in every length).
    samples = np.pad(samples, (0, max(0, N_SAMPLES - len(samples))))
    mel = log_mel_spectrogram(mx.array(samples), n_mels=model.dims.n_mels, padding=N_SAMPLES)
    return pad_or_trim(mel[:frames], N_FRAMES, axis=-2).astype(model.dtype)


def to_float32(model) -> None:
    """Upcast a Whisper model, including the constants its modules keep outside the parameters."""
    model.set_dtype(mx.float32)
    model.dtype = mx.float32
    model.encoder._positional_embedding = model.encoder._positional_embedding.astype(mx.float32)
    model.decoder._mask = model.decoder._mask.astype(mx.float32)


def language_name(code: str | None) -> str | None:
    """Whisper's name for a language code ("en" -> "english"), as OpenAI's verbose_json reports it."""
    return LANGUAGES.get(code, code) if code else None


def initial_state(model, options: Options) -> ResumeState:
    """The state before the first window: the client's prompt, the language if known."""
    # An English-only model knows no other language; a name ("german") becomes its code ("de").
    language = TO_LANGUAGE_CODE.get(options.language, options.language) if model.is_multilingual else "en"
    state = ResumeState(language=language)
    if options.prompt and options.prompt.strip():
        tokenizer = model.get_tokenizer(language=language or "en", task=options.task)
        state.prompt_tokens = tokenizer.encode(" " + options.prompt.strip())[-_PROMPT_KEEP:]
    return state


def transcribe_chunks(model, path, options: Options, start_state: ResumeState | None = None) -> Iterator[ChunkResult]:
    """Transcribe `path` from `start_state` (None: the beginning), one window per yielded ChunkResult.

    (With chunking_strategy "auto" the speech pieces are decoded in batches instead: whisper_batch.py.)"""
    state = start_state or initial_state(model, options)
    spans = SpeechSpans(vad.speech_pieces(path)) if options.vad else None
    reader = AudioReader(path, state.offset_s)
    try:
        while True:
            span = _speech_from(spans, state.seek) if spans else (state.seek, None)
            if span is None:  # no speech left
                yield ChunkResult([], state, True)
                return
            state = replace(state, seek=span[0])
            start = state.seek * HOP_LENGTH
            wanted = N_SAMPLES if span[1] is None else min(N_SAMPLES, (span[1] - state.seek) * HOP_LENGTH)
            samples = reader.read(start, wanted)
            check_length(options, start + len(samples))
            if len(samples) < HOP_LENGTH:  # less than one frame left (of the file, or of a piece): nothing to decode
                if span[1] is None:
                    yield ChunkResult([], state, True)
                    return
                state = replace(state, seek=span[1])
                continue
            # A window cut at the end of a speech piece has silence after it, not a word cut in two.
            chunk = decode_window(model, samples, options, state, has_more=len(samples) == wanted == N_SAMPLES
                                  and span[1] != state.seek + N_FRAMES)
            if spans is not None:
                chunk = replace(chunk, finished=_speech_from(spans, chunk.state.seek) is None)
            yield chunk
            if chunk.finished:
                return
            state = chunk.state
    finally:
        reader.close()
        if spans is not None:
            spans.close()


def _speech_from(spans: SpeechSpans, seek: int) -> tuple[int, int] | None:
    """Where the next window may start and must end: the speech piece at or after frame `seek` (from `seek`
    if it is inside one); None when no speech is left. A piece's tail shorter than MIN_REST_S, left over
    after Whisper stopped early, is a breath or a pause: skipped."""
    while (span := spans.at_or_after(seek)) is not None:
        start = max(seek, span[0])
        if start == span[0] or (span[1] - start) / FRAMES_PER_SECOND >= MIN_REST_S:
            return start, span[1]
        seek = span[1]
    return None


def check_length(options: Options, end_sample: int) -> None:
    """Stop a file that goes on past the limit: its header, checked at upload, understated its length."""
    limit = options.max_duration_s
    if limit and end_sample / SAMPLE_RATE > limit + LENGTH_SLACK_S:
        raise AudioError("too_long", f"audio too long (it goes on past {limit:.0f} s, the limit, though its "
                                     "header declared less)")


def decode_window(model, samples: np.ndarray, options: Options, state: ResumeState, has_more: bool
                  ) -> ChunkResult:
    """Decode one window (up to 30 s starting at state.seek) and decide where the next one starts."""
    frames = len(samples) // HOP_LENGTH
    mel = window_mel(model, samples)
    features = whisper_encoder.encode(model, mel[None])[0]  # once for detection, decoding and its fallbacks
    language = state.language or detect_language(model, features)
    tokenizer = model.get_tokenizer(language=language, task=options.task)
    result = _decode_with_fallback(model, features, options, state, language)
    if is_silence(result):  # Whisper's no-speech skip
        return _advance(state, [], state.seek + frames, language, frames, has_more, result)
    segments, next_seek = split_segments(np.array(result.tokens), tokenizer, result, state.seek, frames,
                                          has_more)
    if options.logprobs:
        scores = whisper_decoder.token_logprobs(model, features[None], tokenizer, state.prompt_tokens,
                                                [list(result.tokens)])
        attach_logprobs(segments, scores[0], tokenizer)
    if options.word_timestamps and segments:
        add_word_timestamps(segments=segments, model=model, tokenizer=tokenizer, mel=mel, num_frames=frames,
                            last_speech_timestamp=state.last_speech_s)
    return _advance(state, segments, next_seek, language, frames, has_more, result)


def _advance(state: ResumeState, segments: list[dict], next_seek: int, language: str, frames: int,
             has_more: bool, result: DecodingResult) -> ChunkResult:
    """Number the kept segments and build the state the next window starts from."""
    spoken = spoken_segments(segments)
    for number, seg in enumerate(spoken, start=state.next_id):
        seg["id"] = number
    prompt = next_prompt(state.prompt_tokens, [t for seg in spoken for t in seg["tokens"]], result)
    words = [w for seg in spoken for w in seg.get("words", ())]
    new_state = ResumeState(
        seek=next_seek, next_id=state.next_id + len(spoken), prompt_tokens=prompt,
        last_speech_s=words[-1]["end"] if words else state.last_speech_s, language=language,
    )
    finished = not has_more and next_seek >= state.seek + frames
    return ChunkResult([public_segment(seg) for seg in spoken], new_state, finished)


def next_prompt(prompt: list[int], tokens: list[int], result: DecodingResult) -> list[int]:
    """The prompt of the next window: the text so far, unless this window's text is not to be trusted."""
    # Whisper drops a prompt after a window decoded hot (its text is likely garbage, and a model prompted with
    # garbage repeats it); after a window judged silent too: the text before a silence led Whisper to invent
    # more of it in the silence ("you", or the last sentence again).
    if result.temperature > 0.5 or is_silence(result):
        return []
    return (prompt + tokens)[-_PROMPT_KEEP:]


def _decode_with_fallback(model, features: mx.array, options: Options, state: ResumeState, language: str
                          ) -> DecodingResult:
    """Decode at the client's temperature, retrying hotter while the output looks degenerate."""
    result = None
    for temperature in temperature_ladder(options.temperature):
        if temperature > 0:
            # Seeded by position: a window decodes the same whether or not the job was interrupted.
            mx.random.seed(state.seek)
        decode_options = DecodingOptions(language=language, task=options.task, temperature=temperature,
                                         prompt=list(state.prompt_tokens), fp16=model.dtype == mx.float16)
        result = model.decode(features, decode_options)
        if not needs_fallback(result):
            break
    return result


def temperature_ladder(temperature: float) -> list[float]:
    """The temperatures to try in turn: the client's, then hotter by steps up to 1.0 (Whisper's fallback)."""
    return np.arange(temperature, 1.0 + 1e-6, _FALLBACK_STEP).round(2).tolist() or [temperature]


def needs_fallback(result: DecodingResult) -> bool:
    """Whisper's fallback rule: the text is too repetitive or too unlikely, and the window is not silence."""
    too_repetitive = result.compression_ratio > _COMPRESSION_RATIO_MAX
    unlikely = result.avg_logprob < _LOGPROB_MIN
    return (too_repetitive or unlikely) and not is_silence(result)


def is_silence(result: DecodingResult) -> bool:
    """Whisper's no-speech rule: the no-speech token is likely and the text is not."""
    return result.no_speech_prob > _NO_SPEECH_MIN and result.avg_logprob < _LOGPROB_MIN


def detect_language(model, features: mx.array) -> str:
    """The most likely language of a window, from its encoder output (multilingual models only)."""
    _, probs = model.detect_language(features)
    return max(probs, key=probs.get)
