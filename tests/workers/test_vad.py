"""Voice activity detection (workers/vad.py): the real Silero model on the espeak-ng speech fixtures,
with silence and faint noise between them, and the region/piece logic on made-up probabilities."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from tests.conftest import REPO
from workers import vad
from workers.audio import SAMPLE_RATE

SPEECH = REPO / "tests" / "fixtures" / "speech"
NAMES = ["garden", "numbers", "train_journey", "weather"]
FRAME = 320  # 20 ms: the unit in which speech is measured here
LOUD = 0.01  # a frame with RMS above -40 dBFS is speech (the fixtures are clean TTS)
SILENT_S = 60.0


def _read(name: str) -> np.ndarray:
    with wave.open(str(SPEECH / f"{name}.wav")) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


def _write(path, samples: np.ndarray):
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(np.clip(np.round(samples * 32768), -32768, 32767).astype(np.int16).tobytes())
    return path


def _loud_frames(samples: np.ndarray) -> np.ndarray:
    """Start times (s) of the 20 ms frames that hold speech."""
    frames = samples[:len(samples) // FRAME * FRAME].reshape(-1, FRAME)
    loud = np.sqrt((frames ** 2).mean(axis=1)) > LOUD
    return np.nonzero(loud)[0] * FRAME / SAMPLE_RATE


def _covered(times: np.ndarray, spans) -> float:
    """The fraction of frames (by start time) that fall inside one of the spans."""
    inside = np.zeros(len(times), bool)
    for start, end in spans:
        inside |= (times >= start) & (times + FRAME / SAMPLE_RATE <= end + 1e-9)
    return inside.mean()


def _assert_ordered(spans, max_s: float | None = None):
    for start, end in spans:
        assert start < end
        if max_s is not None:
            assert end - start <= max_s + 1e-6
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start + 1e-9


@pytest.fixture(scope="module")
def model() -> vad.SileroVAD:
    """The real model, fetched from its PyPI wheel into the downloads cache (once)."""
    return vad.default_vad()


@pytest.fixture(scope="module", params=["digital silence", "noise at -60 dBFS"])
def gap_file(request, tmp_path_factory):
    """garden, a silent minute, numbers; (path, garden's loud frames, numbers' loud frames, gap)."""
    garden, numbers = _read("garden"), _read("numbers")
    samples = np.concatenate([garden, np.zeros(round(SILENT_S * SAMPLE_RATE), np.float32), numbers])
    if request.param.startswith("noise"):
        rng = np.random.default_rng(0)
        samples = samples + rng.standard_normal(len(samples)).astype(np.float32) * 10 ** (-60 / 20)
    path = _write(tmp_path_factory.mktemp("vad") / "gap.wav", samples)
    offset = (len(garden) + SILENT_S * SAMPLE_RATE) / SAMPLE_RATE
    garden_loud, numbers_loud = _loud_frames(garden), _loud_frames(numbers) + offset
    gap = (garden_loud[-1] + FRAME / SAMPLE_RATE, numbers_loud[0])  # from the last speech to the next
    return path, garden_loud, numbers_loud, gap


def test_regions_cover_the_speech_and_skip_the_silent_minute(model, gap_file):
    path, garden_loud, numbers_loud, (gap_start, gap_end) = gap_file
    regions = list(vad.speech_regions(path, model))
    _assert_ordered(regions, vad.MAX_PIECE_S)
    assert _covered(garden_loud, regions) >= 0.98
    assert _covered(numbers_loud, regions) >= 0.98
    # Nothing inside the minute but the padding (and the model's short lag) at either edge.
    slack = vad.PAD_S + 0.5
    for start, end in regions:
        assert end <= gap_start + slack or start >= gap_end - slack, (start, end)
    inside = sum(max(0.0, min(end, gap_end) - max(start, gap_start)) for start, end in regions)
    assert inside <= 2 * slack

    chunks = list(vad.pieces(regions))
    _assert_ordered(chunks, vad.MAX_PIECE_S)
    assert len(chunks) == 2  # the minute cannot be bridged: one piece each side
    for start, end in regions:
        assert any(s <= start and end <= e for s, e in chunks)


def test_pure_silence_and_faint_noise_give_no_regions(model, tmp_path):
    silence = np.zeros(20 * SAMPLE_RATE, np.float32)
    noise = np.random.default_rng(1).standard_normal(20 * SAMPLE_RATE).astype(np.float32) * 10 ** (-60 / 20)
    for name, samples in [("silence", silence), ("noise", noise)]:
        path = _write(tmp_path / f"{name}.wav", samples)
        assert list(vad.speech_regions(path, model)) == [], name


def test_three_minutes_give_full_pieces_covering_the_speech(model, tmp_path):
    # The four fixtures over and over with 0.3 s pauses: a talk with barely a breath between lines.
    pause = np.zeros(round(0.3 * SAMPLE_RATE), np.float32)
    parts, total = [], 0
    while total < 180 * SAMPLE_RATE:
        parts += [_read(NAMES[len(parts) // 2 % 4]), pause]
        total += len(parts[-2]) + len(pause)
    samples = np.concatenate(parts)
    path = _write(tmp_path / "talk.wav", samples)

    chunks = list(vad.pieces(vad.speech_regions(path, model)))
    _assert_ordered(chunks, vad.MAX_PIECE_S)
    assert _covered(_loud_frames(samples), chunks) >= 0.9
    # Greedy merging keeps pieces full: about 3 minutes / 30 s of them, not one per sentence.
    assert len(chunks) <= total / SAMPLE_RATE / vad.MAX_PIECE_S + 2


def test_a_small_max_splits_regions_without_losing_speech(model):
    samples = _read("garden")
    loud = _loud_frames(samples)
    regions = list(vad.speech_regions(SPEECH / "garden.wav", model, max_s=1.5))
    _assert_ordered(regions, 1.5)
    assert _covered(loud, regions) >= 0.98
    assert regions[-1][1] <= len(samples) / SAMPLE_RATE  # the last pad stops at the end of the file


def test_probabilities_stream_in_windows_of_any_piece_size(model):
    """The stream's cut into pieces must not matter: windows and the model's context carry over."""
    samples = np.concatenate([np.zeros(SAMPLE_RATE // 2, np.float32), _read("numbers")[:5 * SAMPLE_RATE + 100]])
    whole = list(model.probabilities([samples]))
    ragged = list(model.probabilities(np.array_split(samples, 37)))
    assert len(whole) == -(-len(samples) // vad.WINDOW)
    assert np.allclose(whole, ragged, atol=1e-6)
    assert max(whole) > 0.9 and min(whole) < 0.1


def _regions(probs, max_s: float = vad.MAX_PIECE_S):
    return list(vad.regions_from_probabilities(probs, max_s))


WINDOW_S = vad.WINDOW / SAMPLE_RATE


def test_region_logic_hysteresis_minimums_and_padding():
    runs = [(31, 0.0), (62, 0.9), (2, 0.1),  # speech from ~1 s; a 64 ms dip is no pause
            (16, 0.9), (31, 0.4),  # between the thresholds: neither starts a pause nor ends one
            (94, 0.0), (5, 0.9),  # 3 s of silence, then a 160 ms blip: too short for speech
            (94, 0.0), (31, 0.9)]  # speech to the very end of the file
    probs = [prob for count, prob in runs for _ in range(count)]
    regions = _regions(probs)
    assert len(regions) == 2
    (start1, end1), (start2, end2) = regions
    assert start1 == pytest.approx(31 * WINDOW_S - vad.PAD_S)
    assert end1 == pytest.approx((31 + 62 + 2 + 16 + 31) * WINDOW_S + vad.PAD_S)
    assert end2 == pytest.approx(len(probs) * WINDOW_S)  # the pad stops at the end
    assert start2 == pytest.approx((len(probs) - 31) * WINDOW_S - vad.PAD_S)


def test_long_region_is_cut_at_its_quietest_window_near_the_limit():
    probs = [0.9] * 2000  # 64 s of unbroken speech...
    probs[100] = 0.0  # (a quiet window far from the limit: not a candidate)
    probs[780] = 0.6  # ...with a slightly quieter window 25 s in
    probs[800] = 0.2  # and a quieter one at 25.6 s: the cut goes there
    regions = _regions(probs)
    _assert_ordered(regions, vad.MAX_PIECE_S)
    assert [round(t / WINDOW_S) for region in regions for t in region] == [0, 800, 800, 1725, 1725, 2000]
    # No quiet window before the next limit: cut hard at it (the parts touch, so no pad between).
    assert regions[1][1] - regions[1][0] == pytest.approx(vad.MAX_PIECE_S - 2 * vad.PAD_S, abs=WINDOW_S)


def test_pieces_merge_greedily_and_cut_long_regions_hard():
    regions = [(0.0, 10.0), (12.0, 20.0), (21.0, 29.0), (29.5, 35.0), (40.0, 110.0), (111.0, 112.0)]
    assert list(vad.pieces(regions, max_s=30.0)) == [
        (0.0, 29.0), (29.5, 35.0), (40.0, 70.0), (70.0, 100.0), (100.0, 112.0)]
    assert list(vad.pieces([])) == []
