"""Text benchmark, side by side in one run: mlxq vs mlx-lm called directly vs mlx_lm.server.

Measures (1) the latency a 1-token chat gains by going through the service (HTTP, Redis, RQ, the
worker, pub/sub) over calling mlx-lm directly, and (2) decode tokens/s through each path.

All three contestants are up at once and the measurements are interleaved (a block of calls to
each in turn, round after round), so that a machine whose speed drifts during the run (shared or
throttled) moves every contestant's figures alike instead of whichever ran at the time.

    python bench/bench_text.py --model ~/.cache/mlxq/models/smollm2-135m

Prints a JSON report (and writes it to --out). Start-up of each server is excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import (  # noqa: E402
    KeepAliveClient,
    Proc,
    decode_rate,
    free_port,
    percentile,
    start_redis,
    wait_http,
    write_report,
)
from mlxq.cli import default_web_workers, gunicorn_argv  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]
WARMUP = 3
"""Untimed calls to each contestant before measuring."""


def same_weights_everywhere(model_dir: Path) -> Path:
    """The model directory all three contestants load: the worker's platform policy applied once.

    On a Linux CPU with fast BLAS the worker runs small models dequantized to float32; mlx_lm.server
    would run the stored quantized weights, so it gets a float32 copy too (same weights for all).
    """
    from workers.models import weight_stats
    from workers.platform import detect

    if not detect().use_float32(weight_stats(model_dir).float32_bytes):
        return model_dir
    import mlx_lm.utils

    from workers.backends.textgen import load

    model, tokenizer = load(model_dir, float32=True)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    out = Path(tempfile.mkdtemp(prefix="mlxq-bench-f32-"))
    mlx_lm.utils.save(out, model_dir, model, tokenizer, config)
    return out


class Direct:
    """mlx-lm called in this process: the baseline."""

    name = "direct"

    def __init__(self, model_dir: Path):
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(model_dir))

    def one_token(self) -> float:
        """Seconds for a 1-token greedy chat: chat template + prefill + 1 token, as a caller sees it."""
        import mlx_lm

        t0 = time.perf_counter()
        prompt = self.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
        for _ in mlx_lm.stream_generate(self.model, self.tokenizer, prompt, max_tokens=1):
            pass
        return time.perf_counter() - t0

    def decode(self, max_tokens: int) -> float:
        """Decode tokens/s of mlx_lm.stream_generate (first to last token, wall clock)."""
        import mlx_lm

        prompt = self.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
        stamps = [time.perf_counter() for _ in mlx_lm.stream_generate(self.model, self.tokenizer, prompt,
                                                                       max_tokens=max_tokens)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def close(self) -> None:
        """Nothing to stop."""


class DirectElsewhere:
    """The same baseline in a process of its own (`--control`): what two identical direct callers
    differ by in one run is how finely this machine can resolve a process's added latency at all."""

    name = "direct_other_process"

    def __init__(self, model_dir: Path):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from bench.bench_text import serve_direct; "
                "serve_direct(sys.argv[2])")
        self.process = subprocess.Popen([sys.executable, "-c", code, str(REPO), str(model_dir)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._ask("ready")

    def _ask(self, command: str) -> float:
        self.process.stdin.write(command + "\n")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the direct process exited (code {self.process.wait(10)})")
        return float(line)

    def one_token(self) -> float:
        """Seconds for a 1-token greedy chat, timed inside the other process exactly as Direct times it."""
        return self._ask("one")

    def decode(self, max_tokens: int) -> float:
        """Decode tokens/s, measured inside the other process as Direct measures it."""
        return self._ask(f"decode {max_tokens}")

    def close(self) -> None:
        """Stop the process (it exits at the end of its input)."""
        self.process.stdin.close()
        self.process.wait(30)


def serve_direct(model_dir: str) -> None:
    """The loop of DirectElsewhere's process: a command per input line, a number per output line."""
    direct = Direct(Path(model_dir))
    for line in sys.stdin:
        command, *arg = line.split()
        if command == "one":
            result = direct.one_token()
        elif command == "decode":
            result = direct.decode(int(arg[0]))
        else:  # "ready": the model is loaded
            result = 0.0
        print(result, flush=True)


class HTTPServer:
    """An OpenAI-compatible server over HTTP with a keep-alive client."""

    def __init__(self, name: str, base: str, model: str, procs: list[Proc]):
        self.name, self.base, self.model, self.procs = name, base, model, procs
        self.client = KeepAliveClient(base)

    def one_token(self) -> float:
        """Seconds for a 1-token greedy chat over HTTP."""
        body = {"model": self.model, "messages": PROMPT, "max_tokens": 1, "temperature": 0}
        t0 = time.perf_counter()
        self.client.post_json("/v1/chat/completions", body)
        return time.perf_counter() - t0

    def decode(self, max_tokens: int) -> float:
        """Decode tokens/s of a streamed chat: content chunks from the first to the last, wall clock."""
        body = {"model": self.model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        return decode_rate(self.client.stream_lines("/v1/chat/completions", body))[0]

    def close(self) -> None:
        """Stop the server's processes."""
        self.client.close()
        for proc in reversed(self.procs):
            proc.stop()


def start_mlxq(model_dir: Path, redis_url: str, name: str = "mlxq", env_extra: dict | None = None,
               worker_env: dict | None = None, web_workers: int | None = None) -> HTTPServer:
    """Start the worker and gunicorn (gevent, `web_workers` processes, by default `mlxq up`'s) on the model;
    return once /ready answers.

    `env_extra` goes to both processes, `worker_env` to the worker only.
    """
    port = free_port()
    models_dir = Path(tempfile.mkdtemp(prefix="mlxq-bench-models-"))
    (models_dir / "aliases.json").write_text(json.dumps({"bench": str(model_dir)}))
    env = {**os.environ, "REDIS_URL": redis_url, "MLXQ_MODELS_DIR": str(models_dir), "MLXQ_DEFAULT_MODEL": "bench",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {})}
    worker = Proc([sys.executable, "-m", "workers.main"], {**env, **(worker_env or {})}, f"{name}-worker").start()
    web = Proc(gunicorn_argv("127.0.0.1", port, workers=web_workers or default_web_workers()), env,
               f"{name}-web").start()
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/ready", 300)
    return HTTPServer(name, base, "bench", [worker, web])


def start_mlx_lm_server(model_dir: Path, name: str = "mlx_lm_server") -> HTTPServer:
    """Start mlx_lm.server on the model; return once it answers."""
    port = free_port()
    server = Proc([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
                  dict(os.environ), "mlx_lm.server" if name == "mlx_lm_server" else name).start()  # its log's name
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/v1/models", 300)
    return HTTPServer(name, base, str(model_dir), [server])


def interleaved(contestants: list, measure: Callable, rounds: int, block: int, gap_s: float = 0.0) -> dict:
    """Run `block` consecutive measurements on each contestant in turn, `rounds` times; samples by name.

    The order of contestants rotates every round, so none is always first after another's work.
    """
    samples: dict[str, list[float]] = {c.name: [] for c in contestants}
    for r in range(rounds):
        for c in contestants[r % len(contestants):] + contestants[: r % len(contestants)]:
            for _ in range(block):
                time.sleep(gap_s)
                samples[c.name].append(measure(c))
    return samples


def summary(samples: list[float]) -> dict:
    """p50/p99/mean of a list of samples."""
    return {"n": len(samples), "p50": percentile(samples, 50), "p99": percentile(samples, 99),
            "mean": statistics.fmean(samples)}


def added_ms(samples: dict, server: str) -> dict:
    """What `server` adds over direct, in milliseconds: the difference of the percentiles, and the
    percentiles of the per-call differences (call i of the server minus call i of direct, made in
    the same round, moments apart: the machine's drift cancels out)."""
    s, d = summary(samples[server]), summary(samples["direct"])
    paired = [a - b for a, b in zip(samples[server], samples["direct"], strict=True)]
    return {"p50": 1000 * (s["p50"] - d["p50"]), "p99": 1000 * (s["p99"] - d["p99"]),
            "paired_p50": 1000 * percentile(paired, 50), "paired_p99": 1000 * percentile(paired, 99)}


def reexec_with_worker_blas() -> None:
    """Run this benchmark with the BLAS the worker picks for itself (LD_PRELOAD works only at start) and the
    worker's MLX settings (workers/process_setup.py), which the servers it starts inherit: every contestant
    runs the same arithmetic."""
    from workers.platform import choose_blas
    from workers.process_setup import MLX_ENVIRONMENT

    for name, value in MLX_ENVIRONMENT.items():
        os.environ.setdefault(name, value)

    choice = choose_blas()
    if not choice.active() and not os.environ.get("MLXQ_BENCH_REEXEC"):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**choice.env(os.environ), "MLXQ_BENCH_REEXEC": "1"})


def other_mlxq_settings(args) -> list[dict]:
    """The environment of each additional mlxq the command line asks for."""
    extra = [dict(pair.split("=", 1) for pair in spec.split(",")) for spec in args.also]
    if args.also_stream_interval_ms is not None:
        extra.append({"MLXQ_STREAM_INTERVAL_MS": str(args.also_stream_interval_ms)})
    return extra


def mlxq_name(env: dict) -> str:
    """A report key (and log file name) for an mlxq run with these settings, e.g. mlxq_stream_interval_ms_0."""
    name = "mlxq_" + "_".join(f"{k.removeprefix('MLXQ_').lower()}_{v}" for k, v in env.items())
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)  # a value may be a path (--also PYTHONPATH=OLD_CHECKOUT)


def main() -> None:
    """Start every contestant, run the interleaved measurements and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an MLX model directory")
    parser.add_argument("--latency-n", type=int, default=100, help="1-token calls per contestant and pattern")
    parser.add_argument("--gap-ms", type=float, default=20.0,
                        help="pause before each alternating call, so that no contestant's leftover work overlaps it")
    parser.add_argument("--burst", type=int, default=10, help="back-to-back calls per contestant in a burst block")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--decode-runs", type=int, default=5, help="decode runs per contestant")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="also run another mlxq with these environment settings (repeatable)")
    parser.add_argument("--also-stream-interval-ms", type=int, default=None,
                        help="the same as --also MLXQ_STREAM_INTERVAL_MS=N")
    parser.add_argument("--control", action="store_true",
                        help="also time direct in a second process: the machine's own difference between two processes")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "max_tokens": args.max_tokens, "command": " ".join(sys.argv)}
    redis_url, redis_proc = start_redis()
    contestants = []
    try:
        model_dir = same_weights_everywhere(args.model)
        report["model_as_run"] = str(model_dir)
        contestants.append(Direct(model_dir))
        if args.control:
            contestants.append(DirectElsewhere(model_dir))
        contestants.append(start_mlxq(model_dir, redis_url))
        contestants.append(start_mlx_lm_server(model_dir))
        for db, env in enumerate(other_mlxq_settings(args), start=1):
            # Its own Redis database: two workers on one queue would take each other's jobs.
            contestants.append(start_mlxq(model_dir, f"{redis_url.rsplit('/', 1)[0]}/{db}", mlxq_name(env), env))
        interleaved(contestants, lambda c: c.one_token(), 1, WARMUP)
        one_token = lambda c: c.one_token()  # noqa: E731
        # Alternating: one call to each in turn after a pause, so every call finds an idle machine.
        alternating = interleaved(contestants, one_token, args.latency_n, 1, args.gap_ms / 1000)
        # Bursts: back-to-back calls, so a call may find the server still busy with the previous one.
        bursts = interleaved(contestants, one_token, max(1, args.latency_n // args.burst), args.burst)
        decode = interleaved(contestants, lambda c: c.decode(args.max_tokens), args.decode_runs, 1)
    finally:
        for c in contestants:
            c.close()
        redis_proc.stop()
    servers = [c.name for c in contestants if c.name != "direct"]
    for name in ["direct", *servers]:
        report[name] = {"latency_alternating_s": summary(alternating[name]),
                        "latency_burst_s": summary(bursts[name]), "decode_tps": summary(decode[name]),
                        "decode_tps_runs": decode[name],
                        "samples_s": {"alternating": alternating[name], "burst": bursts[name]}}
    report["added_latency_ms"] = {
        pattern: {server: added_ms(samples, server) for server in servers}
        for pattern, samples in (("alternating", alternating), ("burst", bursts))}
    direct_tps = statistics.median(decode["direct"])
    report["decode_ratio_vs_direct"] = {
        server: {"of_medians": statistics.median(decode[server]) / direct_tps,
                 # Each run against the direct run of the same round: drift cancels out.
                 "paired_median": statistics.median(s / d for s, d in zip(decode[server], decode["direct"], strict=True))}
        for server in servers}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
