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
import itertools
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import onnxruntime as ort

from workers.ahead import Ahead
from workers.audio import SAMPLE_RATE, iter_samples

MODEL_PACKAGE, MODEL_VERSION = "silero-vad", "6.2.3"
MODEL_MEMBER = "silero_vad/data/silero_vad.onnx"

WINDOW = 512  # samples the 16 kHz model judges per call (32 ms)
CONTEXT = 64  # v5+: each call also sees the last 64 samples of the previous window, prepended
LANES = 16  # stretches of a stream judged side by side, as one batch
LANE_WINDOWS = 256  # windows in a stretch (8.2 s)
WARMUP = 16  # windows (0.5 s) a stretch hears before its own, so that its state has settled
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
    from workers.store_admin import downloads_dir
    from workers.wheel_files import fetch_wheel_file

    return fetch_wheel_file(MODEL_PACKAGE, MODEL_VERSION, MODEL_MEMBER, downloads_dir())


class SileroVAD:
    """The Silero VAD model in an onnxruntime session; stateless itself, so one can serve many streams."""

    def __init__(self, path: str | Path | None = None, threads: int = 1, parallel: int = 1):
        options = ort.SessionOptions()
        # One thread per call: the model is tiny (~0.1 ms a window), a thread pool inside a call only adds
        # hand-off cost; more cores are put to work by judging `parallel` blocks at once instead (the
        # session is thread-safe and releases the GIL), measured in bench/NOTES.md at 521c3a7.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path or model_path()), sess_options=options,
                                            providers=["CPUExecutionProvider"])
        self.parallel = parallel

    def probabilities(self, pieces: Iterable[np.ndarray]) -> Iterator[float]:
        """Yield the speech probability of each 512-sample window of a stream of 16 kHz mono pieces."""
        # The stream is judged a block at a time, the block cut into LANES stretches run side by side
        # as one batch: a call costs about the same for 1 window or 16 (0.5 vs 2 ms on the 2-core CPU).
        # Each stretch first hears the WARMUP windows before it, so its recurrent state has settled
        # when its own windows come; the first stretch of the file starts from silence, as one stream.
        # State and context live here, per stream: concurrent streams can share the session.
        windows = _windows(pieces)
        before = np.zeros((0, WINDOW), np.float32)  # the windows just before the block (its warm-up)
        with ThreadPoolExecutor(self.parallel, thread_name_prefix="vad") as pool:
            pending: deque = deque()
            while block := list(itertools.islice(windows, LANES * LANE_WINDOWS)):
                heard = np.concatenate([before, np.stack(block)])
                pending.append(pool.submit(self._block, heard, len(before)))
                before = heard[-(WARMUP + 1):]
                if len(pending) > self.parallel:  # keep `parallel` blocks being judged, in order
                    yield from pending.popleft().result()
            while pending:
                yield from pending.popleft().result()

    def _block(self, windows: np.ndarray, first: int) -> list[float]:
        """Probabilities of windows[first:], in lanes; windows[:first] are only heard (warm-up)."""
        # Each row: the previous window's last CONTEXT samples (zeros at the file's start), then the window.
        context = np.concatenate([np.zeros((1, CONTEXT), np.float32), windows[:-1, -CONTEXT:]])
        rows = np.concatenate([context, windows], axis=1)
        starts = list(range(first, len(windows), LANE_WINDOWS))
        steps = WARMUP + LANE_WINDOWS
        batch = np.zeros((len(starts), steps, CONTEXT + WINDOW), np.float32)
        silent_until = np.zeros(len(starts), np.int64)  # steps before a lane's audio begins
        # The first row of the file had no window before it: its context is zeros, as the model expects.
        first_row = 1 if first > 0 else 0
        for lane, start in enumerate(starts):
            heard = rows[max(first_row, start - WARMUP):start + LANE_WINDOWS]
            lead = WARMUP - (start - max(first_row, start - WARMUP))
            batch[lane, lead:lead + len(heard)] = heard
            silent_until[lane] = lead
        state = np.zeros((2, len(starts), 128), np.float32)
        rate = np.array(SAMPLE_RATE, np.int64)
        out = np.zeros((len(starts), steps), np.float32)
        for step in range(steps):
            output, state = self.session.run(None, {"input": batch[:, step], "state": state, "sr": rate})
            out[:, step] = output[:, 0]
            state[:, silent_until > step] = 0.0  # a lane with nothing before it starts from a fresh state
        return [p for lane, start in enumerate(starts)
                for p in out[lane, WARMUP:WARMUP + min(LANE_WINDOWS, len(windows) - start)].tolist()]


@functools.lru_cache(maxsize=1)
def default_vad() -> SileroVAD:
    """Return the process's shared SileroVAD (loaded on first use), judging on up to half of the cores
    (one on this project's 2-core machines, where Whisper needs them; eight on a 16-core GPU host, where the
    first batch of pieces waits for it)."""
    return SileroVAD(parallel=max(1, min(8, (os.cpu_count() or 1) // 2)))


def speech_pieces(path) -> Ahead:
    """The pieces of a file's speech, found by a thread that runs ahead of the caller (see Ahead)."""
    return Ahead(pieces(speech_regions(path)))


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
