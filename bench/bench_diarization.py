"""Diarization benchmark: what `diarize=true` costs over plain transcription, how right it is, and whether the
worker's memory stays flat as the recording grows.

The recording is two synthetic voices taking turns (the speech fixtures' sentences: espeak-ng's US voice and
its higher female variant, tests/fixtures/speech/voice_b), one or two sentences a turn, 0.6 s pauses, repeated to
the length asked for; the truth of who speaks when is known. In one fresh service the same file is submitted as
an async job on the batched path (`chunking_strategy: auto`), plain and diarized, alternating `--repeats` times
(median kept). Then the worker's peak RSS for diarized jobs of each `--memory-minutes` length, each in a fresh
service.

    python bench/bench_diarization.py                                  # 30 min, memory at 30 and 120 min
    python bench/bench_diarization.py --minutes 3 --memory-minutes 3,6 --repeats 1   # quick

Prints a JSON report (and writes it to --out). Model loading and server start-up are excluded.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import statistics
import sys
import tempfile
import wave
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_speech import SPEECH_MODEL, WARMUP_AUDIO, Service, followed_job, job_record  # noqa: E402
from bench.bench_text import reexec_with_worker_blas  # noqa: E402
from bench.common import start_redis, write_report  # noqa: E402
from tests.speech_clips import SAMPLE_RATE, sentences  # noqa: E402

VOICE_A = [("garden", 3), ("numbers", 3), ("train_journey", 3), ("weather", 3)]  # (fixture, sentences)
VOICE_B = [("voice_b/river", 4)]
PAUSE_S = 0.6


def conversation(minutes: float, out_dir: Path) -> tuple[Path, list[tuple[str, float, float]]]:
    """Write the two-voice recording; return it and its truth: (voice, start_s, end_s) per turn."""
    a = [sentences(name, i).samples for name, count in VOICE_A for i in range(count)]
    b = [sentences(name, i).samples for name, count in VOICE_B for i in range(count)]
    pause = np.zeros(round(PAUSE_S * SAMPLE_RATE), np.int16)
    rng = np.random.default_rng(0)
    parts, truth, at, n = [], [], 0.0, 0
    while at < minutes * 60:
        voice, pool = ("A", a) if n % 2 == 0 else ("B", b)
        turn = np.concatenate([pool[i] for i in rng.choice(len(pool), size=int(rng.integers(1, 3)))])
        truth.append((voice, at, at + len(turn) / SAMPLE_RATE))
        parts += [turn, pause]
        at += (len(turn) + len(pause)) / SAMPLE_RATE
        n += 1
    path = out_dir / f"two-voices-{minutes:g}min.wav"
    with wave.open(str(path), "wb") as f:
        f.setnchannels(1), f.setsampwidth(2), f.setframerate(SAMPLE_RATE)
        f.writeframes(np.concatenate(parts).tobytes())
    return path, truth


def agreement(segments: list[dict], truth) -> float:
    """The share of the turns' time that segments give to the right speaker, under the best matching of the
    found labels to the two voices."""
    labels = sorted({seg.get("speaker") for seg in segments} - {None})
    total = sum(end - start for _, start, end in truth)
    starts = np.array([start for _, start, _ in truth])
    best = 0.0
    for chosen in itertools.permutations(labels, min(2, len(labels))):
        mapping = dict(zip(("A", "B"), chosen, strict=False))
        right = 0.0
        for seg in segments:
            turn = max(0, int(np.searchsorted(starts, seg["start"])) - 1)
            while turn < len(truth) and truth[turn][1] < seg["end"]:
                voice, start, end = truth[turn]
                if seg.get("speaker") == mapping.get(voice):
                    right += max(0.0, min(end, seg["end"]) - max(start, seg["start"]))
                turn += 1
        best = max(best, right / total)
    return round(best, 4)


def submit(base: str, path: Path, diarize: bool) -> str:
    """POST /v1/jobs/transcriptions on the batched path; return the job id."""
    data = {"model": SPEECH_MODEL, "response_format": "verbose_json", "chunking_strategy": "auto"}
    if diarize:
        data["diarize"] = "true"
    with open(path, "rb") as f:
        r = httpx.post(base + "/v1/jobs/transcriptions", files={"file": (path.name, f, "audio/wav")}, data=data,
                       timeout=600)
    if r.status_code != 202:
        raise RuntimeError(f"submit failed: {r.status_code} {r.text[:500]}")
    return r.json()["id"]


def timed(svc: Service, path: Path, audio_s: float, truth, diarize: bool) -> dict:
    """One async job, followed to its end with the worker's RSS sampled."""
    job_id, events, _, wall, memory = followed_job(svc, lambda base: submit(base, path, diarize))
    record = job_record(svc.base, job_id)
    segments = events[-1]["data"]["result"]["segments"]
    entry = {"wall_s": round(wall, 2), "job_s": round(record["finished_at"] - record["started_at"], 2),
             "rtf": round(audio_s / wall, 2), "segments": len(segments), "memory": memory}
    if diarize:
        entry["speakers_found"] = len({s["speaker"] for s in segments})
        entry["agreement"] = agreement(segments, truth)
    return entry


def warm(base: str) -> None:
    """Load Whisper, the batched path's shapes and the voice encoder before anything is timed."""
    for data in ({"chunking_strategy": "auto"}, {"chunking_strategy": "auto", "diarize": "true"}):
        with open(WARMUP_AUDIO, "rb") as f:
            httpx.post(base + "/v1/audio/transcriptions", files={"file": (WARMUP_AUDIO.name, f)},
                       data={"model": SPEECH_MODEL, **data}, timeout=600).raise_for_status()


def median(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--memory-minutes", default="30,120", help="diarized file lengths for the memory test")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", action="store_true",
                        help="one unmeasured job of each kind on the file first (a fresh GPU instance builds its "
                             "kernels for each new shape the first time it meets it)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()
    work = Path(tempfile.mkdtemp(prefix="mlxq-diar-"))
    path, truth = conversation(args.minutes, work)
    audio_s = truth[-1][2]
    redis_url, redis_proc = start_redis()
    report = {"machine": platform.node(), "processor": platform.processor(), "minutes": args.minutes,
              "turns": len(truth), "model": SPEECH_MODEL}
    try:
        with Service(redis_url, "diar") as svc:
            warm(svc.base)
            if args.warmup:
                timed(svc, path, audio_s, truth, False)
                timed(svc, path, audio_s, truth, True)
            plain, diarized = [], []
            for _ in range(args.repeats):  # alternating: both see the same background load
                plain.append(timed(svc, path, audio_s, truth, False))
                diarized.append(timed(svc, path, audio_s, truth, True))
        report["plain"] = {"runs": plain, "median_wall_s": median(plain, "wall_s")}
        report["diarized"] = {"runs": diarized, "median_wall_s": median(diarized, "wall_s")}
        report["diarized_over_plain_wall"] = round(report["diarized"]["median_wall_s"]
                                                   / report["plain"]["median_wall_s"], 3)
        memory = {}
        for minutes in [float(m) for m in args.memory_minutes.split(",") if m]:
            long_path, long_truth = conversation(minutes, work)
            with Service(redis_url, f"mem{minutes:g}") as svc:
                warm(svc.base)
                run = timed(svc, long_path, long_truth[-1][2], long_truth, True)
            memory[f"{minutes:g}min"] = {"peak_hwm_mib": run["memory"]["peak_hwm_mib"], "rtf": run["rtf"],
                                         "agreement": run["agreement"], "speakers_found": run["speakers_found"]}
            long_path.unlink()
        if memory:
            peaks = [m["peak_hwm_mib"] for m in memory.values()]
            report["memory"] = {"runs": memory, "peak_growth_mib": round(peaks[-1] - peaks[0], 1),
                                "note": "worker RSS (VmHWM: peak since the worker started); on a GPU its memory "
                                        "is not in RSS"}
    finally:
        redis_proc.stop()
        path.unlink(missing_ok=True)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
