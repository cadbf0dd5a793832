"""Rendering a transcription result in the response formats OpenAI's API offers.

The canonical result is OpenAI's `verbose_json`: {"task", "language", "duration", "text",
"segments": [{"id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
"compression_ratio", "no_speech_prob"}], "words": [{"word", "start", "end"}], "logprobs": [{"token",
"logprob", "bytes"}]} where `words` is present only when word timestamps were asked for, and `logprobs`
only with include[]=logprobs. A diarized result's segments and words also carry a `speaker` ("A", "B", ... or a
known speaker's name). Everything else is derived from it.
"""

from __future__ import annotations

FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")
"""The `response_format` values /v1/audio/transcriptions accepts (diarized_json: of a diarized transcription)."""

GRANULARITIES = ("segment", "word")
"""The `timestamp_granularities[]` values (they only shape verbose_json)."""

JSON_MIMETYPE = "application/json"
TEXT_MIMETYPE = "text/plain; charset=utf-8"
SRT_MIMETYPE = "application/x-subrip; charset=utf-8"
VTT_MIMETYPE = "text/vtt; charset=utf-8"

TEXT_MIMETYPES = {"text": TEXT_MIMETYPE, "srt": SRT_MIMETYPE, "vtt": VTT_MIMETYPE}
"""The content type each plain-text format is served as (a subtitle's own type: a browser's <track> wants
text/vtt; OpenAI's clients read any of them as a string)."""


def render(result: dict, fmt: str, granularities=("segment",)) -> tuple[str | dict, str]:
    """Return (body, mimetype) for `result` in format `fmt`; a dict body is to be sent as JSON."""
    if fmt == "json":
        return {"text": result["text"], **logprobs_field(result)}, JSON_MIMETYPE
    if fmt == "text":
        return result["text"] + "\n", TEXT_MIMETYPE
    if fmt == "srt":
        return to_srt(result["segments"]), SRT_MIMETYPE
    if fmt == "vtt":
        return to_vtt(result["segments"]), VTT_MIMETYPE
    if fmt == "verbose_json":
        return verbose(result, granularities), JSON_MIMETYPE
    if fmt == "diarized_json":
        return diarized(result), JSON_MIMETYPE
    raise ValueError(f"unknown response format {fmt!r}; expected one of {', '.join(FORMATS)}")


def verbose(result: dict, granularities=("segment",)) -> dict:
    """The verbose_json body: segments and/or words as the granularities ask (OpenAI's rules)."""
    body = {key: result[key] for key in ("task", "language", "duration", "text")}
    if "segment" in granularities or "word" not in granularities:
        body["segments"] = result["segments"]
    if "word" in granularities:
        body["words"] = result.get("words") or []
    return {**body, **logprobs_field(result)}


def diarized(result: dict) -> dict:
    """OpenAI's diarized_json body: the text, then each segment with its speaker."""
    segments = [{"type": "transcript.text.segment", "id": f"seg_{n}", "start": seg["start"], "end": seg["end"],
                 "text": seg["text"].strip(), "speaker": seg.get("speaker")}
                for n, seg in enumerate(_spoken(result["segments"]))]
    return {"task": result["task"], "duration": result["duration"], "text": result["text"], "segments": segments}


def logprobs_field(data: dict) -> dict:
    """{"logprobs": [...]} where `data` (a result, or a segment event's data) carries the text tokens'
    log-probabilities (include[]=logprobs), else {}."""
    return {"logprobs": data["logprobs"]} if "logprobs" in data else {}


def srt_time(seconds: float) -> str:
    """Format seconds as an SRT timestamp: 00:00:01,500."""
    return _clock(seconds, ",")


def vtt_time(seconds: float) -> str:
    """Format seconds as a WebVTT timestamp: 00:00:01.500."""
    return _clock(seconds, ".")


def to_srt(segments: list[dict]) -> str:
    """SubRip text: numbered cues from 1, blank line after each."""
    cues = [
        f"{n}\n{srt_time(seg['start'])} --> {srt_time(seg['end'])}\n{_srt_voice(seg)}{seg['text'].strip()}\n"
        for n, seg in enumerate(_spoken(segments), start=1)
    ]
    return "\n".join(cues)


def to_vtt(segments: list[dict]) -> str:
    """WebVTT text: the WEBVTT header, then one cue per segment."""
    cues = [f"{vtt_time(seg['start'])} --> {vtt_time(seg['end'])}\n{_vtt_voice(seg)}{seg['text'].strip()}\n"
            for seg in _spoken(segments)]
    return "\n".join(["WEBVTT\n", *cues])


def _srt_voice(seg: dict) -> str:
    """A diarized cue's speaker as SubRip has no tag for it: "[A] " before the text."""
    return f"[{seg['speaker']}] " if seg.get("speaker") else ""


def _vtt_voice(seg: dict) -> str:
    """A diarized cue's speaker as a WebVTT voice span: "<v A>" (characters that would end the tag dropped)."""
    if not seg.get("speaker"):
        return ""
    return "<v " + "".join(c for c in seg["speaker"] if c not in "<>&\n") + ">"


def _spoken(segments: list[dict]) -> list[dict]:
    """Segments with text (an empty cue is invalid in SRT and useless in VTT)."""
    return [seg for seg in segments if seg["text"].strip()]


def _clock(seconds: float, separator: str) -> str:
    """HH:MM:SS<sep>mmm, rounded to the millisecond (so 1.4999999 prints as 1.500)."""
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"
