"""Transcription defaults side by side, in this process: Whisper on every window (the old default), the
same with silence skipped by the voice activity detector (the default since issue 29), and chunking_strategy
"auto" (the detector's pieces decoded in batches). Speed (real-time factor) and WER on each speech fixture
and on the gap clip (garden, a minute of digital silence, numbers), whose WER counts invented text.

    python bench/speech_defaults.py --models whisper-tiny.en,whisper-base --skip old:whisper-base:gap
    python bench/speech_defaults.py --models whisper-tiny.en --modes old --files gap   # slow: it decodes silence

Prints one JSON line per run, then a summary per model and mode. A model is warmed up before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_speech import wer  # noqa: E402
from bench.bench_text import reexec_with_worker_blas  # noqa: E402
from workers import vad  # noqa: E402
from workers.backends import whisper, whisper_batch  # noqa: E402

SPEECH = REPO / "tests" / "fixtures" / "speech"
MODES = ("old", "default", "auto")


def gap_clip(directory: Path) -> tuple[Path, str]:
    """garden, 60 s of digital zeros, numbers (the test's clip) and its script."""
    parts = []
    for name in ("garden", "numbers"):
        with wave.open(str(SPEECH / f"{name}.wav")) as f:
            parts.append(np.frombuffer(f.readframes(f.getnframes()), np.int16))
    path = directory / "gap.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(16000)
        f.writeframes(np.concatenate([parts[0], np.zeros(60 * 16000, np.int16), parts[1]]).tobytes())
    return path, (SPEECH / "garden.txt").read_text() + " " + (SPEECH / "numbers.txt").read_text()


def transcribe(model, path: Path, mode: str) -> str:
    """The text of `path` as the worker's backend makes it in `mode`."""
    if mode == "auto":
        chunks = whisper_batch.transcribe_batches(model, path, whisper.Options(), None, vad.speech_pieces(path),
                                                  whisper_batch.CPU_BATCH)
    else:
        chunks = whisper.transcribe_chunks(model, path, whisper.Options(vad=mode == "default"))
    return "".join(seg["text"] for chunk in chunks for seg in chunk.segments).strip()


def main() -> None:
    """Run every model x file x mode (modes alternating per file) and print the results."""
    reexec_with_worker_blas()  # the BLAS the worker runs with (MLX's own is several times slower on a CPU)
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="whisper-tiny.en,whisper-base")
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "mlxq" / "models"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--files", default="garden,numbers,train_journey,weather,gap")
    parser.add_argument("--skip", default="", help="mode:model:file triples to leave out, comma-separated")
    args = parser.parse_args()
    skip, modes = set(filter(None, args.skip.split(","))), args.modes.split(",")
    files = [gap_clip(Path(tempfile.mkdtemp())) if name == "gap" else
             (SPEECH / f"{name}.wav", (SPEECH / f"{name}.txt").read_text()) for name in args.files.split(",")]
    rows = []
    for name in args.models.split(","):
        model, _ = whisper.load(Path(args.models_dir) / name)
        for mode in modes:
            transcribe(model, SPEECH / "garden.wav", mode)  # warm-up: compiled shapes, the detector loaded
        for path, script in files:
            for mode in modes:
                if f"{mode}:{name}:{path.stem}" in skip:
                    continue
                with wave.open(str(path)) as f:
                    audio_s = f.getnframes() / f.getframerate()
                started = time.perf_counter()
                text = transcribe(model, path, mode)
                wall = time.perf_counter() - started
                row = {"model": name, "file": path.stem, "mode": mode, "audio_s": round(audio_s, 1),
                       "wall_s": round(wall, 2), "rtf": round(audio_s / wall, 2), "wer": wer(script, text)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    for name in args.models.split(","):
        for mode in modes:
            mine = [r for r in rows if r["model"] == name and r["mode"] == mode and r["file"] != "gap"]
            if mine:
                audio, wall = sum(r["audio_s"] for r in mine), sum(r["wall_s"] for r in mine)
                print(json.dumps({"model": name, "mode": mode, "fixtures": len(mine), "rtf": round(audio / wall, 2),
                                  "mean_wer": round(sum(r["wer"] for r in mine) / len(mine), 4)}), flush=True)


if __name__ == "__main__":
    main()
