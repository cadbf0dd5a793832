"""The up-front check of an audio upload: jobs.media's probe, answered as the API's errors.

The worker decodes the audio for real; this refuses, before anything is queued and with a message
saying why, what it could never transcribe: a file that is not audio (415), or audio that is
empty, corrupt, cut short or longer than the server allows (400).
"""

from __future__ import annotations

from pathlib import Path

from jobs.media import MediaError, MediaInfo, probe
from web.errors import APIError


def check_audio(path: Path, filename: str = "", max_duration_s: float | None = None) -> MediaInfo:
    """Probe `path`; return what it holds, or raise the APIError saying what is wrong."""
    try:
        return probe(path, max_duration_s)
    except MediaError as exc:
        raise media_error(exc, filename or path.name) from None


def media_error(exc: MediaError, label: str) -> APIError:
    """The API error for a refused upload: 415 unsupported_media_type, else 400 invalid_audio."""
    if exc.reason == "not_audio":
        return APIError(415, f"Unsupported file (not audio): '{label}': {exc}", "unsupported_media_type", "file",
                        reason=exc.reason)
    code = "audio_too_long" if exc.reason == "too_long" else "invalid_audio"
    return APIError(400, f"Invalid audio file ({exc.reason}): '{label}': {exc}", code, "file", reason=exc.reason)
