"""Text benchmark, side by side in one run: mlxq vs mlx-lm called directly vs mlx_lm.server.

Measures (1) the latency a 1-token chat gains by going through the service (HTTP, Redis, RQ, the
worker, pub/sub) over calling mlx-lm directly, and (2) decode tokens/s through each path.

    python bench/bench_text.py --model ~/.cache/mlxq/models/smollm2-135m
    python bench/bench_text.py --random-from CONFIG_DIR --layers 16 ...   # GPU machine: random weights

Prints a JSON report (and writes it to --out). Start-up of each server is excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.common import Proc, free_port, percentile, start_redis, wait_http, write_report  # noqa: E402

SPACING_S = 0.05
"""Pause between calls in the 'spaced' latency runs."""

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and the sea."}]


def same_weights_everywhere(model_dir: Path) -> Path:
    """The model directory all three contestants load: the worker's platform policy applied once.

    On a Linux CPU with fast BLAS the worker runs small models dequantized to float32; mlx_lm.server
    would run the stored quantized weights, so it gets a float32 copy too (same weights for all).
    """
    from workers.platform import detect
    from workers.registry import weight_stats

    if not detect().use_float32(weight_stats(model_dir).float32_bytes):
        return model_dir
    import mlx_lm.utils

    from workers.text import load

    model, tokenizer = load(model_dir, float32=True)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    out = Path(tempfile.mkdtemp(prefix="mlxq-bench-f32-"))
    mlx_lm.utils.save(out, model_dir, model, tokenizer, config)
    return out


def direct_latency(model, tokenizer, n: int, gap_s: float = 0.0) -> list[float]:
    """Seconds for a 1-token greedy chat by calling mlx-lm directly (tokenize + prefill + 1 token)."""
    import mlx_lm

    samples = []
    for i in range(n + 3):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
        for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=1):
            pass
        if i >= 3:  # warm-up
            samples.append(time.perf_counter() - t0)
    return samples


def direct_decode(model, tokenizer, max_tokens: int, runs: int) -> list[float]:
    """Decode tokens/s of mlx_lm.stream_generate (first to last token, wall clock)."""
    import mlx_lm

    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True)
    rates = []
    for _ in range(runs + 1):
        stamps = [time.perf_counter() for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)]
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return rates[1:]


def http_latency(base: str, model: str, n: int, gap_s: float = 0.0) -> list[float]:
    """Seconds for a 1-token greedy chat through an OpenAI-compatible server (keep-alive client).

    gap_s > 0 pauses between calls: one isolated request's latency, without the server's work on
    the previous request (RQ's bookkeeping, say) still in the way.
    """
    body = {"model": model, "messages": PROMPT, "max_tokens": 1, "temperature": 0}
    samples = []
    with httpx.Client(base_url=base, timeout=120) as client:
        for i in range(n + 3):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            response = client.post("/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - t0
            response.raise_for_status()
            if i >= 3:
                samples.append(elapsed)
    return samples


def http_decode(base: str, model: str, max_tokens: int, runs: int) -> list[float]:
    """Decode tokens/s of a streamed chat: content chunks from the first to the last, wall clock."""
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    rates = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for _ in range(runs + 1):
            first = last = None
            tokens = 0
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        last = time.perf_counter()
                        first = first or last
            rates.append((tokens - 1) / (last - first))
    return rates[1:]


def summary(samples: list[float]) -> dict:
    """p50/p99/mean of a list of samples."""
    return {"n": len(samples), "p50": percentile(samples, 50), "p99": percentile(samples, 99),
            "mean": statistics.fmean(samples)}


def run_mlxq(model_dir: Path, redis_url: str, env_extra: dict, args) -> dict:
    """Start worker + gunicorn on the model, measure, stop."""
    port = free_port()
    models_dir = Path(tempfile.mkdtemp(prefix="mlxq-bench-models-"))
    (models_dir / "aliases.json").write_text(json.dumps({"bench": str(model_dir)}))
    env = {**os.environ, "REDIS_URL": redis_url, "MLXQ_MODELS_DIR": str(models_dir), "MLXQ_DEFAULT_MODEL": "bench",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env_extra}
    worker = Proc([sys.executable, "-m", "workers.main"], env, "worker").start()
    web = Proc([sys.executable, "-m", "gunicorn", "-k", "gevent", "-w", "1", "-b", f"127.0.0.1:{port}",
                "web.app:create_app()"], env, "web").start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/ready", 300)
        return {"latency_s": summary(http_latency(base, "bench", args.latency_n)),
                "latency_spaced_s": summary(http_latency(base, "bench", args.latency_n, SPACING_S)),
                "decode_tps": summary(http_decode(base, "bench", args.max_tokens, args.decode_runs))}
    finally:
        web.stop()
        worker.stop()


def run_mlx_lm_server(model_dir: Path, args) -> dict:
    """Start mlx_lm.server on the model, measure, stop."""
    port = free_port()
    server = Proc([sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir), "--port", str(port)],
                  dict(os.environ), "mlx_lm.server").start()
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/v1/models", 300)
        return {"latency_s": summary(http_latency(base, str(model_dir), args.latency_n)),
                "latency_spaced_s": summary(http_latency(base, str(model_dir), args.latency_n, SPACING_S)),
                "decode_tps": summary(http_decode(base, str(model_dir), args.max_tokens, args.decode_runs))}
    finally:
        server.stop()


def reexec_with_worker_blas() -> None:
    """Run this benchmark with the BLAS the worker picks for itself (LD_PRELOAD works only at start)."""
    from workers.platform import blas_loaded, choose_blas

    choice = choose_blas()
    if choice.path and not blas_loaded(choice.path) and not os.environ.get("MLXQ_BENCH_REEXEC"):
        env = {**os.environ, "LD_PRELOAD": choice.path, "MLXQ_BENCH_REEXEC": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> None:
    """Run every measurement and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="an MLX model directory")
    parser.add_argument("--latency-n", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--decode-runs", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()
    redis_url, redis_proc = start_redis()
    env_extra = {}
    try:
        report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d"),
                  "model": str(args.model), "max_tokens": args.max_tokens}
        import mlx_lm

        model_dir = same_weights_everywhere(args.model)
        report["model_as_run"] = str(model_dir)
        model, tokenizer = mlx_lm.load(str(model_dir))
        report["direct_latency_s"] = summary(direct_latency(model, tokenizer, args.latency_n))
        report["direct_latency_spaced_s"] = summary(direct_latency(model, tokenizer, args.latency_n, SPACING_S))
        report["direct_decode_tps"] = summary(direct_decode(model, tokenizer, args.max_tokens, args.decode_runs))
        report["mlxq"] = run_mlxq(model_dir, redis_url, env_extra, args)
        report["mlx_lm_server"] = run_mlx_lm_server(model_dir, args)
        # Measured again at the end: how much the machine itself drifted during the run.
        report["direct_decode_tps_after"] = summary(direct_decode(model, tokenizer, args.max_tokens,
                                                                  args.decode_runs))
    finally:
        redis_proc.stop()
    d, s = report["direct_latency_s"], report["mlxq"]["latency_s"]
    report["added_latency_ms"] = {"p50": 1000 * (s["p50"] - d["p50"]), "p99": 1000 * (s["p99"] - d["p99"])}
    d, s = report["direct_latency_spaced_s"], report["mlxq"]["latency_spaced_s"]
    report["added_latency_spaced_ms"] = {"p50": 1000 * (s["p50"] - d["p50"]), "p99": 1000 * (s["p99"] - d["p99"])}
    direct_tps = max(report["direct_decode_tps"]["p50"], report["direct_decode_tps_after"]["p50"])
    report["decode_ratio_vs_direct"] = {"mlxq": report["mlxq"]["decode_tps"]["p50"] / direct_tps,
                                        "mlx_lm_server": report["mlx_lm_server"]["decode_tps"]["p50"] / direct_tps}
    write_report(report, args.out)


if __name__ == "__main__":
    main()
