"""A light check that an upload is audio, with PyAV (FFmpeg's demuxers; no MLX, no full decode).

The worker decodes the audio for real; this only refuses, up front and with a message saying why,
what it could never transcribe: a file that is not an audio container (415), or an audio file that
is corrupt or holds no sound (400).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from web.errors import APIError

PROBE_SAMPLES = 4096
"""Samples decoded to prove the audio stream is decodable (a few hundred milliseconds at most)."""


@dataclass(frozen=True)
class AudioInfo:
    """What the check learned about an upload."""

    duration_s: float
    container: str
    codec: str


def _looks_like_audio(head: bytes) -> bool:
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


def invalid(reason: str, detail: str) -> APIError:
    """A 400 invalid_audio error whose message starts with the reason (corrupt, empty)."""
    return APIError(400, f"Invalid audio file ({reason}): {detail}", "invalid_audio", "file", reason=reason)


def not_audio(detail: str) -> APIError:
    """A 415 error for a file that is not an audio container at all."""
    return APIError(415, f"Unsupported file (not audio): {detail}", "unsupported_media_type", "file",
                    reason="not_audio")


def check_audio(path: Path, filename: str = "") -> AudioInfo:
    """Open `path` as media; return its duration, or raise the APIError saying what is wrong."""
    import av  # imported here: only upload routes pay for loading FFmpeg

    label = filename or path.name
    if path.stat().st_size == 0:
        raise invalid("empty", f"'{label}' has no content (0 bytes).")
    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            return _inspect(container, label)
    except av.FFmpegError as exc:
        with open(path, "rb") as f:
            head = f.read(16)
        if _looks_like_audio(head):
            raise invalid("corrupt", f"'{label}' looks like audio but cannot be read ({exc.strerror}).") from None
        raise not_audio(f"'{label}' is not a recognised audio container.") from None


def _inspect(container, label: str) -> AudioInfo:
    """Check the opened container has a decodable audio stream with some duration."""
    import av

    streams = list(container.streams.audio)
    if not streams:
        found = ", ".join(f"{s.type}/{s.codec_context.name}" for s in container.streams) or "no streams"
        raise not_audio(f"'{label}' contains no audio stream (found: {found}).")
    stream = streams[0]
    try:
        decoded = _decode_some(container, stream)
    except av.FFmpegError as exc:
        raise invalid("corrupt", f"the audio in '{label}' cannot be decoded ({exc.strerror}).") from None
    duration = _duration_s(container, stream)
    if decoded and duration <= 0:  # no declared duration (a bare stream): count the packets instead
        duration = decoded / (stream.codec_context.sample_rate or 16000) + _remaining_s(container, stream)
    if decoded == 0 or duration <= 0:
        raise invalid("empty", f"'{label}' contains no audio samples.")
    return AudioInfo(duration, container.format.name, stream.codec_context.name)


def _decode_some(container, stream) -> int:
    """Decode the first frames of `stream` and return how many samples came out."""
    samples = 0
    for frame in container.decode(stream):
        samples += frame.samples
        if samples >= PROBE_SAMPLES:
            break
    return samples


def _duration_s(container, stream) -> float:
    """The duration declared by the stream or the container (0.0 when neither declares one)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return 0.0


def _remaining_s(container, stream) -> float:
    """Seconds of audio in the packets not yet read (demuxed only, never decoded)."""
    ticks = sum(packet.duration or 0 for packet in container.demux(stream))
    return float(ticks * stream.time_base) if stream.time_base else 0.0
