"""Where a batched transcription's time goes, in-process: the voice activity detector, the encoder, the
decoder, per batch size (no service around it).

    python bench/profile_speech.py [--minutes 30] [--batches 8,16,32] [--model whisper-tiny.en]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_speech import wav_seconds, wer  # noqa: E402
from bench.make_long_audio import build, script_for  # noqa: E402


class Timed:
    """Wraps the batch decoder to add up encoder and decoder seconds (each waited for)."""

    def __init__(self):
        import mlx.core as mx

        from workers.backends import whisper_batch, whisper_decoder

        self.mx, self.decoder = mx, whisper_decoder
        self.encode_s = self.decode_s = 0.0
        self.windows = 0
        whisper_batch.decode_batch = self

    def __call__(self, model, mels, tokenizer, prompt, temperature=0.0, encode_batch=None):
        mx = self.mx
        t0 = time.perf_counter()
        step = encode_batch or mels.shape[0]
        features = mx.concatenate([model.encoder(mels[i:i + step].astype(model.dtype))
                                   for i in range(0, mels.shape[0], step)])
        mx.eval(features)
        t1 = time.perf_counter()
        results = self.decoder.decode_features(model, features, tokenizer, prompt, temperature)
        self.encode_s += t1 - t0
        self.decode_s += time.perf_counter() - t1
        self.windows += mels.shape[0]
        return results


def main() -> None:
    """Print a JSON line per batch size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--batches", default="8,16,32")
    parser.add_argument("--model", default="whisper-tiny.en")
    args = parser.parse_args()
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
        chunks = list(whisper_batch.transcribe_batches(model, path, whisper.Options(), None, iter(pieces), batch))
        wall = time.perf_counter() - t0
        text = " ".join(seg["text"] for chunk in chunks for seg in chunk.segments)
        print(json.dumps({"batch": batch, "wall_s": round(wall, 2), "rtf": round(audio_s / wall, 1),
                          "encode_s": round(timed.encode_s, 2), "decode_s": round(timed.decode_s, 2),
                          "windows": timed.windows, "wer": round(wer(script_for(path), text), 4)}))


if __name__ == "__main__":
    main()
