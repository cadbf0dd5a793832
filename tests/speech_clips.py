"""Short speech for tests: sentences of the speech fixtures, cut at the pause espeak-ng leaves after each, with
their script, and files of such sentences far apart.

Every Whisper window costs one encoder pass over 30 s, however little it holds (0.6 s for tiny.en on the
2-core CPU); what a shorter recording saves is decoding: one sentence (~5 s, ~15 words) transcribes in 1.0 s
where its whole 15 s fixture takes 1.5 s. For tests of what is done with a transcript, not of long audio.
A clip is written as `<stem>.wav` (and `<stem>.ogg` if asked) with its script beside it as `<stem>.txt`, as
the fixtures are.
"""

from __future__ import annotations

import re
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.audio_files import encode

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "speech"
SAMPLE_RATE = 16000
FRAME = 320  # 20 ms
LOUD = 0.01  # RMS above -40 dBFS: speech (the fixtures are clean text-to-speech)
SENTENCE_PAUSE_S = 0.3
"""espeak-ng pauses about 0.4 s after a full stop and at most 0.26 s at a comma (measured on the fixtures)."""
KEPT_SILENCE_S = 0.15
"""Silence kept on either side of a sentence that is cut out."""


@dataclass(frozen=True)
class Clip:
    """16 kHz mono 16-bit samples and the words spoken in them."""

    samples: np.ndarray
    text: str

    @property
    def duration_s(self) -> float:
        """Its length in seconds."""
        return len(self.samples) / SAMPLE_RATE


def whole(name: str) -> Clip:
    """Fixture `name` (a .wav with its .txt script in tests/fixtures/speech), all of it."""
    return Clip(_read(FIXTURES / f"{name}.wav"), (FIXTURES / f"{name}.txt").read_text(encoding="utf-8").strip())


def sentences(name: str, first: int = 0, count: int = 1) -> Clip:
    """Sentences first..first+count-1 of fixture `name` (a .wav with its .txt script in tests/fixtures/speech)."""
    samples = _read(FIXTURES / f"{name}.wav")
    script = re.split(r"(?<=[.!?])\s+", (FIXTURES / f"{name}.txt").read_text(encoding="utf-8").strip())
    pauses = _pauses(samples)
    if len(pauses) != len(script):
        raise ValueError(f"{name}: {len(pauses)} sentence pauses for {len(script)} sentences")
    keep = round(KEPT_SILENCE_S * SAMPLE_RATE)
    start = 0 if first == 0 else pauses[first - 1][1] - keep
    end = min(len(samples), pauses[first + count - 1][0] + keep)
    return Clip(samples[start:end], " ".join(script[first:first + count]))


def spaced(clips: list[Clip], gap_s: float) -> Clip:
    """The clips one after another with `gap_s` of digital silence between them."""
    gap = np.zeros(round(gap_s * SAMPLE_RATE), np.int16)
    parts = [part for clip in clips for part in (gap, clip.samples)][1:]
    return Clip(np.concatenate(parts), " ".join(clip.text for clip in clips))


def write(clip: Clip, path: Path) -> Path:
    """Write the clip as a WAV, or as Opus in Ogg if `path` ends in .ogg, with its script beside it."""
    path = Path(path)
    wav = path.with_suffix(".wav")
    with wave.open(str(wav), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(clip.samples.tobytes())
    if path.suffix == ".ogg":
        encode(wav, path, "ogg", "libopus", 48000, layout="mono")  # Opus codes 48 kHz only
    path.with_suffix(".txt").write_text(clip.text + "\n", encoding="utf-8")
    return path


def script_of(audio: Path) -> str:
    """What is said in a fixture or a written clip: the script beside it."""
    return Path(audio).with_suffix(".txt").read_text(encoding="utf-8").strip()


def _read(path: Path) -> np.ndarray:
    """A fixture's samples (they are all 16 kHz mono 16-bit PCM)."""
    with wave.open(str(path), "rb") as src:
        if (src.getnchannels(), src.getsampwidth(), src.getframerate()) != (1, 2, SAMPLE_RATE):
            raise ValueError(f"{path} is not 16 kHz mono 16-bit PCM; rerun make_fixtures.sh")
        return np.frombuffer(src.readframes(src.getnframes()), np.int16)


def _pauses(samples: np.ndarray) -> list[tuple[int, int]]:
    """(first, end) sample of every silence of at least SENTENCE_PAUSE_S after speech began, the last one
    running to the end of the file if it ends in silence."""
    frames = samples[:len(samples) // FRAME * FRAME].reshape(-1, FRAME).astype(np.float32) / 32768
    loud = np.sqrt((frames ** 2).mean(axis=1)) > LOUD
    pauses, start = [], None
    for index, is_loud in enumerate([*loud, True]):
        if not is_loud and start is None:
            start = index
        elif is_loud and start is not None:
            if start > 0 and (index - start) * FRAME >= SENTENCE_PAUSE_S * SAMPLE_RATE:
                pauses.append((start * FRAME, min(index * FRAME, len(samples))))
            start = None
    if not pauses or pauses[-1][1] < len(loud) * FRAME:  # speech to the very end: the file ends the sentence
        pauses.append((len(samples), len(samples)))
    return pauses
