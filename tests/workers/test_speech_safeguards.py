"""Whisper's safeguards on the sequential path (pure logic: the prompt after a window, the speech a window
may cover), and the detector keeping a minute of digital zeros from being decoded at all (real model)."""

from __future__ import annotations

import wave

import numpy as np
import pytest
from mlx_audio.stt.models.whisper.decoding import DecodingResult

from workers.backends import whisper
from workers.backends.segments import SpeechSpans

PROMPT, TEXT = [1, 2, 3], [4, 5]


def result(temperature=0.0, no_speech=0.1, avg_logprob=-0.3) -> DecodingResult:
    """A window's decoding outcome with these scores."""
    return DecodingResult(audio_features=None, language="en", tokens=TEXT, text="text", avg_logprob=avg_logprob,
                          no_speech_prob=no_speech, temperature=temperature, compression_ratio=1.2)


def test_a_trusted_window_prompts_the_next_with_the_text_so_far():
    assert whisper.next_prompt(PROMPT, TEXT, result()) == PROMPT + TEXT


def test_the_prompt_is_kept_to_its_tail():
    long = list(range(300))
    assert whisper.next_prompt(long, TEXT, result()) == (long + TEXT)[-223:]


@pytest.mark.parametrize("window", [result(temperature=0.6), result(temperature=1.0),
                                    result(no_speech=0.9, avg_logprob=-1.5)], ids=["hot", "hottest", "silent"])
def test_after_a_hot_or_silent_window_the_prompt_is_dropped(window):
    assert whisper.next_prompt(PROMPT, TEXT, window) == []


def test_a_window_starts_in_speech_and_ends_where_its_piece_ends():
    spans = SpeechSpans([(1.0, 5.0), (70.0, 90.0)])
    assert whisper._speech_from(spans, 0) == (100, 500)  # silence before the speech: skipped
    assert whisper._speech_from(spans, 300) == (300, 500)  # the rest of a piece
    assert whisper._speech_from(spans, 500) == (7000, 9000)  # a minute of silence: skipped
    assert whisper._speech_from(spans, 9000) is None  # no speech left


def test_a_tail_shorter_than_half_a_second_is_not_decoded_again():
    spans = SpeechSpans([(1.0, 5.0), (8.0, 9.0)])
    assert whisper._speech_from(spans, 460) == (800, 900)  # 0.4 s left of the first piece: next piece
    assert whisper._speech_from(spans, 860) is None


def test_a_minute_of_digital_zeros_is_never_decoded(tmp_path, models_dir):
    path = tmp_path / "zeros.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes(np.zeros(60 * 16000, np.int16).tobytes())
    model, _ = whisper.load(models_dir / "whisper-tiny.en")
    chunks = list(whisper.transcribe_chunks(model, path, whisper.Options()))
    assert len(chunks) == 1 and chunks[0].finished and chunks[0].segments == []
    assert chunks[0].state.seek == 0  # nothing read past the start: no window decoded
