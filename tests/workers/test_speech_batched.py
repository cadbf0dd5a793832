"""Batched transcription of the speech a voice activity detector finds (chunking_strategy "auto"): the
real Whisper tiny.en and the real Silero VAD, against the sequential path on the same recordings."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from tests.conftest import REPO
from tests.long_audio import build, fixture_names, script_for
from tests.workers.test_speech import assert_timeline, model, ref, wer, worker_parts  # noqa: F401  (fixtures)
from workers import vad
from workers.backends import whisper, whisper_batch

SPEECH = REPO / "tests" / "fixtures" / "speech"
GAP_S = 60.0


def samples_of(name: str) -> np.ndarray:
    """A fixture's 16 kHz mono samples as float32."""
    with wave.open(str(SPEECH / f"{name}.wav")) as f:
        assert f.getframerate() == 16000 and f.getnchannels() == 1
        return np.frombuffer(f.readframes(f.getnframes()), np.int16).astype(np.float32) / 32768


@pytest.fixture(scope="module")
def gap_file(tmp_path_factory):
    """garden, a minute of digital silence, numbers: (path, where the silence starts)."""
    garden, numbers = samples_of("garden"), samples_of("numbers")
    audio = np.concatenate([garden, np.zeros(int(GAP_S * 16000), np.float32), numbers])
    path = tmp_path_factory.mktemp("vad") / "gap.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes((audio * 32767).astype(np.int16).tobytes())
    return path, len(garden) / 16000


def speech_segments(model, path, start_state=None, stop_after=None, batch=2) -> list[whisper.ChunkResult]:  # noqa: F811
    """The chunks of a batched transcription of the detected speech (stopping after `stop_after` chunks)."""
    chunks = []
    for chunk in whisper_batch.transcribe_batches(model, path, whisper.Options(), start_state,
                                                  vad.speech_pieces(path), batch):
        chunks.append(chunk)
        if stop_after and len(chunks) == stop_after:
            break
    return chunks


def test_the_silent_minute_is_skipped_and_the_speech_transcribed(model, gap_file):  # noqa: F811
    path, gap_start = gap_file
    chunks = speech_segments(model, path)
    segments = [seg for chunk in chunks for seg in chunk.segments]
    assert_timeline(segments)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    for seg in segments:  # nothing in the silence (the detector pads speech by at most 0.2 s)
        assert seg["end"] <= gap_start + 0.5 or seg["start"] >= gap_start + GAP_S - 0.5, seg
    text = " ".join(seg["text"] for seg in segments)
    reference = (SPEECH / "garden.txt").read_text() + " " + (SPEECH / "numbers.txt").read_text()
    # Against the two recordings transcribed on their own, one after the other (no silence to cross).
    alone = " ".join(seg["text"] for name in ("garden", "numbers")
                     for c in whisper.transcribe_chunks(model, SPEECH / f"{name}.wav", whisper.Options())
                     for seg in c.segments)
    assert wer(reference, text) <= wer(reference, alone) + 0.02, (text, alone)


def test_a_resumed_transcription_of_the_speech_gives_the_same_segments(model, gap_file):  # noqa: F811
    path, _ = gap_file
    whole = [seg for chunk in speech_segments(model, path, batch=1) for seg in chunk.segments]
    first = speech_segments(model, path, stop_after=1, batch=1)
    assert not first[0].finished
    rest = speech_segments(model, path, start_state=first[0].state, batch=1)  # as a new worker would, after a crash
    resumed = first[0].segments + [seg for chunk in rest for seg in chunk.segments]
    assert [(s["start"], s["end"], s["text"]) for s in resumed] == [(s["start"], s["end"], s["text"]) for s in whole]


def test_a_silent_file_gives_no_segment(model, tmp_path):  # noqa: F811
    path = tmp_path / "silence.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes(np.zeros(16000 * 20, np.int16).tobytes())
    chunks = speech_segments(model, path)
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].segments == []


def test_a_long_file_batched_matches_the_sequential_path(model):  # noqa: F811
    """The batched transcript of a 2-minute concatenation of the fixtures is as good as the sequential
    path's transcript of the same recordings (each decoded window after window on its own: the long
    file only repeats them), with timestamps in order that cover the whole file."""
    # Two minutes are five speech pieces: in batches of two, three batches and two seams between them,
    # which is all that length proves (a 10-minute file took 5x as long to show the same).
    path = build(2)
    chunks = list(whisper_batch.transcribe_batches(model, path, whisper.Options(), None,
                                                   vad.speech_pieces(path), 2))
    segments = [seg for chunk in chunks for seg in chunk.segments]
    assert_timeline(segments)
    assert chunks[-1].finished and len(chunks) >= 3
    batched = wer(script_for(path), " ".join(seg["text"] for seg in segments))
    names = fixture_names()
    reference = " ".join((SPEECH / f"{name}.txt").read_text() for name in names)
    sequential = " ".join(seg["text"] for name in names
                          for c in whisper.transcribe_chunks(model, SPEECH / f"{name}.wav", whisper.Options())
                          for seg in c.segments)
    print(f"\n2-minute file: batched WER {batched:.3%} in {len(chunks)} batches; "
          f"sequential on the recordings {wer(reference, sequential):.3%}")
    assert batched <= wer(reference, sequential) + 0.02
    with wave.open(str(path)) as f:
        length_s = f.getnframes() / f.getframerate()
    assert segments[-1]["end"] == pytest.approx(length_s, abs=3.0)
