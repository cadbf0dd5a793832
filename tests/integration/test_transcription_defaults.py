"""Safe defaults: with nothing said about chunking, a transcription invents no text in silence, on both demo
Whisper models (a minute of digital silence between two sentences, and a minute of digital zeros alone)."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from tests.integration.test_transcription import assert_wer
from tests.speech_clips import sentences, spaced, write

MODELS = ("whisper-tiny.en", "whisper-base")
GAP_S = 60.0
"""A whole minute: silence that a detector let through would reach Whisper as whole windows of it, where it
invents text (the sentence before it again, or "you")."""


@pytest.fixture(scope="module")
def gap_file(tmp_path_factory):
    """A sentence, a minute of digital silence, another sentence: (path, where the silence starts, the path of
    each sentence's own file, for its script)."""
    folder = tmp_path_factory.mktemp("defaults")
    before, after = sentences("garden", 2), sentences("train_journey", 2)
    path = write(spaced([before, after], GAP_S), folder / "gap.wav")
    return path, before.duration_s, write(before, folder / "before.wav"), write(after, folder / "after.wav")


@pytest.fixture(scope="module")
def zeros_file(tmp_path_factory):
    """A minute of digital zeros."""
    path = tmp_path_factory.mktemp("defaults") / "zeros.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes(np.zeros(int(GAP_S * 16000), np.int16).tobytes())
    return path


def transcribe(openai_client, model: str, path):
    """verbose_json of `path` with the defaults (no chunking_strategy, no language, no prompt)."""
    with open(path, "rb") as f:
        return openai_client.audio.transcriptions.create(model=model, file=f, response_format="verbose_json")


@pytest.mark.parametrize("model", MODELS)
def test_the_silent_minute_between_two_recordings_stays_silent(openai_client, model, gap_file):
    path, gap_start, first, second = gap_file
    result = transcribe(openai_client, model, path)
    in_the_gap = [seg for seg in result.segments
                  if seg.end > gap_start + 0.5 and seg.start < gap_start + GAP_S - 0.5]
    assert not in_the_gap, in_the_gap
    before = " ".join(seg.text for seg in result.segments if seg.end <= gap_start + 0.5)
    after = " ".join(seg.text for seg in result.segments if seg.start >= gap_start + GAP_S - 0.5)
    assert_wer(before, first, 0.3)
    assert_wer(after, second, 0.3)


@pytest.mark.parametrize("model", MODELS)
def test_a_minute_of_digital_zeros_gives_no_text(openai_client, model, zeros_file):
    result = transcribe(openai_client, model, zeros_file)
    assert result.text == "" and not result.segments, result
