"""Long speech files: the speech fixtures concatenated (tests: 1 minute; benchmarks: 30, 120).

The file goes to a cache directory (never into git) with the concatenated scripts beside it
(`<name>.txt`), so a transcript can be scored against what was actually said. Reruns reuse it.
From the command line: `python bench/make_long_audio.py --minutes 30 [--out-dir DIR]`.
"""

from __future__ import annotations

import os
import wave
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "speech"
SAMPLE_RATE = 16000
GAP_S = 0.5
"""Silence between two fixtures, as between two speakers' turns."""


def default_out_dir() -> Path:
    """The cache directory for generated audio: $XDG_CACHE_HOME/mlxq/long-audio."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxq" / "long-audio"


def fixture_names() -> list[str]:
    """Names of the fixtures that have both a .wav and a .txt script, sorted."""
    return sorted(p.stem for p in FIXTURES.glob("*.wav") if p.with_suffix(".txt").exists())


def build(minutes: float, out_dir: Path | None = None) -> Path:
    """Write (or reuse) a WAV of at least `minutes` minutes cycling through the fixtures; return it."""
    out_dir = Path(out_dir or default_out_dir())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"speech-{minutes:g}min.wav"
    if path.exists() and path.with_suffix(".txt").exists():
        return path
    tmp = path.with_suffix(f".wav.{os.getpid()}.partial")  # two test processes may build it at once
    scripts = _write(tmp, minutes * 60.0)
    path.with_suffix(".txt").write_text(" ".join(scripts) + "\n", encoding="utf-8")
    tmp.replace(path)  # only a complete file ever has the final name
    return path


def script_for(path: Path) -> str:
    """The text spoken in a file made by `build`."""
    return Path(path).with_suffix(".txt").read_text(encoding="utf-8").strip()


def _write(path: Path, target_s: float) -> list[str]:
    """Append fixtures (one at a time, never all in memory) until `target_s` is reached."""
    names, scripts, written = fixture_names(), [], 0.0
    gap = b"\0\0" * int(GAP_S * SAMPLE_RATE)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        while written < target_s:
            name = names[len(scripts) % len(names)]
            frames = _pcm(FIXTURES / f"{name}.wav")
            out.writeframes(frames + gap)
            written += (len(frames) + len(gap)) / 2 / SAMPLE_RATE
            scripts.append((FIXTURES / f"{name}.txt").read_text(encoding="utf-8").strip())
    return scripts


def _pcm(path: Path) -> bytes:
    """The 16-bit mono 16 kHz PCM frames of a fixture (they are all made that way)."""
    with wave.open(str(path), "rb") as src:
        if (src.getnchannels(), src.getsampwidth(), src.getframerate()) != (1, 2, SAMPLE_RATE):
            raise ValueError(f"{path} is not 16 kHz mono 16-bit PCM; rerun make_fixtures.sh")
        return src.readframes(src.getnframes())

