"""Rendering transcription results: each response format's structure, and exact subtitle timestamps."""

from __future__ import annotations

import pytest

from jobs.formats import render, srt_time, to_srt, to_vtt, vtt_time


def _segment(i: int, start: float, end: float, text: str) -> dict:
    """A verbose_json segment."""
    return {"id": i, "seek": 0, "start": start, "end": end, "text": text, "tokens": [50363, 400, 50463],
            "temperature": 0.0, "avg_logprob": -0.2, "compression_ratio": 1.3, "no_speech_prob": 0.01}


RESULT = {
    "task": "transcribe", "language": "english", "duration": 7.25, "text": "Hello there. General Kenobi.",
    "segments": [_segment(0, 0.0, 1.5, " Hello there."), _segment(1, 1.5, 3661.25, " General Kenobi."),
                 _segment(2, 3661.25, 3662.0, " ")],
    "words": [{"word": "Hello", "start": 0.0, "end": 0.6}, {"word": "there.", "start": 0.6, "end": 1.5}],
}


@pytest.mark.parametrize(("seconds", "srt", "vtt"), [
    (0.0, "00:00:00,000", "00:00:00.000"),
    (1.5, "00:00:01,500", "00:00:01.500"),
    (59.9996, "00:01:00,000", "00:01:00.000"),  # rounds to the millisecond, carrying into minutes
    (3661.25, "01:01:01,250", "01:01:01.250"),
    (1.4999999, "00:00:01,500", "00:00:01.500"),
    (-0.001, "00:00:00,000", "00:00:00.000"),  # never negative
])
def test_timestamps(seconds, srt, vtt):
    assert srt_time(seconds) == srt
    assert vtt_time(seconds) == vtt


def test_json_is_text_only():
    body, mimetype = render(RESULT, "json")
    assert body == {"text": "Hello there. General Kenobi."}
    assert mimetype == "application/json"


def test_text_is_plain():
    body, mimetype = render(RESULT, "text")
    assert body == "Hello there. General Kenobi.\n"
    assert mimetype.startswith("text/plain")


def test_srt_cues_numbered_from_one_and_empty_segments_skipped():
    body, mimetype = render(RESULT, "srt")
    assert body == ("1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n"
                    "2\n00:00:01,500 --> 01:01:01,250\nGeneral Kenobi.\n")
    assert mimetype == "application/x-subrip; charset=utf-8"
    assert to_srt([]) == ""


def test_vtt_has_header_and_dotted_timestamps():
    body, mimetype = render(RESULT, "vtt")
    assert body == ("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n\n"
                    "00:00:01.500 --> 01:01:01.250\nGeneral Kenobi.\n")
    assert mimetype.startswith("text/vtt")
    assert to_vtt([]) == "WEBVTT\n"


def test_verbose_json_segments_by_default():
    body, mimetype = render(RESULT, "verbose_json")
    assert mimetype == "application/json"
    assert set(body) == {"task", "language", "duration", "text", "segments"}
    assert body["segments"][0] == RESULT["segments"][0]
    assert set(body["segments"][0]) == {"id", "seek", "start", "end", "text", "tokens", "temperature",
                                        "avg_logprob", "compression_ratio", "no_speech_prob"}


def test_verbose_json_granularities():
    words_only, _ = render(RESULT, "verbose_json", ("word",))
    assert "segments" not in words_only
    assert words_only["words"] == RESULT["words"]
    both, _ = render(RESULT, "verbose_json", ("segment", "word"))
    assert both["segments"] == RESULT["segments"] and both["words"] == RESULT["words"]
    no_words = {k: v for k, v in RESULT.items() if k != "words"}
    assert render(no_words, "verbose_json", ("word",))[0]["words"] == []


def test_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unknown response format"):
        render(RESULT, "docx")


def test_logprobs_come_with_json_and_verbose_json_when_asked_for():
    entries = [{"token": "Hello", "logprob": -0.1, "bytes": list(b"Hello")}]
    result = {**RESULT, "logprobs": entries}
    assert render(result, "json")[0] == {"text": RESULT["text"], "logprobs": entries}
    assert render(result, "verbose_json")[0]["logprobs"] == entries
    assert "logprobs" not in render(RESULT, "verbose_json")[0]
    assert render(result, "text")[0] == render(RESULT, "text")[0]


DIARIZED = {**RESULT, "segments": [{**RESULT["segments"][0], "speaker": "A"},
                                   {**RESULT["segments"][1], "speaker": "Dr <Who> & co"},
                                   {**RESULT["segments"][2], "speaker": "A"}]}


def test_diarized_json_is_openais_shape_without_empty_segments():
    body, mimetype = render(DIARIZED, "diarized_json")
    assert mimetype == "application/json"
    assert body == {"task": "transcribe", "duration": 7.25, "text": "Hello there. General Kenobi.", "segments": [
        {"type": "transcript.text.segment", "id": "seg_0", "start": 0.0, "end": 1.5, "text": "Hello there.",
         "speaker": "A"},
        {"type": "transcript.text.segment", "id": "seg_1", "start": 1.5, "end": 3661.25, "text": "General Kenobi.",
         "speaker": "Dr <Who> & co"}]}


def test_subtitles_carry_the_speakers():
    assert to_srt(DIARIZED["segments"]).splitlines()[2] == "[A] Hello there."
    vtt = to_vtt(DIARIZED["segments"]).splitlines()
    assert vtt[3] == "<v A>Hello there."
    assert vtt[6] == "<v Dr Who  co>General Kenobi."  # nothing that would end the voice tag early
    assert "<v" not in to_vtt(RESULT["segments"]) and "[" not in to_srt(RESULT["segments"])
