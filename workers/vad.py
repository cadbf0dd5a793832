"""Voice activity detection with Silero VAD (ONNX): where the speech is in a file, and pieces of it
of at most 30 s (Whisper's window) for batched decoding, so long silences are never decoded.

The file is streamed (workers.audio.iter_samples) and judged window by window, so memory stays flat
whatever its length. The model is Silero VAD v6's ONNX file, taken out of the PyPI wheel (whose own
code wants torch; we need only the file) and run with onnxruntime on one CPU thread.

    for start_s, end_s in pieces(speech_regions(path)):  # ordered, non-overlapping, each <= 30 s
        ...decode samples [start_s, end_s) of the file
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import onnxruntime as ort

from workers.audio import SAMPLE_RATE, iter_samples

MODEL_PACKAGE, MODEL_VERSION = "silero-vad", "6.2.3"
MODEL_MEMBER = "silero_vad/data/silero_vad.onnx"

WINDOW = 512  # samples the 16 kHz model judges per call (32 ms)
CONTEXT = 64  # v5+: each call also sees the last 64 samples of the previous window, prepended
MAX_PIECE_S = 30.0  # Whisper decodes 30 s at a time

# The turning of probabilities into regions follows silero's get_speech_timestamps (same
# thresholds and hysteresis), with a wider pad: Whisper does better with a little lead-in and
# tail than with words clipped at a 30 ms boundary.
THRESHOLD = 0.5  # a window at or above this starts (or continues) speech
NEG_THRESHOLD = THRESHOLD - 0.15  # inside speech, only a window below this counts as silence
MIN_SPEECH_S = 0.25  # shorter regions are clicks and breaths: dropped
MIN_SILENCE_S = 0.1  # speech ends after this much silence; short gaps stay inside the region
PAD_S = 0.2  # each region grows this much on both sides (at most half the gap to a neighbour)
SPLIT_SEARCH_S = 5.0  # a region too long for a piece is cut at its quietest window this near the limit


def model_path() -> Path:
    """Return the local path of the Silero VAD ONNX file, fetching it from its PyPI wheel once."""
    # Imported here: the fetch helpers pull in store code that using an explicit path does not need.
    from workers.importers.demo_sources import fetch_wheel_file
    from workers.store_admin import downloads_dir

    return fetch_wheel_file(MODEL_PACKAGE, MODEL_VERSION, MODEL_MEMBER, downloads_dir())


class SileroVAD:
    """The Silero VAD model in an onnxruntime session; stateless itself, so one can serve many streams."""

    def __init__(self, path: str | Path | None = None, threads: int = 1):
        options = ort.SessionOptions()
        # One thread: the model is tiny (~0.3 ms a window), a thread pool only adds hand-off cost
        # (measured: 2 threads use more CPU for the same work), and the CPU is shared with the worker.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path or model_path()), sess_options=options,
                                            providers=["CPUExecutionProvider"])

    def probabilities(self, pieces: Iterable[np.ndarray]) -> Iterator[float]:
        """Yield the speech probability of each 512-sample window of a stream of 16 kHz mono pieces."""
        # The recurrent state and the context are per stream, here, so concurrent streams can share
        # the session (InferenceSession.run is thread-safe).
        state = np.zeros((2, 1, 128), np.float32)
        rate = np.array(SAMPLE_RATE, np.int64)
        model_input = np.zeros((1, CONTEXT + WINDOW), np.float32)  # zero context before the first window
        for window in _windows(pieces):
            model_input[0, :CONTEXT] = model_input[0, -CONTEXT:]
            model_input[0, CONTEXT:] = window
            output, state = self.session.run(None, {"input": model_input, "state": state, "sr": rate})
            yield float(output[0, 0])


@functools.lru_cache(maxsize=1)
def default_vad() -> SileroVAD:
    """Return the process's shared SileroVAD (loaded on first use)."""
    return SileroVAD()


def speech_regions(path, vad: SileroVAD | None = None, max_s: float = MAX_PIECE_S) -> Iterator[tuple[float, float]]:
    """Yield (start_s, end_s) of each speech region of an audio file, in order, none longer than max_s."""
    samples = _Counted(iter_samples(path))
    probabilities = (vad or default_vad()).probabilities(samples)
    yield from regions_from_probabilities(probabilities, max_s, lambda: samples.total)


def regions_from_probabilities(probabilities: Iterable[float], max_s: float = MAX_PIECE_S,
                               total_samples: Callable[[], int] | None = None) -> Iterator[tuple[float, float]]:
    """Yield padded (start_s, end_s) speech regions from per-window probabilities (the region logic)."""
    # total_samples is asked once the probabilities are exhausted (the file's true end, to clamp the
    # last region to); without it, the end of the last window.
    pad = round(PAD_S * SAMPLE_RATE)
    if max_s * SAMPLE_RATE - 2 * pad < 2 * WINDOW:
        raise ValueError(f"max_s must leave room for the padding: at least {2 * PAD_S + 0.064:.3f} s, got {max_s}")
    # Pad both sides for the longest region, so that padding never takes it past max_s.
    finder = _RegionFinder(round(max_s * SAMPLE_RATE) - 2 * pad)
    previous = None  # (padded start, raw end) of the region whose end pad waits for the next start
    for start, end in finder.regions(probabilities):
        if previous is None:
            start_padded = max(0, start - pad)
        else:
            half_gap = min(pad, (start - previous[1]) // 2)  # neighbours share a short gap, never overlap
            yield previous[0] / SAMPLE_RATE, (previous[1] + half_gap) / SAMPLE_RATE
            start_padded = start - half_gap
        previous = (start_padded, end)
    if previous is not None:
        total = total_samples() if total_samples else finder.windows * WINDOW
        yield previous[0] / SAMPLE_RATE, min(total, previous[1] + pad) / SAMPLE_RATE


def pieces(regions: Iterable[tuple[float, float]], max_s: float = MAX_PIECE_S) -> Iterator[tuple[float, float]]:
    """Merge consecutive (ordered, non-overlapping) regions into (start_s, end_s) pieces of at most max_s."""
    # Greedy, like WhisperX's merge_chunks: fuller pieces mean fewer, better-filled decoder batches.
    # The silence between merged regions is decoded with them; the long silences are already gone.
    if max_s <= 0:
        raise ValueError(f"max_s must be positive, got {max_s}")
    slack = 1e-9  # seconds -> float rounding: a region of exactly max_s may read a hair longer
    current = None
    for start, end in regions:
        while end - start > max_s + slack:  # only regions from elsewhere: speech_regions already cuts them
            if current is not None:
                yield current
                current = None
            yield start, start + max_s
            start += max_s
        if current is not None and end - current[0] <= max_s + slack:
            current = (current[0], end)
            continue
        if current is not None:
            yield current
        current = (start, end)
    if current is not None:
        yield current


class _RegionFinder:
    """Silero's hysteresis state machine over window probabilities, run as a stream: raw (unpadded)
    regions in samples, each at most max_len long."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.min_speech = round(MIN_SPEECH_S * SAMPLE_RATE)
        self.min_silence = round(MIN_SILENCE_S * SAMPLE_RATE)
        self.search = round(SPLIT_SEARCH_S * SAMPLE_RATE)
        self.windows = 0  # windows seen so far

    def regions(self, probabilities: Iterable[float]) -> Iterator[tuple[int, int]]:
        """Yield (start, end) sample indices of the speech, in order."""
        start = None  # start of the region in progress, None outside speech
        silence_from = None  # where a silence began inside the region (it may yet turn out a pause)
        region_probs: list[float] = []  # the region's window probabilities (bounded by max_len)
        was_cut = False  # the region began at a cut, so it is speech however short
        for index, prob in enumerate(probabilities):
            self.windows = index + 1
            at = index * WINDOW
            if start is None:
                if prob >= THRESHOLD:
                    start, silence_from, region_probs, was_cut = at, None, [prob], False
                continue
            if at + WINDOW - start > self.max_len:  # this window would make the region too long
                cut = self._cut(start, at, region_probs)
                yield start, cut
                region_probs = region_probs[(cut - start) // WINDOW:]
                start, was_cut = cut, True
                if silence_from is not None:
                    silence_from = max(silence_from, cut)
            region_probs.append(prob)
            if prob >= THRESHOLD:
                silence_from = None
            elif prob < NEG_THRESHOLD:
                if silence_from is None:
                    silence_from = at
                if at - silence_from >= self.min_silence:  # the silence is long enough: speech ended
                    length = silence_from - start  # 0 when a cut put the start in this silence
                    if length > self.min_speech or (was_cut and length > 0):
                        yield start, silence_from
                    start = None
        if start is not None:
            end = self.windows * WINDOW
            if was_cut or end - start > self.min_speech:
                yield start, end

    def _cut(self, start: int, at: int, region_probs: list[float]) -> int:
        """Where to end a region [start, at) that cannot grow: its quietest recent window, else `at`."""
        first = max(1, (at - self.search - start) // WINDOW)  # a cut at window 0 would leave nothing
        recent = region_probs[first:]
        if not recent or min(recent) >= THRESHOLD:  # no pause near the limit: cut hard at it
            return at
        # The latest of the quietest windows (keeps the piece long); it starts the next region.
        quietest = len(recent) - 1 - int(np.argmin(recent[::-1]))
        return start + (first + quietest) * WINDOW


class _Counted:
    """Passes pieces of samples through, counting them (the file's length, known at its end)."""

    def __init__(self, pieces: Iterable[np.ndarray]):
        self.pieces = pieces
        self.total = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        for piece in self.pieces:
            self.total += len(piece)
            yield piece


def _windows(pieces: Iterable[np.ndarray]) -> Iterator[np.ndarray]:
    """Regroup pieces of any length into consecutive WINDOW-sample windows, the last zero-padded."""
    carry = np.zeros(0, np.float32)
    for piece in pieces:
        if len(carry):
            piece = np.concatenate([carry, piece])
        full = len(piece) - len(piece) % WINDOW
        for offset in range(0, full, WINDOW):
            yield piece[offset:offset + WINDOW]
        carry = piece[full:]
    if len(carry):
        yield np.pad(carry, (0, WINDOW - len(carry)))
