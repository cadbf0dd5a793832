"""Audio decoding with PyAV (no ffmpeg binary): any container/codec to 16 kHz mono float32, streamed.

Nothing here holds a whole decoded file: `iter_samples` yields small pieces, `AudioReader` keeps
only the window asked for, so a two-hour upload costs a few megabytes of memory, not hundreds.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator

import av
import numpy as np

SAMPLE_RATE = 16000
"""Whisper's sample rate: everything is resampled to it."""

_TAIL_CHECK_S = 1.0
"""probe() decodes this close to the declared end to notice a file cut short."""


class AudioError(ValueError):
    """The upload is not usable audio; the message says why (sent to the client as a 400)."""


def probe(path) -> float:
    """Return the duration in seconds, or raise AudioError if the file is not decodable audio."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise AudioError("empty audio (0 s): the file is empty")
    _check_wav_length(path)
    with _open(path) as container:
        stream = _audio_stream(container)
        duration = _declared_duration(container, stream)
        if duration is None:
            duration = _decoded_duration(container, stream)
        elif duration > 0 and not _decodes_near(container, stream, duration):
            duration = _recount(path, declared=duration)
    if duration <= 0:
        raise AudioError("empty audio (0 s): the file holds no samples")
    return duration


def _recount(path, declared: float) -> float:
    """The real duration of a file with nothing near its declared end (estimated from a bitrate, or cut)."""
    with _open(path) as container:
        duration = _decoded_duration(container, _audio_stream(container))
    if duration <= 0:
        raise AudioError(f"corrupt or truncated audio (declares {declared:.1f} s, no decodable samples)")
    return duration


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
        need = start - self._start + count
        if len(self._buf) < need and not self.exhausted:
            self._fill(need)
        self._buf = self._buf[start - self._start:]
        self._start = start
        return self._buf[:count].copy()

    def close(self) -> None:
        """Close the underlying file."""
        self._pieces.close()

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
    """Open a container, turning FFmpeg's refusal into a clear AudioError."""
    try:
        return av.open(str(path), metadata_errors="ignore")
    except av.error.FileNotFoundError:
        raise
    except av.error.FFmpegError as exc:
        raise AudioError(f"not an audio file (no known audio format could read it: {exc.strerror})") from exc


def _audio_stream(container):
    if not container.streams.audio:
        kinds = ", ".join(sorted({s.type for s in container.streams})) or "nothing"
        raise AudioError(f"no audio stream (the {container.format.name} file holds {kinds})")
    stream = container.streams.audio[0]
    stream.thread_type = "AUTO"
    return stream


def _declared_duration(container, stream) -> float | None:
    """Duration from the headers, without decoding (None when the container does not say)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _decoded_duration(container, stream) -> float:
    """Duration found by decoding everything (for streams that declare none, e.g. live WebM)."""
    return sum(frame.samples / frame.sample_rate for frame in _frames(container, stream))


def _decodes_near(container, stream, duration: float) -> bool:
    """Whether something decodes just before the declared end (a file cut short has nothing there)."""
    if stream.time_base is not None and duration > _TAIL_CHECK_S:
        container.seek(_to_pts(stream, duration - _TAIL_CHECK_S), stream=stream, backward=True)
    return next(_frames(container, stream), None) is not None


def _check_wav_length(path: Path) -> None:
    """A WAV whose data chunk claims more bytes than the file holds was cut short.

    FFmpeg quietly shortens such a file, so this is checked by reading the RIFF chunk headers.
    """
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return
        size = path.stat().st_size
        while len(chunk := f.read(8)) == 8:
            chunk_id, length = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if chunk_id == b"data":
                # 0 and 0xFFFFFFFF mean "unknown length" (written by a streaming recorder).
                if length not in (0, 0xFFFFFFFF) and f.tell() + length > size:
                    raise AudioError(f"corrupt or truncated audio (the WAV data is cut short: "
                                     f"{size - f.tell()} of {length} bytes)")
                return
            f.seek(length + (length & 1), 1)


def _frames(container, stream):
    """Decoded frames of `stream`; FFmpeg errors mid-stream mean a damaged file."""
    try:
        for packet in container.demux(stream):
            yield from packet.decode()
    except av.error.FFmpegError as exc:
        raise AudioError(f"corrupt or truncated audio ({exc.strerror})") from exc


def _resampled(container, stream) -> Iterator[tuple[float | None, np.ndarray]]:
    """(time of the source frame, 16 kHz mono float32 samples) for every frame, then the flush."""
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    start = stream.start_time or 0
    for frame in _frames(container, stream):
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
