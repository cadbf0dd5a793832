"""Concurrency benchmark: N streaming chats at once, mlxq vs mlx_lm.server on the same model, one run.

For each N (and each server, in alternating order), N clients each stream a 128-token greedy chat
with a prompt of their own, all started together. Reported per N and server: aggregate tokens/s
(every stream's completion tokens over the wall time from the first request to the last token),
time to first token p50/p99, and failed requests (an HTTP error, a dropped connection or a stream
that ended without its last chunk), each the median of `--rounds` rounds (failures: the sum).
Before its rounds, each N is run once unmeasured on both servers: MLX compiles kernels for each new
batch shape the first time it meets it (up to a second on CUDA), a cost a running service pays once.
Direct mlx-lm's single-stream decode is measured beside each N = 1 round, for the N = 1 ratio.

With `--control` a second mlx_lm.server runs beside the first: how far two identical servers come
apart in one run is how finely the run resolves a difference between mlxq and mlx_lm.server.

    python bench/bench_concurrency.py --model DIR [--n 1,8,32,64] [--max-tokens 128] [--rounds 3] [--control]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import (  # noqa: E402
    Direct,
    reexec_with_worker_blas,
    same_weights_everywhere,
    start_mlx_lm_server,
    start_mlxq,
)
from bench.common import KeepAliveClient, percentile, start_redis, write_report  # noqa: E402

TOPICS = ["a lighthouse", "a dragon", "the sea", "a city at night", "an old map", "a garden", "a river", "a train"]


def one_stream(base: str, model: str, index: int, max_tokens: int, started: float, out: dict) -> None:
    """Stream one chat; record its time to first token, completion tokens and end (or its failure)."""
    client = KeepAliveClient(base, timeout=600)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Request {index}: write a long story about "
                                                     f"{TOPICS[index % len(TOPICS)]}, number {index}."}]}
    first = tokens = None
    finished = False
    try:
        for line in client.stream_lines("/v1/chat/completions", body):
            if line == "data: [DONE]":
                finished = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
        end = time.perf_counter()
        ok = finished and tokens is not None and first is not None
        out[index] = {"ok": ok, "ttft": (first - started) if first else None, "tokens": tokens or 0, "end": end,
                      "decode_tps": (tokens - 1) / (end - first) if ok and tokens > 1 and end > first else None}
    except Exception as exc:  # noqa: BLE001 (every failure counts, whatever it is)
        out[index] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200], "end": time.perf_counter()}
    finally:
        client.close()


def round_of(server, n: int, max_tokens: int) -> dict:
    """N streams at once against one server; its aggregate figures."""
    results: dict[int, dict] = {}
    started = time.perf_counter()
    threads = [threading.Thread(target=one_stream, args=(server.base, server.model, i, max_tokens, started, results))
               for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    ok = [r for r in results.values() if r["ok"]]
    wall = max((r["end"] for r in results.values()), default=started) - started
    ttfts = [r["ttft"] for r in ok]
    decode = [r["decode_tps"] for r in ok if r.get("decode_tps")]
    return {"n": n, "completed": len(ok), "failed": n - len(ok),
            "per_stream_decode_tps_p50": statistics.median(decode) if decode else None,
            "aggregate_tps": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None, "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "wall_s": wall, "errors": sorted({r["error"] for r in results.values() if "error" in r})[:5]}


def combine(runs: list[dict]) -> dict:
    """Several rounds of one N on one server: each figure's median, failures summed, every round kept."""
    figures = ("per_stream_decode_tps_p50", "aggregate_tps", "ttft_p50_s", "ttft_p99_s", "wall_s")
    out = {"n": runs[0]["n"], "rounds": len(runs), "completed": sum(r["completed"] for r in runs),
           "failed": sum(r["failed"] for r in runs),
           "errors": sorted({e for r in runs for e in r["errors"]})[:5]}
    for key in figures:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["each_round"] = [{k: r[k] for k in ("aggregate_tps", "ttft_p50_s", "failed")} for r in runs]
    return out


def main() -> None:
    """Start both servers, run every N against each, print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--n", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--control", action="store_true", help="a second mlx_lm.server, as a control")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()
    counts = [int(n) for n in args.n.split(",")]
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "max_tokens": args.max_tokens, "command": " ".join(sys.argv)}
    redis_url, redis_proc = start_redis()
    servers = []
    try:
        model_dir = same_weights_everywhere(args.model)
        direct = Direct(model_dir)
        direct.decode(16)  # warm-up
        direct_runs = []
        servers = [start_mlxq(model_dir, redis_url), start_mlx_lm_server(model_dir)]
        if args.control:
            servers.append(start_mlx_lm_server(model_dir, "mlx_lm_server_2"))
        for n in counts:
            for server in servers:
                round_of(server, n, 16)  # this N's batch shapes, compiled before they are timed
            rounds: dict[str, list] = {server.name: [] for server in servers}
            for r in range(args.rounds):
                if n == 1:
                    direct_runs.append(direct.decode(args.max_tokens))
                for server in servers[r % len(servers):] + servers[:r % len(servers)]:  # rotating order
                    rounds[server.name].append(round_of(server, n, args.max_tokens))
            for name, runs in rounds.items():
                report.setdefault(name, {})[str(n)] = combine(runs)
        report["direct_decode_tps"] = statistics.median(direct_runs) if direct_runs else None
    finally:
        for server in servers:
            server.close()
        redis_proc.stop()
    for name in ("mlxq", "mlx_lm_server", "mlx_lm_server_2"):
        single = report.get(name, {}).get("1", {}).get("per_stream_decode_tps_p50")
        if single and report.get("direct_decode_tps"):
            report[f"{name}_single_stream_decode_vs_direct"] = single / report["direct_decode_tps"]
    write_report(report, args.out)


if __name__ == "__main__":
    main()
