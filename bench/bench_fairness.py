"""Fairness benchmark: how long a short chat takes while others' big requests run (issue 29).

Against one mlxq service (worker + gunicorn + a private Redis), a short streamed chat (greedy,
`--short-tokens` tokens) is timed, time to first token and total:

- **idle**, twice (the control: how far two identical measurements come apart in this run);
- while **two long prompts** (`--long-tokens` tokens each, distinct) are being prefilled;
- while **one completions request** with 32 prompts × 2 choices × 256 tokens runs.

Each loaded figure is judged against `3 × idle + one prefill chunk`, the chunk being one
PREFILL_CHUNK-token piece of one prompt at the end of a `--long-tokens` prompt, timed with the
model called directly in this process (before the service starts, so nothing competes with it).
Beside it, what the others pay: the long prompts' time to first token, and the tokens/s of the
completions request alone (32 tokens a choice). The completions load is canceled once the short
chat has ended (its client goes away), so a round takes seconds, not the request's minutes.

    python bench/bench_fairness.py --model ~/.cache/mlxq/models/smollm2-135m [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import reexec_with_worker_blas, start_mlxq  # noqa: E402
from bench.common import KeepAliveClient, start_redis, write_report  # noqa: E402

SHORT = [{"role": "user", "content": "What is the capital of France?"}]
WORDS = ("river stone lantern orchard harbour meadow engine violin copper thunder garden pepper "
         "window candle island ladder mirror saddle timber velvet").split()
SETTLE_S = 1.0
"""How long the big requests run before the short chat is sent (they are claimed within milliseconds)."""


def chunk_seconds(model_dir: Path, chunk: int, context: int) -> dict:
    """Seconds one prefill chunk of one prompt takes, at the start of a prompt and after `context`
    tokens (the model loaded as the worker loads it; the faster of 2, after one untimed)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from workers.backends.textgen import load
    from workers.models import weight_stats
    from workers.platform import detect

    model, _ = load(model_dir, float32=detect().use_float32(weight_stats(model_dir).float32_bytes))
    tokens = mx.array([random.Random(0).randrange(1000, 20000) for _ in range(context + chunk)])[None]

    def forward(cache, start: int) -> float:
        t0 = time.perf_counter()
        model(tokens[:, start:start + chunk], cache=cache)
        mx.eval([c.state for c in cache])
        return time.perf_counter() - t0

    def timed(cache, start: int) -> float:
        runs = []
        for _ in range(3):  # the same chunk again each time: the cache is cut back after it
            runs.append(forward(cache, start))
            trim_prompt_cache(cache, chunk)
        return min(runs[1:])  # the first one warms up

    cache = make_prompt_cache(model)
    at_start = timed(cache, 0)
    for start in range(0, context, chunk):
        forward(cache, start)
    return {"at_start_s": at_start, f"after_{context}_tokens_s": timed(cache, context)}


def long_text(tokenizer, tokens: int, seed: int) -> str:
    """A user message of about `tokens` tokens (as the chat template will count them), its own words."""
    rng = random.Random(seed)
    words = [f"Note {seed}:"]
    while True:
        words += [rng.choice(WORDS) for _ in range(200)]
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= tokens - 40:  # the template's own tokens make up the rest
            return text


def timed_chat(base: str, body: dict) -> dict:
    """Stream one chat: seconds to its first content chunk and to its end (perf_counter of the end too)."""
    client = KeepAliveClient(base)
    t0 = time.perf_counter()
    first = None
    try:
        for line in client.stream_lines("/v1/chat/completions", {**body, "temperature": 0, "stream": True}):
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter()
            if line == "data: [DONE]":
                break
    finally:
        client.close()
    end = time.perf_counter()
    return {"ttft_s": (first or end) - t0, "total_s": end - t0, "ended_at": end}


def short_chat(base: str, model: str, max_tokens: int) -> dict:
    """A short streamed greedy chat: seconds to its first content chunk and to its end."""
    return timed_chat(base, {"model": model, "messages": SHORT, "max_tokens": max_tokens})


def in_thread(target, *args) -> tuple[threading.Thread, dict]:
    """Run `target(*args)` in a thread; its result (or error) lands in the returned dict."""
    out: dict = {}

    def run():
        t0 = time.perf_counter()
        try:
            out["result"] = target(*args)
        except Exception as exc:  # noqa: BLE001 (reported, not hidden)
            out["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out["ended_at"], out["wall_s"] = time.perf_counter(), time.perf_counter() - t0

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def long_chat(base: str, model: str, text: str) -> dict:
    """A streamed chat on a long prompt: seconds to its first content chunk."""
    timed = timed_chat(base, {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8})
    return {"ttft_s": timed["ttft_s"]}


def completions(base: str, model: str, seed: int, max_tokens: int = 256, clients: list | None = None,
                temperature: float = 1.0) -> dict:
    """One completions request: 32 prompts × 2 choices × up to `max_tokens` tokens; its client goes in
    `clients` (closing it cancels the request)."""
    prompts = [f"Story {seed}-{i}: once upon a time, by the {WORDS[i % len(WORDS)]}," for i in range(32)]
    body = {"model": model, "prompt": prompts, "n": 2, "max_tokens": max_tokens, "temperature": temperature,
            "seed": seed}
    client = KeepAliveClient(base, retry=clients is None)  # a load cut off by closing its connection ends there
    if clients is not None:
        clients.append(client)
    t0 = time.perf_counter()
    try:
        answer = client.post_json("/v1/completions", body)
    finally:
        client.close()
    tokens = answer["usage"]["completion_tokens"]
    return {"completion_tokens": tokens, "tokens_per_s": tokens / (time.perf_counter() - t0)}


def wait_idle(redis_url: str, timeout_s: float = 60) -> float:
    """Wait until no job is running in any queue (a canceled load ends at its next step, after its
    client is seen gone); the seconds it took."""
    import redis
    from rq import Queue

    conn, t0 = redis.Redis.from_url(redis_url), time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if not any(q.started_job_registry.count for q in Queue.all(connection=conn)):
            return time.perf_counter() - t0
        time.sleep(0.05)
    raise TimeoutError(f"jobs still running after {timeout_s} s")


def under(load, base: str, model: str, short_tokens: int, clients: list | None = None,
          settle_s: float = SETTLE_S) -> dict:
    """Start `load` (a list of (callable, args)), let it settle, time a short chat, then wait for the
    load (canceled first when its `clients` are given: what it does after the short chat is not measured)."""
    started = [in_thread(fn, base, model, *args) for fn, args in load]
    time.sleep(settle_s)
    short = short_chat(base, model, short_tokens)
    for client in clients or []:
        if client.connection.sock is not None:
            client.connection.sock.shutdown(socket.SHUT_RDWR)  # a client that goes away cancels its request
    for thread, _ in started:
        thread.join(1800)
    others = [out for _, out in started]
    short["load_still_running"] = all(o.get("ended_at", 0) > short["ended_at"] for o in others)
    short.pop("ended_at")
    short["load"] = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in o.items() if k != "ended_at"}
                     for o in others]
    return short


def verdict(samples: list[dict], idle: dict, chunk_s: float) -> dict:
    """The loaded figures (medians and worst) against 3 × idle + one chunk."""
    out = {}
    for key in ("ttft_s", "total_s"):
        values = [s[key] for s in samples]
        limit = 3 * idle[key] + chunk_s
        out[key] = {"median": statistics.median(values), "max": max(values), "limit": limit,
                    "within": max(values) <= limit}
    return out


def main() -> None:
    """Measure the chunk, start mlxq, run the idle and loaded short chats, print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=2, help="loaded measurements of each kind")
    parser.add_argument("--idle-samples", type=int, default=5, help="short chats in each idle block")
    parser.add_argument("--chunk", type=int, default=512, help="the worker's PREFILL_CHUNK")
    parser.add_argument("--long-settle", type=float, default=SETTLE_S,
                        help="seconds the long prompts run before the short chat (on a GPU they are prefilled "
                             "within tenths of a second: use less; each run reports whether they still were)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--big-temperature", type=float, default=1.0,
                        help="the 32 x 2 request's temperature (1.0, the API's default; 0 is the greedy control)")
    parser.add_argument("--profile", type=Path, help="also profile the worker (py-spy, collapsed stacks) while "
                                                     "the 32 x 2 request runs alone, into this file")
    args = parser.parse_args()
    reexec_with_worker_blas()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(args.model))
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "command": " ".join(sys.argv), "short_tokens": args.short_tokens,
              "chunk": chunk_seconds(args.model, args.chunk, args.long_tokens - args.chunk)}
    chunk_s = report["chunk"][f"after_{args.long_tokens - args.chunk}_tokens_s"]
    redis_url, redis_proc = start_redis()
    server = None
    try:
        server = start_mlxq(args.model, redis_url)
        base, model = server.base, server.model
        for _ in range(2):  # warm-up: the model loads, kernels compile
            short_chat(base, model, args.short_tokens)

        def idle_block() -> dict:
            runs = [short_chat(base, model, args.short_tokens) for _ in range(args.idle_samples)]
            return {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "total_s")}

        seed = int(time.time())

        def loaded_round(r: int) -> tuple[dict, dict]:
            texts = [long_text(tokenizer, args.long_tokens, seed + 10 * r + i) for i in range(2)]
            longs = under([(long_chat, (t,)) for t in texts], base, model, args.short_tokens,
                          settle_s=args.long_settle)
            # Sent while they were still being prefilled: neither had its first token before the short chat.
            longs["during_prefill"] = all(o["result"]["ttft_s"] > args.long_settle for o in longs["load"]
                                          if "result" in o)
            clients: list = []
            big = under([(completions, (seed + r, 256, clients, args.big_temperature))], base, model,
                        args.short_tokens, clients)
            big["canceled_load_ended_after_s"] = round(wait_idle(redis_url), 3)  # the next figure starts idle
            return longs, big

        loaded_round(-1)  # warm-up, not counted: the loads' shapes compile their kernels here
        idle = [idle_block()]
        two_long, big = [], []
        for r in range(args.rounds):
            longs, many = loaded_round(r)
            two_long.append(longs)
            big.append(many)
        idle.append(idle_block())
        # What decoding many sequences gives, with nothing else running: the batch's throughput.
        report["big_request_alone_32_tokens"] = completions(base, model, seed + 100, 32,
                                                            temperature=args.big_temperature)
        if args.profile:  # the same again under py-spy: where a step of 64 sequences spends its time
            spy = subprocess.Popen(["py-spy", "record", "--native", "--rate", "200", "--format", "raw",
                                    "--pid", str(server.procs[0].process.pid), "--output", str(args.profile)],
                                   stdout=subprocess.DEVNULL)
            time.sleep(2)  # attached
            report["big_request_alone_profiled"] = completions(base, model, seed + 101, 128)
            spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
            spy.wait(60)
    finally:
        if server is not None:
            server.close()
        redis_proc.stop()
    idle_best = {k: min(i[k] for i in idle) for k in ("ttft_s", "total_s")}
    report["idle"] = {"blocks": idle, "spread": {k: max(i[k] for i in idle) / min(i[k] for i in idle)
                                                 for k in ("ttft_s", "total_s")}}
    report["two_long_prompts"] = {"runs": two_long, "verdict": verdict(two_long, idle_best, chunk_s)}
    report["completions_32x2"] = {"runs": big, "verdict": verdict(big, idle_best, chunk_s)}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
