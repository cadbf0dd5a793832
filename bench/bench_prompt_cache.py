"""Time to first token of a long prompt: cold, from the prompt cache's memory tier, and from its disk tier
after the worker was killed (-9) and a new one started on the same directory.

    .venv/bin/python -m bench.bench_prompt_cache [--tokens 4000] [--runs 3] [--model smollm2-135m]

It starts a private Redis, the web tier and a worker (MLXQ_PROMPT_CACHE_DIR in a temporary directory), sends
`--runs` distinct prompts of about `--tokens` tokens each twice (cold, then from memory), kills the worker,
starts another, and sends them again (from disk). Each figure is the time from sending the streamed request
to its first chunk of text, as a client sees it; the report gives each run's and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import Proc, free_port, start_redis, write_report  # noqa: E402


def prompt(run: int, tokens: int) -> str:
    """A prompt of about `tokens` tokens (the demo model's tokenizer: ~19 a fact), distinct per run."""
    return f"Run {run}. Remember these facts. " + " ".join(
        f"Fact {i}: the box {i + 1000 * (run + 1)} holds {i * 7 % 13} red stones." for i in range(tokens // 19))


def first_token(api: httpx.Client, model: str, text: str) -> tuple[float, dict]:
    """Seconds to the first chunk of a streamed greedy chat, and its usage."""
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    began, first, usage = time.perf_counter(), None, {}
    with api.stream("POST", "/v1/chat/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if first is None and chunk["choices"]:
                    first = time.perf_counter() - began
                usage = chunk.get("usage") or usage
    return first, usage


def wait_answering(api: httpx.Client, model: str, worker: Proc, timeout: float = 600) -> None:
    """Wait until a short chat is answered by a live worker (its model warm)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            sys.exit(f"the worker exited; see {worker.log}")
        try:
            reply = api.post("/v1/chat/completions", json={"model": model, "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
            if reply.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("no worker answered")


def main() -> None:
    """Run the three phases; print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cache_dir = Path(tempfile.mkdtemp(prefix="mlxq-bench-prompt-cache-"))
    redis_url, redis_proc = start_redis()
    port = free_port()
    env = {**os.environ, "REDIS_URL": redis_url, "MLXQ_REDIS_URL": redis_url, "MLXQ_PROMPT_CACHE_DIR": str(cache_dir),
           "MLXQ_SPOOL_DIR": tempfile.mkdtemp(prefix="mlxq-bench-spool-"), "PYTHONUNBUFFERED": "1"}
    from mlxq.cli import gunicorn_argv

    web = Proc(gunicorn_argv("127.0.0.1", port, 1), env, "web").start()
    worker = Proc([sys.executable, "-m", "workers.main"], env, "worker").start()
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    phases = {"cold": [], "memory": [], "disk_after_kill": []}
    usages = {name: [] for name in phases}
    try:
        wait_answering(api, args.model, worker)
        texts = [prompt(run, args.tokens) for run in range(args.runs)]
        for text in texts:
            for phase in ("cold", "memory"):
                seconds, usage = first_token(api, args.model, text)
                phases[phase].append(seconds)
                usages[phase].append(usage.get("prompt_tokens_details", {}).get("cached_tokens"))
        prompt_tokens = usage.get("prompt_tokens")
        deadline = time.monotonic() + 120  # every entry written by the worker's disk thread
        while len(list(cache_dir.glob("[0-9a-f]*.safetensors"))) < args.runs and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait(10)
        worker = Proc([sys.executable, "-m", "workers.main"], env, "worker").start()
        wait_answering(api, args.model, worker)
        for text in texts:
            seconds, usage = first_token(api, args.model, text)
            phases["disk_after_kill"].append(seconds)
            usages["disk_after_kill"].append(usage.get("prompt_tokens_details", {}).get("cached_tokens"))
    finally:
        api.close()
        for proc in (worker, web, redis_proc):
            proc.stop()
        entries = [p.stat().st_size for p in cache_dir.glob("[0-9a-f]*.safetensors")]
        shutil.rmtree(cache_dir, ignore_errors=True)
    write_report({"model": args.model, "prompt_tokens": prompt_tokens, "runs": args.runs,
                  "entry_file_mib": round(statistics.median(entries) / 2**20, 1) if entries else None,
                  "ttft_s_median": {name: round(statistics.median(v), 3) for name, v in phases.items()},
                  "ttft_s": {name: [round(s, 3) for s in v] for name, v in phases.items()},
                  "cached_tokens": usages}, args.out)


if __name__ == "__main__":
    main()
