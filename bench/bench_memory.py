"""The worker's resident memory under a bounded mixed load: chats (short, long, streamed, n=2), transcriptions and
image chats through a real service (Redis, worker, web), with the worker's VmRSS sampled throughout.

    .venv/bin/python -m bench.bench_memory --requests 150 [--repo /tmp/base-f] [--out report.json]

--repo runs the service from another checkout (an older commit), with this script's client, for a before/after.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import Proc, free_port, start_redis, wait_http, write_report

REPO = Path(__file__).resolve().parents[1]
AUDIO = REPO / "tests" / "fixtures" / "speech" / "weather.wav"
TEXT, SPEECH, VISION = "smollm2-135m", "whisper-tiny.en", "shapes-vlm-toy"
MIB = 2**20


def worker_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines) if k in ("VmRSS", "VmHWM")}


def image_url() -> str:
    """A small PNG as a data URL (one of the toy VLM's shapes)."""
    sys.path.insert(0, str(REPO))
    from workers.demo import shapes

    buffer = io.BytesIO()
    next(iter(shapes.samples(2024, 1))).image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def requests(picture: str):
    """The mix, repeated: (name, method) pairs for a client."""
    long_prompt = " ".join(f"Item {i} is a word about memory." for i in range(8))

    def chat(client, **body):
        body = {"model": TEXT, "temperature": 0.7, "messages": [{"role": "user", "content": "Tell me a story."}],
                **body}
        return client.post("/v1/chat/completions", json=body)

    def stream(client):
        with client.stream("POST", "/v1/chat/completions", json={
                "model": TEXT, "stream": True, "max_tokens": 32,
                "messages": [{"role": "user", "content": "Count slowly."}]}) as response:
            for _ in response.iter_lines():
                pass
            return response

    def transcribe(client):
        return client.post("/v1/audio/transcriptions", data={"model": SPEECH}, files={"file": ("a.wav", AUDIO.read_bytes())})

    def vision(client):
        content = [{"type": "text", "text": "What is in this image?"}, {"type": "image_url", "image_url": {"url": picture}}]
        return client.post("/v1/chat/completions", json={"model": VISION, "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": content}]})

    return itertools.cycle([
        ("chat", lambda c: chat(c, max_tokens=32)),
        ("stream", stream),
        ("long", lambda c: chat(c, max_tokens=8, messages=[{"role": "user", "content": long_prompt}])),
        ("transcription", transcribe),
        ("n2", lambda c: chat(c, max_tokens=32, n=2)),
        ("vision", vision),
    ])


def start(argv: list[str], env: dict, name: str, cwd: Path) -> Proc:
    """A bench process run in `cwd` (the checkout under test)."""
    proc = Proc(argv, env, name)
    proc.process = subprocess.Popen(argv, env=env, cwd=cwd, stdout=open(proc.log, "wb"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
    return proc


def start_service(repo: Path, redis_url: str) -> tuple[str, Proc, Proc]:
    """Worker and web (one gunicorn process) from `repo`; the API's URL and both processes."""
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "MLXQ_REDIS_URL": redis_url, "PYTHONPATH": str(repo),
           "PYTHONUNBUFFERED": "1", "MLXQ_SPOOL_DIR": tempfile.mkdtemp(prefix="mlxq-bench-spool-")}
    worker = start([sys.executable, "-m", "workers.main"], env, "memory-worker", repo)
    web = start([sys.executable, "-m", "gunicorn", "--worker-class", "gevent", "--workers", "1", "--bind",
                 f"127.0.0.1:{port}", "--config", "python:web.gunicorn_conf", "web.app:create_app()"], env,
                "memory-web", repo)
    return f"http://127.0.0.1:{port}", worker, web


def main() -> None:
    """Run the load and print the worker's memory figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=6.0, help="idle wait after the load before the last sample")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout whose service runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    redis_url, redis_proc = start_redis()
    base, worker, web = start_service(args.repo.resolve(), redis_url)
    try:
        wait_http(base + "/ready", 300)
        samples, done = [], threading.Event()
        pid = worker.process.pid
        ready = worker_status(pid)

        def sample():
            while not done.wait(0.25):
                samples.append(worker_status(pid)["VmRSS"])

        threading.Thread(target=sample, daemon=True).start()
        mix, statuses = requests(image_url()), {}
        lock = threading.Lock()

        def one(item):
            name, call = item
            with httpx.Client(base_url=base, timeout=600) as client:
                status = call(client).status_code
            with lock:
                statuses[f"{name} {status}"] = statuses.get(f"{name} {status}", 0) + 1

        started = time.monotonic()
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(one, itertools.islice(mix, args.requests)))
        elapsed = time.monotonic() - started
        done.set()
        end = worker_status(pid)
        idle_samples = []
        for _ in range(int(args.idle_s / 0.25)):  # the worker's idle heartbeats (one a second) get their turn
            time.sleep(0.25)
            idle_samples.append(worker_status(pid)["VmRSS"])
        idle = worker_status(pid)
        state = httpx.get(base + "/v1/admin/workers", timeout=10).json()["data"]
        report = {"repo": str(args.repo), "requests": args.requests, "concurrency": args.concurrency,
                  "elapsed_s": round(elapsed, 1), "statuses": statuses,
                  "rss_ready_mib": round(ready["VmRSS"] / MIB), "rss_load_median_mib": round(sorted(samples)[len(samples) // 2] / MIB),
                  "rss_load_max_mib": round(max(samples) / MIB), "rss_end_mib": round(end["VmRSS"] / MIB),
                  "rss_idle_mib": round(idle["VmRSS"] / MIB), "rss_idle_max_mib": round(max(idle_samples) / MIB),
                  "rss_peak_mib": round(idle["VmHWM"] / MIB),
                  "worker_state_memory": state[0].get("memory") if state else None}
        write_report(report, args.out)
    finally:
        web.stop()
        worker.stop()
        redis_proc.stop()


if __name__ == "__main__":
    main()
