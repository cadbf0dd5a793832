"""Audio decoding with PyAV (no ffmpeg binary): any container/codec to 16 kHz mono float32, streamed.

Nothing here holds a whole decoded file: `iter_samples` yields small pieces, `AudioReader` keeps
only the window asked for, so a two-hour upload costs a few megabytes of memory, not hundreds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import av
import numpy as np

from jobs import media
from jobs.media import MediaError as AudioError  # noqa: F401  (the worker's name for a refused file)

SAMPLE_RATE = 16000
"""Whisper's sample rate: everything is resampled to it."""

WAV_PACKET_BYTES = 32 * 1024
"""Bytes per packet asked of FFmpeg's WAV demuxer for PCM, instead of its 4 KiB. Each packet costs tens of
microseconds of Python-side decoding: a 30-minute 16 kHz WAV read in 0.84-1.13 s that way and in 0.18-0.19 s
this way on the 2-core CPU (bench/NOTES.md at 521c3a7); larger packets gain little and make opening slower."""


def probe(path, max_duration_s: float | None = None) -> float:
    """Return the duration in seconds, or raise AudioError if the file is not whole, decodable audio."""
    return media.probe(Path(path), max_duration_s).duration_s


def iter_samples(path, start_s: float = 0.0) -> Iterator[np.ndarray]:
    """Yield consecutive 16 kHz mono float32 pieces of the audio, starting `start_s` seconds in."""
    skip = round(start_s * SAMPLE_RATE)
    with _open(path) as container:
        stream = _audio_stream(container)
        if skip and stream.time_base is not None:
            # Seek (to a point at or before the target), then trim using the first frame's time.
            container.seek(_to_pts(stream, start_s), stream=stream, backward=True)
            pieces = _resampled(container, stream)
            first = next(pieces, None)
            if first is None or first[0] is not None:
                yield from _aligned(first, pieces, start_s)
                return
    # No timestamps to align on: decode from the start and count samples instead.
    with _open(path) as container:
        yield from _skipped(_resampled(container, _audio_stream(container)), skip)


class AudioReader:
    """Forward-only random access to the samples of a file: keeps only what is still ahead."""

    def __init__(self, path, start_s: float = 0.0):
        self._pieces = iter_samples(path, start_s)
        self._start = round(start_s * SAMPLE_RATE)  # absolute sample index of _buf[0]
        self._buf = np.zeros(0, np.float32)
        self.exhausted = False

    def read(self, start: int, count: int) -> np.ndarray:
        """Return samples [start, start + count) by absolute index (shorter at the end of the file)."""
        if start < self._start:
            raise ValueError(f"AudioReader reads forward only: sample {start} < {self._start}")
        self._skip_to(start)
        need = start - self._start + count
        if len(self._buf) < need and not self.exhausted:
            self._fill(need)
        self._buf = self._buf[start - self._start:]
        self._start = start
        return self._buf[:count].copy()

    def close(self) -> None:
        """Close the underlying file."""
        self._pieces.close()

    def _skip_to(self, start: int) -> None:
        """Drop what lies before `start` as it is decoded: a jump over an hour of silence holds nothing."""
        while self._start + len(self._buf) < start and not self.exhausted:
            piece = next(self._pieces, None)
            if piece is None:
                self.exhausted = True
                break
            self._start += len(self._buf)
            self._buf = piece

    def _fill(self, need: int) -> None:
        pieces, have = [self._buf], len(self._buf)
        while have < need:
            piece = next(self._pieces, None)
            if piece is None:
                self.exhausted = True
                break
            pieces.append(piece)
            have += len(piece)
        self._buf = np.concatenate(pieces)


def iter_windows(path, window_s: float, start_s: float = 0.0) -> Iterator[tuple[float, np.ndarray]]:
    """Yield (offset_s, samples) for consecutive windows of `window_s` seconds from `start_s`."""
    size = round(window_s * SAMPLE_RATE)
    index = round(start_s * SAMPLE_RATE)
    reader = AudioReader(path, start_s)
    try:
        while len(samples := reader.read(index, size)):
            yield index / SAMPLE_RATE, samples
            index += size
    finally:
        reader.close()


def _open(path):
    """Open a container (jobs.media says why one cannot be); a PCM WAV is opened again with larger packets."""
    container = media.open_container(Path(path))
    streams = container.streams.audio
    if container.format.name != "wav" or not streams or not streams[0].codec_context.name.startswith("pcm_"):
        return container
    container.close()
    # The format is known now: FFmpeg need not probe for it, nor read far to learn the stream (with large
    # packets its default 5 MB of stream probing took 40-90 ms per open).
    return media.open_container(Path(path), format="wav",
                                options={"max_size": str(WAV_PACKET_BYTES), "probesize": str(WAV_PACKET_BYTES)})


def _audio_stream(container):
    stream = media.audio_stream(container)
    stream.thread_type = "AUTO"
    return stream


def _resampled(container, stream) -> Iterator[tuple[float | None, np.ndarray]]:
    """(time of the source frame, 16 kHz mono float32 samples) for every frame, then the flush."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    start = stream.start_time or 0
    for frame in media.frames(container, stream):
        when = None if frame.pts is None else float((frame.pts - start) * stream.time_base)
        for out in resampler.resample(frame):
            yield when, out.to_ndarray().reshape(-1)
            when = None
    for out in resampler.resample(None):
        yield None, out.to_ndarray().reshape(-1)


def _aligned(first, pieces, start_s: float) -> Iterator[np.ndarray]:
    """After a seek (which lands at or before the target): drop the samples before `start_s`."""
    if first is None:
        return
    when, samples = first
    offset = round((start_s - when) * SAMPLE_RATE)
    if offset < 0:  # landed after the target (rare): keep the timeline by padding silence
        samples = np.concatenate([np.zeros(-offset, np.float32), samples])
        offset = 0
    yield from _skipped(_chain(samples, pieces), offset)


def _chain(first: np.ndarray, rest) -> Iterator[tuple[None, np.ndarray]]:
    yield None, first
    yield from rest


def _skipped(pieces, skip: int) -> Iterator[np.ndarray]:
    """Drop the first `skip` samples, then pass pieces through."""
    for _, samples in pieces:
        if skip >= len(samples):
            skip -= len(samples)
            continue
        yield samples[skip:] if skip else samples
        skip = 0


def _to_pts(stream, seconds: float) -> int:
    return int((stream.start_time or 0) + seconds / stream.time_base)
