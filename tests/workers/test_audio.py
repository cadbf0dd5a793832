"""Audio decoding with PyAV: formats, streaming, seeking, and a clear error for each kind of bad upload."""

from __future__ import annotations

import wave

import av
import numpy as np
import pytest

from tests.audio_files import encode
from tests.conftest import REPO
from workers.audio import (
    SAMPLE_RATE,
    WAV_PACKET_BYTES,
    AudioError,
    AudioReader,
    iter_samples,
    iter_windows,
    probe,
)

SPEECH = REPO / "tests" / "fixtures" / "speech"
GARDEN = SPEECH / "garden.wav"


def _decode(path, start_s: float = 0.0) -> np.ndarray:
    """All samples from `start_s`, joined."""
    return np.concatenate(list(iter_samples(path, start_s)))


@pytest.fixture(scope="module")
def encoded(tmp_path_factory):
    """garden.wav as MP3, AAC in M4A, FLAC and Opus in WebM."""
    folder = tmp_path_factory.mktemp("encoded")
    files = {}
    for name, container, codec, rate in [("mp3", "mp3", "libmp3lame", 44100), ("m4a", "mp4", "aac", 44100),
                                         ("flac", "flac", "flac", 48000), ("webm", "webm", "libopus", 48000)]:
        files[name] = folder / f"garden.{name}"
        encode(GARDEN, files[name], container, codec, rate)
    return files


def test_wav_decodes_to_16k_mono_float32():
    samples = _decode(GARDEN)
    with wave.open(str(GARDEN)) as w:
        frames = w.getnframes()
        pcm = np.frombuffer(w.readframes(frames), np.int16).astype(np.float32) / 32768
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert len(samples) == frames
    np.testing.assert_allclose(samples, pcm, atol=1e-6)
    assert probe(GARDEN) == pytest.approx(frames / SAMPLE_RATE, abs=1e-3)


def test_ogg_vorbis_matches_the_wav():
    ogg, wav = _decode(SPEECH / "weather.ogg"), _decode(SPEECH / "weather.wav")
    assert abs(len(ogg) - len(wav)) < SAMPLE_RATE * 0.05
    n = min(len(ogg), len(wav))
    assert np.corrcoef(ogg[:n], wav[:n])[0, 1] > 0.95  # lossy, but the same sound at the same time
    assert probe(SPEECH / "weather.ogg") == pytest.approx(len(wav) / SAMPLE_RATE, abs=0.1)


@pytest.mark.parametrize("fmt", ["mp3", "m4a", "flac", "webm"])
def test_other_formats_decode(encoded, fmt):
    samples = _decode(encoded[fmt])
    reference = _decode(GARDEN)
    assert probe(encoded[fmt]) == pytest.approx(len(reference) / SAMPLE_RATE, abs=0.2)
    assert abs(len(samples) - len(reference)) < SAMPLE_RATE * 0.2
    assert 0.5 < np.abs(samples).max() / np.abs(reference).max() < 2.0  # stereo downmix keeps the level


def test_decoding_is_streamed_in_small_pieces():
    pieces = list(iter_samples(GARDEN))  # 15 s of 16 kHz 16-bit mono PCM
    assert len(pieces) > 10
    assert max(len(p) for p in pieces) <= WAV_PACKET_BYTES // 2  # never more than a packet (~1 s) at once


@pytest.mark.parametrize("path", [GARDEN, SPEECH / "weather.ogg"])
def test_seeking_gives_the_same_samples(path):
    full = _decode(path)
    start = 7.31
    tail = _decode(path, start)
    offset = round(start * SAMPLE_RATE)
    assert len(tail) == len(full) - offset
    np.testing.assert_allclose(tail, full[offset:], atol=1e-6)


def test_iter_windows_from_an_offset():
    full = _decode(GARDEN)
    windows = list(iter_windows(GARDEN, 4.0, start_s=2.0))
    assert [offset for offset, _ in windows] == [2.0, 6.0, 10.0, 14.0]
    assert all(len(w) == 4 * SAMPLE_RATE for _, w in windows[:-1])
    np.testing.assert_array_equal(np.concatenate([w for _, w in windows]), full[2 * SAMPLE_RATE:])


def test_reader_reads_forward_only():
    full = _decode(GARDEN)
    reader = AudioReader(GARDEN)
    np.testing.assert_array_equal(reader.read(1000, 500), full[1000:1500])
    np.testing.assert_array_equal(reader.read(1200, 500), full[1200:1700])  # overlapping is fine
    assert len(reader.read(len(full) - 10, 500)) == 10  # short at the end
    with pytest.raises(ValueError):
        reader.read(0, 10)
    reader.close()


def test_text_file_is_not_audio(tmp_path):
    fake = tmp_path / "notes.wav"
    fake.write_text("In the garden behind the house there is an old apple tree.\n" * 20)
    with pytest.raises(AudioError, match="^not an audio file"):
        probe(fake)


def test_truncated_wav(tmp_path):
    cut = tmp_path / "cut.wav"
    cut.write_bytes(GARDEN.read_bytes()[:100_000])
    with pytest.raises(AudioError, match="^corrupt or truncated audio"):
        probe(cut)


def test_zero_length_file(tmp_path):
    empty = tmp_path / "empty.mp3"
    empty.write_bytes(b"")
    with pytest.raises(AudioError, match=r"^empty audio \(0 s\)"):
        probe(empty)


def test_wav_without_samples(tmp_path):
    silent = tmp_path / "nothing.wav"
    with wave.open(str(silent), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
    with pytest.raises(AudioError, match=r"^empty audio \(0 s\)"):
        probe(silent)


def test_video_without_audio(tmp_path):
    video = tmp_path / "clip.mkv"
    with av.open(str(video), "w") as out:
        stream = out.add_stream("ffv1", rate=5)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(5):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    with pytest.raises(AudioError, match="^no audio stream"):
        probe(video)


def test_audio_error_is_a_value_error():
    assert issubclass(AudioError, ValueError)
