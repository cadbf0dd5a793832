"""Probing uploads: whole files pass; files cut short, or longer than allowed, are refused with a reason."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from jobs.media import MediaError, probe
from tests.audio_files import encode
from tests.conftest import REPO

SPEECH = REPO / "tests" / "fixtures" / "speech"
GARDEN = SPEECH / "garden.wav"


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """garden.wav as Opus in Ogg, MP3 and FLAC, each whole and cut in half."""
    folder = tmp_path_factory.mktemp("media")
    files = {}
    for ext, container, codec in [("ogg", "ogg", "libopus"), ("mp3", "mp3", "libmp3lame"), ("flac", "flac", "flac")]:
        whole = folder / f"garden.{ext}"
        encode(GARDEN, whole, container, codec, 48000 if codec == "libopus" else 16000, layout="mono")
        half = folder / f"half.{ext}"
        data = whole.read_bytes()
        half.write_bytes(data[: len(data) // 2])
        files[ext] = (whole, half)
    return files


@pytest.mark.parametrize("ext", ["ogg", "mp3", "flac"])
def test_a_whole_file_passes_and_the_same_file_cut_in_half_is_truncated(encoded, ext):
    whole, half = encoded[ext]
    assert probe(whole).duration_s == pytest.approx(14.96, abs=0.1)
    with pytest.raises(MediaError) as refused:
        probe(half)
    assert refused.value.reason == "truncated" and refused.value.status == 400
    assert str(refused.value).startswith("corrupt or truncated audio")


def test_the_repository_ogg_fixture_is_whole():
    assert probe(SPEECH / "weather.ogg").container == "ogg"


def test_a_tiny_file_declaring_hours_is_too_long(tmp_path):
    # 200 KB of samples at 1 Hz: a WAV that declares 27.8 hours.
    sneaky = tmp_path / "long.wav"
    with wave.open(str(sneaky), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(1)
        w.writeframes(np.zeros(100_000, np.int16).tobytes())
    assert sneaky.stat().st_size < 210_000
    with pytest.raises(MediaError) as refused:
        probe(sneaky, max_duration_s=4 * 3600)
    assert refused.value.reason == "too_long"
    assert "100000 s" in str(refused.value) and "14400 s" in str(refused.value)


def test_the_limit_applies_to_ordinary_files_too():
    assert probe(GARDEN, max_duration_s=15).duration_s < 15
    with pytest.raises(MediaError, match="too long"):
        probe(GARDEN, max_duration_s=10)


def test_a_text_file_is_not_audio_with_status_415(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("not audio\n" * 100)
    with pytest.raises(MediaError) as refused:
        probe(text)
    assert (refused.value.reason, refused.value.status) == ("not_audio", 415)
