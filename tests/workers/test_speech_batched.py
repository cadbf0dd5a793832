"""Batched transcription of the speech a voice activity detector finds (chunking_strategy "auto"): the
real Whisper tiny.en and the real Silero VAD, against the sequential path on the same recordings."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO
from tests.speech_clips import Clip, script_of, spaced, whole, write
from tests.workers.test_speech import assert_timeline, model, ref, wer, worker_parts  # noqa: F401  (fixtures)
from workers import vad
from workers.backends import whisper, whisper_batch

SPEECH = REPO / "tests" / "fixtures" / "speech"
GAP_S = 60.0
RECORDINGS = ("garden", "numbers")
"""The recordings the tests here transcribe, which the long file repeats."""


def samples_of(name: str) -> np.ndarray:
    """A fixture's 16 kHz mono samples as float32."""
    with wave.open(str(SPEECH / f"{name}.wav")) as f:
        assert f.getframerate() == 16000 and f.getnchannels() == 1
        return np.frombuffer(f.readframes(f.getnframes()), np.int16).astype(np.float32) / 32768


@pytest.fixture(scope="module")
def alone(model) -> dict[str, str]:  # noqa: F811
    """The sequential path's transcript of each recording, each on its own: the reference of both tests that
    compare the batched path's quality with the sequential one's."""
    return {name: " ".join(seg["text"] for c in whisper.transcribe_chunks(model, SPEECH / f"{name}.wav",
                                                                          whisper.Options())
                           for seg in c.segments)
            for name in RECORDINGS}


@pytest.fixture(scope="module")
def long_file(tmp_path_factory) -> tuple[Path, float]:
    """The two recordings three times over, back to back (1.5 min), a minute of digital silence, numbers again:
    (path, where the silence starts). Five speech pieces of at most 30 s, the first four cut inside the speech,
    so in batches of two, three batches and two seams between them; the last batch is numbers on its own."""
    # Two minutes of speech (less: one misheard sentence at a seam is already 2% over a minute, the slack the
    # transcript is held to), and the silent minute of the detector's test inside it rather than in a file of
    # its own: one batched transcription shows both (a 10-minute file took 5x as long to show what two show).
    before = spaced([whole(name) for name in RECORDINGS * 3], gap_s=0.5)
    speech = spaced([before, Clip(np.zeros(round(GAP_S * 16000), np.int16), ""), whole(RECORDINGS[1])], gap_s=0.0)
    return write(speech, tmp_path_factory.mktemp("long") / "long.wav"), before.duration_s


@pytest.fixture(scope="module")
def long_chunks(model, long_file) -> list[whisper.ChunkResult]:  # noqa: F811
    """The uninterrupted batched transcription of `long_file`, two pieces a batch."""
    return speech_segments(model, long_file[0])


def speech_segments(model, path, start_state=None, batch=2) -> list[whisper.ChunkResult]:  # noqa: F811
    """The chunks of a batched transcription of the detected speech."""
    return list(whisper_batch.transcribe_batches(model, path, whisper.Options(), start_state,
                                                 vad.speech_pieces(path), batch))


def test_the_silent_minute_is_skipped_and_the_speech_transcribed(long_chunks, long_file, alone):
    # The minute stays: a detector that let silence through would hand Whisper whole windows of it.
    gap_start = long_file[1]
    segments = [seg for chunk in long_chunks for seg in chunk.segments]
    for seg in segments:  # nothing in the silence (the detector pads speech by at most 0.2 s)
        assert seg["end"] <= gap_start + 0.5 or seg["start"] >= gap_start + GAP_S - 0.5, seg
    # The speech after it (numbers, a batch of its own) as well as the recording transcribed on its own.
    after = " ".join(seg["text"] for seg in segments if seg["start"] >= gap_start + GAP_S - 0.5)
    reference = (SPEECH / "numbers.txt").read_text()
    assert wer(reference, after) <= wer(reference, alone["numbers"]) + 0.02, (after, alone["numbers"])


def test_a_resumed_transcription_of_the_speech_gives_the_same_segments(model, long_file, long_chunks):  # noqa: F811
    before = long_chunks[:-1]  # the run stops after the batch before the last one...
    assert not before[-1].finished
    # ...and a new worker goes on after the crash from the checkpointed state, which went through JSON.
    state = whisper.ResumeState.from_dict(json.loads(json.dumps(before[-1].state.to_dict())))
    rest = speech_segments(model, long_file[0], start_state=state)
    resumed = [seg for chunk in before + rest for seg in chunk.segments]
    whole = [seg for chunk in long_chunks for seg in chunk.segments]
    assert [(s["start"], s["end"], s["text"]) for s in resumed] == [(s["start"], s["end"], s["text"]) for s in whole]


def test_a_silent_file_gives_no_segment(model, tmp_path):  # noqa: F811
    path = tmp_path / "silence.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes(np.zeros(16000 * 20, np.int16).tobytes())
    chunks = speech_segments(model, path)
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].segments == []


def test_a_long_file_batched_matches_the_sequential_path(long_file, long_chunks, alone):
    """The batched transcript of a concatenation of the fixtures is as good as the sequential path's
    transcript of the same recordings (each decoded window after window on its own), with timestamps in
    order that cover the whole file."""
    path = long_file[0]
    segments = [seg for chunk in long_chunks for seg in chunk.segments]
    assert_timeline(segments)
    assert long_chunks[-1].finished and len(long_chunks) >= 3
    assert not any(chunk.finished for chunk in long_chunks[:-1])
    batched = wer(script_of(path), " ".join(seg["text"] for seg in segments))
    reference = " ".join((SPEECH / f"{name}.txt").read_text() for name in RECORDINGS)
    sequential = " ".join(alone[name] for name in RECORDINGS)
    print(f"\n2 minutes of speech: batched WER {batched:.3%} in {len(long_chunks)} batches; "
          f"sequential on the recordings {wer(reference, sequential):.3%}")
    assert batched <= wer(reference, sequential) + 0.02
    with wave.open(str(path)) as f:
        length_s = f.getnframes() / f.getframerate()
    assert segments[-1]["end"] == pytest.approx(length_s, abs=3.0)
