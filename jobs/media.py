"""Probing an uploaded file with PyAV (FFmpeg's demuxers, no MLX): is it audio, how long, is it whole.

The web tier probes every upload before anything is queued, so a client hears at once, with a
reason, what could never be transcribed; the worker probes again before it starts (a job may come
from elsewhere than the API). A probe decodes only the first frames and a frame near the declared
end; it reads the whole file only when the two disagree.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import av

PROBE_SAMPLES = 4096
"""Samples decoded at the start to prove the audio stream is decodable."""

TAIL_CHECK_S = 1.0
"""A frame is decoded this long before the declared end, to notice a file cut short."""

_OGG_TAIL_BYTES = 64 * 1024  # an Ogg page is at most 65,307 bytes; the last one starts in this tail


class MediaError(ValueError):
    """An upload that cannot be transcribed; `reason` is one of the REASONS, the message says why."""

    REASONS = ("empty", "corrupt", "truncated", "not_audio", "too_long")

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    @property
    def status(self) -> int:
        """The HTTP status a client gets: 415 for a file that is not audio at all, else 400."""
        return 415 if self.reason == "not_audio" else 400


@dataclass(frozen=True)
class MediaInfo:
    """What a probe learned about a file."""

    duration_s: float
    container: str
    codec: str


def probe(path, max_duration_s: float | None = None) -> MediaInfo:
    """Check that `path` holds whole, decodable audio (at most `max_duration_s` long); describe it."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise MediaError("empty", "empty audio (0 s): the file is empty")
    _check_wav_length(path)
    with open_container(path) as container:
        stream = audio_stream(container)
        if _decode_start(container, stream) == 0:
            raise MediaError("empty", "empty audio (0 s): the file holds no samples")
        info = MediaInfo(_duration(path, container, stream), container.format.name, stream.codec_context.name)
    if info.duration_s <= 0:
        raise MediaError("empty", "empty audio (0 s): the file holds no samples")
    if info.container == "ogg":
        _check_ogg_end(path)
    if max_duration_s and info.duration_s > max_duration_s:
        raise MediaError("too_long", f"audio too long ({info.duration_s:.0f} s; the limit is "
                                     f"{max_duration_s:.0f} s)")
    return info


def _duration(path: Path, container, stream) -> float:
    """The declared duration when the file really reaches it, else the duration counted from its packets."""
    declared = declared_duration(container, stream)
    if declared is None or declared <= 0:
        return _counted_duration(path)
    reached = _time_near_end(container, stream, declared)
    slack = max(TAIL_CHECK_S + 2.0, 0.05 * declared)  # seeking in some formats (mp3) is approximate
    if reached is not None and reached >= declared - slack:
        return declared
    counted = _counted_duration(path)
    if counted < declared - slack:
        raise MediaError("truncated", f"corrupt or truncated audio (it declares {declared:.1f} s but holds "
                                      f"only {counted:.1f} s)")
    return counted


def declared_duration(container, stream) -> float | None:
    """Duration from the headers, without decoding (None when the container does not say)."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def open_container(path: Path, format: str | None = None, options: dict[str, str] | None = None):
    """Open a container (with FFmpeg's `format` and demuxer `options`, if given); a file FFmpeg cannot open is
    corrupt audio if it looks like audio, else not audio."""
    try:
        return av.open(str(path), format=format, options=options or {}, metadata_errors="ignore")
    except av.error.FileNotFoundError:
        raise
    except av.FFmpegError as exc:
        with open(path, "rb") as f:
            head = f.read(16)
        if looks_like_audio(head):
            raise MediaError("corrupt", f"corrupt or truncated audio (it looks like audio but cannot be read: "
                                        f"{exc.strerror})") from None
        raise MediaError("not_audio", f"not an audio file (no known audio format could read it: "
                                      f"{exc.strerror})") from None


def audio_stream(container):
    """The first audio stream; a container without one is not audio."""
    if not container.streams.audio:
        kinds = ", ".join(f"{s.type}/{s.codec_context.name}" for s in container.streams) or "nothing"
        raise MediaError("not_audio", f"no audio stream (the {container.format.name} file holds {kinds})")
    return container.streams.audio[0]


def frames(container, stream):
    """Decoded frames of `stream`; an FFmpeg error mid-stream means a damaged file."""
    try:
        for packet in container.demux(stream):
            yield from packet.decode()
    except av.FFmpegError as exc:
        raise MediaError("corrupt", f"corrupt or truncated audio ({exc.strerror})") from None


def _decode_start(container, stream) -> int:
    """Decode the first frames of `stream`; return how many samples came out."""
    samples = 0
    for frame in frames(container, stream):
        samples += frame.samples
        if samples >= PROBE_SAMPLES:
            break
    return samples


def _time_near_end(container, stream, declared: float) -> float | None:
    """Seconds into the stream of the first frame decoded after seeking just before the declared end."""
    if stream.time_base is None:
        return None
    start = stream.start_time or 0
    container.seek(start + int(max(0.0, declared - TAIL_CHECK_S) / stream.time_base), stream=stream,
                   backward=True)
    frame = next(frames(container, stream), None)
    if frame is None or frame.pts is None:
        return None
    return float((frame.pts - start) * stream.time_base) + frame.samples / (frame.sample_rate or 1)


def _counted_duration(path: Path) -> float:
    """The duration found by reading the whole stream: packet durations, else decoded samples."""
    with open_container(path) as container:
        stream = audio_stream(container)
        ticks = 0
        for packet in container.demux(stream):
            if packet.size and not packet.duration:
                break  # a packet with no duration: count by decoding instead
            ticks += packet.duration or 0
        else:
            return float(ticks * stream.time_base) if stream.time_base else 0.0
    with open_container(path) as container:
        stream = audio_stream(container)
        return sum(frame.samples / frame.sample_rate for frame in frames(container, stream))


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
                    raise MediaError("truncated", f"corrupt or truncated audio (the WAV data is cut short: "
                                                  f"{size - f.tell()} of {length} bytes)")
                return
            f.seek(length + (length & 1), 1)


def _check_ogg_end(path: Path) -> None:
    """An Ogg stream ends with a page flagged end-of-stream; a file cut short ends without one.

    FFmpeg computes an Ogg file's duration from its last page, so a cut file declares its cut length.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(max(0, size - _OGG_TAIL_BYTES))
        tail = f.read()
    last = tail.rfind(b"OggS\x00")  # capture pattern and stream structure version 0
    if last < 0 or len(tail) < last + 27:
        raise MediaError("truncated", "corrupt or truncated audio (the Ogg stream has no last page)")
    header_type, segments = tail[last + 5], tail[last + 26]
    table_end = last + 27 + segments
    complete = len(tail) >= table_end and len(tail) >= table_end + sum(tail[last + 27:table_end])
    if not (header_type & 0x04 and complete):
        raise MediaError("truncated", "corrupt or truncated audio (the Ogg stream ends without its last page)")


def looks_like_audio(head: bytes) -> bool:
    """Whether the first bytes carry the signature of a common audio container."""
    if head[:4] == b"RIFF" and head[8:12] in (b"WAVE", b"RF64"):
        return True
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return True
    if head[4:8] == b"ftyp":  # mp4 / m4a / mov family
        return True
    if len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:  # MPEG audio / ADTS frame sync
        return True
    return head.startswith((b"OggS", b"fLaC", b"ID3", b"\x1aE\xdf\xa3", b"#!AMR", b"caff", b".snd",
                            b"MAC ", b"wvpk"))
