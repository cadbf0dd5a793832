"""Two models under one mixed load: one worker switching between them vs two dedicated workers, one run.

The load is the same for every setup: chats on the text demo model and transcriptions on Whisper,
interleaved, a few at a time. Setups, each with a fresh web tier, workers and Redis:

- `one_worker_small`: one worker whose memory budget (--budget-mb) holds one of the models at a
  time, so it evicts and reloads as the load switches between them (model thrashing);
- `one_worker`: one worker with the default budget (both models stay resident);
- `two_workers`: `mlxq worker --models` for each model, each with the small budget.

Reports requests/s, latency per kind and the model loads during the load (from /metrics).

    python bench/bench_workers.py [--requests 24] [--concurrency 4] [--budget-mb 600] [--out r.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import Proc, free_port, percentile, start_redis, wait_http, write_report  # noqa: E402
from mlxq.cli import gunicorn_argv  # noqa: E402

TEXT, SPEECH = "smollm2-135m", "whisper-tiny.en"
AUDIO = (REPO / "tests" / "fixtures" / "speech" / "numbers.wav").read_bytes()


def start(setup: str, budget_mb: int) -> tuple[str, list[Proc]]:
    """Redis, the web tier and the setup's workers; return the base URL once every worker is up."""
    redis_url, redis_proc = start_redis()
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONPATH": str(REPO)}
    small = {**env, "MLXQ_MEMORY_BUDGET_MB": str(budget_mb)}
    worker = [sys.executable, "-m", "workers.main"]
    workers = {"one_worker_small": [(worker, small)], "one_worker": [(worker, env)],
               "two_workers": [([*worker, "--models", TEXT], small), ([*worker, "--models", SPEECH], small)]}[setup]
    port = free_port()
    procs = [redis_proc, *(Proc(argv, e, f"{setup}-worker{i}").start() for i, (argv, e) in enumerate(workers))]
    procs.append(Proc(gunicorn_argv("127.0.0.1", port, 2), env, f"{setup}-web").start())
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/ready", 300)
    deadline = time.monotonic() + 300
    while len(httpx.get(base + "/v1/admin/workers").json()["data"]) < len(workers):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{setup}: workers not up")
        time.sleep(0.2)
    return base, procs


def chat(client: httpx.Client, i: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = client.post("/v1/chat/completions", json={"model": TEXT, "max_tokens": 16, "temperature": 0,
                                                  "messages": [{"role": "user", "content": f"Tell me about {i}."}]})
    r.raise_for_status()
    return "chat", time.perf_counter() - t0


def transcribe(client: httpx.Client, i: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = client.post("/v1/audio/transcriptions", data={"model": SPEECH}, files={"file": (f"{i}.wav", AUDIO)})
    r.raise_for_status()
    return "transcription", time.perf_counter() - t0


def model_loads(client: httpx.Client) -> float:
    """Model loads so far, from /metrics."""
    text = client.get("/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "mlxq_model_load_seconds_count")


def run_load(base: str, requests: int, concurrency: int) -> dict:
    """The mixed load: chat and transcription alternating, `concurrency` at a time."""
    with httpx.Client(base_url=base, timeout=600) as client:
        for call in (chat, transcribe, chat, transcribe):  # warm both paths
            call(client, -1)
        loads_before = model_loads(client)
        calls = [(chat if i % 2 == 0 else transcribe, i) for i in range(requests)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(lambda c: c[0](client, c[1]), calls))
        wall = time.perf_counter() - t0
        loads = model_loads(client) - loads_before
    report = {"wall_s": round(wall, 2), "requests_per_s": round(requests / wall, 3), "model_loads": loads}
    for kind in ("chat", "transcription"):
        times = [t for k, t in results if k == kind]
        report[kind] = {"n": len(times), "p50_s": round(statistics.median(times), 3),
                        "p95_s": round(percentile(times, 95), 3)}
    return report


def main() -> None:
    """Run every setup under the same load, one after another; print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--budget-mb", type=int, default=600,
                        help="the small budget: one model fits, not both (the demo models: 538 + 151 MB as float32)")
    parser.add_argument("--setups", default="one_worker_small,one_worker,two_workers")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    report = {"machine": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv)}
    for setup in args.setups.split(","):
        base, procs = start(setup, args.budget_mb)
        try:
            report[setup] = run_load(base, args.requests, args.concurrency)
        finally:
            for proc in reversed(procs):
                proc.stop()
        print(setup, report[setup], file=sys.stderr)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
