"""Where a batched transcription's time goes, in-process: the voice activity detector, the encoder, the
decoder, per batch size (no service around it).

    python bench/profile_speech.py [--minutes 30] [--batches 8,16,32] [--model whisper-tiny.en] [--rss [--trace]]

With --rss, a line per batch of pieces too: the process's resident memory and MLX's active and cached
memory after it (what grows over a long file).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_speech import wav_seconds, wer  # noqa: E402
from tests.long_audio import build, script_for  # noqa: E402


class Timed:
    """Wraps the batch path's encoder and decoder to add up their seconds (each waited for)."""

    def __init__(self):
        from workers.backends import whisper_decoder, whisper_encoder

        self.encode_s = self.decode_s = 0.0
        self.windows = 0
        self.encode_windows, self.decode_features = whisper_encoder.encode_windows, whisper_decoder.decode_features
        whisper_encoder.encode_windows = self.timed_encode
        whisper_decoder.decode_features = self.timed_decode

    def timed_encode(self, model, mels, at_once):
        """encode_windows, timed (it waits for its output)."""
        t0 = time.perf_counter()
        features = self.encode_windows(model, mels, at_once)
        self.encode_s += time.perf_counter() - t0
        self.windows += mels.shape[0]
        return features

    def timed_decode(self, *args):
        """decode_features, timed (it returns host-side results)."""
        t0 = time.perf_counter()
        results = self.decode_features(*args)
        self.decode_s += time.perf_counter() - t0
        return results


def memory_mib() -> dict:
    """Resident memory of this process (all of it, its peak, and the malloc heap's part), Python's traced memory
    (with --trace) and MLX's active and cached memory, in MiB."""
    import mlx.core as mx

    status = Path("/proc/self/status").read_text()
    rss_kib, peak_kib = (int(next(line.split()[1] for line in status.splitlines() if line.startswith(name)))
                         for name in ("VmRSS", "VmHWM"))
    found = {"rss_mib": round(rss_kib / 1024, 1), "peak_mib": round(peak_kib / 1024, 1),
             "heap_mib": round(_heap_kib() / 1024, 1)}
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        found.update(python_mib=round(current / 2**20, 1), python_peak_mib=round(peak / 2**20, 1))
    return {**found, "mlx_active_mib": round(mx.get_active_memory() / 2**20, 1),
            "mlx_cache_mib": round(mx.get_cache_memory() / 2**20, 1)}


def _heap_kib() -> int:
    """Resident KiB of the [heap] mapping: what glibc's main malloc arena holds (not mmap'd blocks, not threads')."""
    mapping, total = None, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            mapping = fields[5] if len(fields) > 5 else None
        elif fields and fields[0] == "Rss:" and mapping == "[heap]":
            total += int(fields[1])
    return total


def main() -> None:
    """Print a JSON line per batch size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--model", default="whisper-tiny.en")
    parser.add_argument("--rss", action="store_true", help="a memory line after every batch of pieces")
    parser.add_argument("--trim", action="store_true", help="glibc malloc_trim(0) after every batch (experiment)")
    parser.add_argument("--trace", action="store_true", help="with --rss: Python's own allocations too (tracemalloc; slower)")
    args = parser.parse_args()
    if args.trace:
        tracemalloc.start()
    from jobs.settings import load_settings
    from jobs.store import resolve
    from workers import vad
    from workers.backends import whisper, whisper_batch

    path = build(args.minutes)
    audio_s = wav_seconds(path)
    model, _ = whisper.load(Path(resolve(args.model, load_settings()).path))
    t0 = time.perf_counter()
    pieces = list(vad.pieces(vad.speech_regions(path)))
    print(json.dumps({"vad_s": round(time.perf_counter() - t0, 2), "pieces": len(pieces), "audio_s": audio_s}))
    timed = Timed()
    list(whisper_batch.transcribe_batches(model, REPO / "tests/fixtures/speech/garden.wav", whisper.Options(), None,
                                          vad.speech_pieces(REPO / "tests/fixtures/speech/garden.wav"), 1))
    for batch in [int(b) for b in args.batches.split(",")]:
        timed.encode_s = timed.decode_s = 0.0
        timed.windows = 0
        t0 = time.perf_counter()
        chunks = []
        for chunk in whisper_batch.transcribe_batches(model, path, whisper.Options(), None, iter(pieces), batch):
            chunks.append(chunk)
            if args.trim:
                ctypes.CDLL("libc.so.6").malloc_trim(0)
            if args.rss:
                print(json.dumps({"batch": batch, "chunk": len(chunks), "seek_s": chunk.state.seek / 100,
                                  **memory_mib()}), flush=True)
        wall = time.perf_counter() - t0
        text = " ".join(seg["text"] for chunk in chunks for seg in chunk.segments)
        print(json.dumps({"batch": batch, "wall_s": round(wall, 2), "rtf": round(audio_s / wall, 1),
                          "encode_s": round(timed.encode_s, 2), "decode_s": round(timed.decode_s, 2),
                          "windows": timed.windows, "wer": round(wer(script_for(path), text), 4)}))


if __name__ == "__main__":
    main()
