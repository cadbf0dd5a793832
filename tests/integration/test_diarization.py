"""Who spoke when, end to end: two synthetic voices taking turns (espeak-ng's US voice and its higher female
variant, tests/fixtures/speech/voice_b), transcribed by the real worker with diarize on."""

from __future__ import annotations

import base64
import io
import itertools
import json
import wave
from pathlib import Path

import pytest

from tests.integration.test_transcription import MODEL, read_sse, submit_job
from tests.speech_clips import Clip, sentences, spaced, write

GAP_S = 1.0
"""The pause between two turns."""

TURNS = (("A", "garden", 0), ("B", "voice_b/river", 0), ("A", "garden", 1), ("B", "voice_b/river", 1))
"""Who speaks each turn: a sentence of a fixture of their voice."""


@pytest.fixture(scope="module")
def conversation(tmp_path_factory) -> tuple[Path, list[tuple[str, float, float]]]:
    """The A-B-A-B recording and its truth: (voice, start_s, end_s) per turn."""
    clips = [sentences(name, index) for _, name, index in TURNS]
    truth, at = [], 0.0
    for (voice, _, _), clip in zip(TURNS, clips, strict=True):
        truth.append((voice, at, at + clip.duration_s))
        at += clip.duration_s + GAP_S
    return write(spaced(clips, GAP_S), tmp_path_factory.mktemp("voices") / "turns.wav"), truth


def data_url(clip: Clip) -> str:
    """A clip as a WAV data URL (a known speaker's reference clip)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1), wav.setsampwidth(2), wav.setframerate(16000)
        wav.writeframes(clip.samples.tobytes())
    return "data:audio/wav;base64," + base64.b64encode(out.getvalue()).decode()


def agreement(segments: list[dict], truth, names: dict[str, str] | None = None) -> float:
    """The share of the turns' time that segments give to the right speaker: under `names` (voice -> label),
    else under the best matching of labels to voices."""
    labels = sorted({seg["speaker"] for seg in segments})
    voices = sorted({voice for voice, _, _ in truth})
    mappings = [names] if names else [dict(zip(voices, chosen, strict=True)) for chosen in itertools.permutations(labels, len(voices))]
    total = sum(end - start for _, start, end in truth)
    best = 0.0
    for mapping in mappings:
        right = sum(max(0.0, min(end, seg["end"]) - max(start, seg["start"]))
                    for voice, start, end in truth for seg in segments if seg["speaker"] == mapping[voice])
        best = max(best, right / total)
    return best


def transcribe(api, audio: Path, **form):
    """POST the recording to /v1/audio/transcriptions with `form`."""
    with open(audio, "rb") as f:
        return api.post("/v1/audio/transcriptions", data={"model": MODEL, **form}, files={"file": (audio.name, f)})


def test_two_voices_taking_turns_are_told_apart(api, conversation):
    audio, truth = conversation
    response = transcribe(api, audio, response_format="diarized_json")
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"task", "duration", "text", "segments"} and body["text"]
    segments = body["segments"]
    assert all(set(seg) == {"type", "id", "start", "end", "text", "speaker"} for seg in segments)
    assert all(seg["type"] == "transcript.text.segment" for seg in segments)
    assert len({seg["speaker"] for seg in segments}) == 2, segments
    assert {seg["speaker"] for seg in segments} == {"A", "B"}
    assert agreement(segments, truth) >= 0.9, segments


def test_known_speakers_are_named_in_every_format_and_event(api, conversation):
    audio, truth = conversation
    names = {"A": "Ann", "B": "Bob"}
    job = submit_job(api, audio, content=audio.read_bytes(), diarize="true", response_format="verbose_json",
                     **{"timestamp_granularities[]": "word", "known_speaker_names[]": ["Bob", "Ann"],
                        "known_speaker_references[]": [data_url(sentences("voice_b/river", 2)),
                                                      data_url(sentences("garden", 2))]})
    events = read_sse(api, job["links"]["events"])
    assert events[-1]["event"] == "done", events[-1]
    segment_events = [e["data"] for e in events if e["event"] == "segment"]
    assert segment_events and all(e["segment"]["speaker"] in ("Ann", "Bob") for e in segment_events)
    assert all(w["speaker"] == e["segment"]["speaker"] for e in segment_events for w in e["words"])
    result = events[-1]["data"]["result"]
    assert agreement(result["segments"], truth, names) >= 0.9, result["segments"]
    assert result["words"] and all(w["speaker"] in ("Ann", "Bob") for w in result["words"])

    diarized = api.get(job["links"]["result"], params={"format": "diarized_json"}).json()
    assert [s["speaker"] for s in diarized["segments"]] == [s["speaker"] for s in result["segments"] if s["text"].strip()]
    srt = api.get(job["links"]["result"], params={"format": "srt"}).text
    vtt = api.get(job["links"]["result"], params={"format": "vtt"}).text
    cue_speakers = [s["speaker"] for s in result["segments"] if s["text"].strip()]
    assert [line[1:4] for line in srt.splitlines() if line.startswith("[")] == cue_speakers
    assert [line[3:6] for line in vtt.splitlines() if line.startswith("<v ")] == cue_speakers


def test_a_job_not_diarized_has_no_diarized_json(api):
    job = submit_job(api, "birds.wav", content=base64.b64decode(data_url(sentences("garden", 2)).split(",", 1)[1]))
    events = read_sse(api, job["links"]["events"])
    assert events[-1]["event"] == "done"
    assert all("speaker" not in seg for seg in events[-1]["data"]["result"]["segments"])
    response = api.get(job["links"]["result"], params={"format": "diarized_json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "format"


@pytest.mark.parametrize("form, param", [
    ({"diarize": "true", "stream": "true"}, "diarize"),
    ({"response_format": "diarized_json", "known_speaker_names[]": "Ann"}, "known_speaker_references[]"),
    ({"min_speakers": "2"}, "min_speakers"),
    ({"known_speaker_names[]": "Ann", "known_speaker_references[]": "data:audio/wav;base64,AAAA"},
     "known_speaker_names[]"),
    ({"diarize": "true", "min_speakers": "3", "max_speakers": "2"}, "max_speakers"),
    ({"diarize": "true", "known_speaker_names[]": "<v>", "known_speaker_references[]": "x"}, "known_speaker_names[].0"),
    ({"diarize": "true", "known_speaker_names[]": "Ann", "known_speaker_references[]": "https://x/a.wav"},
     "known_speaker_references[].0"),
    ({"diarize": "true", "known_speaker_names[]": "Ann", "known_speaker_references[]": "short"},
     "known_speaker_references[].0"),
])
def test_bad_diarization_fields(api, conversation, form, param):
    audio, _ = conversation
    if form.get("known_speaker_references[]") == "short":
        half_a_second = Clip(sentences("garden", 0).samples[:8000], "")
        form = {**form, "known_speaker_references[]": data_url(half_a_second)}
    response = transcribe(api, audio, **form)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert json.dumps(error)  # the envelope, never a traceback
