"""Whisper's output as segments: a window's tokens cut at timestamp pairs into segments in file time,
those a window edge may have cut dropped (decoded again by the next window), and the speech pieces
a transcription visits when silence is skipped."""

from __future__ import annotations

from typing import Iterable

import numpy as np
from mlx_audio.stt.models.whisper.audio import FRAMES_PER_SECOND
from mlx_audio.stt.models.whisper.decoding import DecodingResult

from workers.backends.logprobs import token_entry

EDGE_MARGIN_S = 1.0
"""A segment ending this close to the end of a window that has audio after it may hold a word cut
in two by the window edge: it is decoded again as the start of the next window instead."""

TIME_PRECISION = 0.02
"""Seconds per Whisper timestamp token."""

MIN_REST_S = 0.5
"""Audio left in a speech piece after its text ends, below which it is not decoded again (a breath, a tail)."""


def split_segments(tokens: np.ndarray, tokenizer, result: DecodingResult, seek: int, frames: int,
                   has_more: bool) -> tuple[list[dict], int]:
    """Cut a window's tokens into segments at timestamp pairs; return the complete ones and the next seek."""
    offset = seek / FRAMES_PER_SECOND
    is_ts = tokens >= tokenizer.timestamp_begin
    single_ending = is_ts[-2:].tolist() == [False, True]
    cuts = (np.where(is_ts[:-1] & is_ts[1:])[0] + 1).tolist()
    if single_ending:
        cuts.append(len(tokens))
    segments, last = [], 0
    for cut in cuts:
        piece = tokens[last:cut]
        start, end = (int(piece[i]) - tokenizer.timestamp_begin for i in (0, -1))
        segments.append(_segment(piece, tokenizer, result, seek, offset + start * TIME_PRECISION,
                                 offset + end * TIME_PRECISION))
        last = cut
    if not segments:  # no timestamp pair: the whole window is one segment (as in Whisper)
        end = offset + _lone_end(tokens, tokenizer, frames)
        return [_segment(tokens, tokenizer, result, seek, offset, end)], seek + frames
    return _keep_complete(segments, seek, frames, has_more, single_ending)


def _lone_end(tokens: np.ndarray, tokenizer, frames: int) -> float:
    """End of a window's only segment: its last timestamp if it has a non-zero one, else the window's end."""
    stamps = tokens[tokens >= tokenizer.timestamp_begin]
    if len(stamps) and stamps[-1] != tokenizer.timestamp_begin:
        return (int(stamps[-1]) - tokenizer.timestamp_begin) * TIME_PRECISION
    return frames / FRAMES_PER_SECOND


def _keep_complete(segments: list[dict], seek: int, frames: int, has_more: bool, single_ending: bool
                   ) -> tuple[list[dict], int]:
    """Drop segments that may be cut by the window edge; the next window starts after the last kept one."""
    window_end = (seek + frames) / FRAMES_PER_SECOND
    if has_more:
        kept = [seg for seg in segments if seg["end"] <= window_end - EDGE_MARGIN_S] or segments
    elif single_ending:
        return segments, seek + frames  # the last window, and Whisper says nothing follows
    else:
        kept = segments
    next_seek = round(kept[-1]["end"] * FRAMES_PER_SECOND)
    return kept, next_seek if next_seek > seek else seek + frames


def _segment(tokens: np.ndarray, tokenizer, result: DecodingResult, seek: int, start: float, end: float) -> dict:
    """One segment in Whisper's shape (verbose_json's, plus `words` added later when asked)."""
    token_list = tokens.tolist()
    return {
        "id": 0, "seek": seek, "start": round(start, 2), "end": round(end, 2),
        "text": tokenizer.decode([t for t in token_list if t < tokenizer.eot]), "tokens": token_list,
        "temperature": result.temperature, "avg_logprob": result.avg_logprob,
        "compression_ratio": result.compression_ratio, "no_speech_prob": result.no_speech_prob,
    }


def attach_logprobs(segments: list[dict], logprobs: list[float], tokenizer) -> None:
    """Give each segment the entries ({"token", "logprob", "bytes"}) of its text tokens, from `logprobs`:
    one per token of the window's sequence, whose consecutive pieces split_segments made the segments."""
    position = 0
    for seg in segments:
        scores = logprobs[position:position + len(seg["tokens"])]
        seg["logprobs"] = [token_entry(tokenizer, token, score)
                           for token, score in zip(seg["tokens"], scores, strict=True) if token < tokenizer.eot]
        position += len(seg["tokens"])


def spoken_segments(segments: list[dict]) -> list[dict]:
    """The segments worth keeping: some text, and a length."""
    return [seg for seg in segments if seg["text"].strip() and seg["end"] > seg["start"]]


SMALLEST_PROBABILITY = 1e-6
"""A word's probability is at least this: a mean of float32 token probabilities may round to 0."""


def public_segment(seg: dict) -> dict:
    """Plain JSON types, words reduced to OpenAI's {"word", "start", "end"} (trimmed) and faster-whisper's
    `probability`: the mean probability of the word's tokens in the alignment pass that times them."""
    out = {k: v for k, v in seg.items() if k != "words"}
    for key in ("temperature", "avg_logprob", "compression_ratio", "no_speech_prob"):
        out[key] = float(out[key])
    if "words" in seg:
        out["words"] = [{"word": w["word"].strip(), "start": float(w["start"]), "end": float(w["end"]),
                         "probability": round(min(1.0, max(float(w["probability"]), SMALLEST_PROBABILITY)), 4)}
                        for w in seg["words"]]
    return out


class SpeechSpans:
    """Speech pieces in mel frames, taken from their (lazy) source only as the transcription reaches them."""

    def __init__(self, pieces: Iterable[tuple[float, float]]):
        self._pieces = iter(pieces)
        self._current: tuple[int, int] | None = None
        self._done = False

    def at_or_after(self, seek: int) -> tuple[int, int] | None:
        """The piece that holds frame `seek` or comes next after it; None when no speech is left."""
        while not self._done and (self._current is None or self._current[1] <= seek):
            piece = next(self._pieces, None)
            if piece is None:
                self._done, self._current = True, None
            else:
                self._current = (round(piece[0] * FRAMES_PER_SECOND), round(piece[1] * FRAMES_PER_SECOND))
        return self._current

    def close(self) -> None:
        """Stop the source (a detector reading the file)."""
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()
