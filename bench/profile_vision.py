"""Where an image request's time goes: py-spy (native frames too) on mlxq's worker, then on mlx-vlm
called directly, each while it answers the same requests one after another.

    python bench/profile_vision.py --model DIR --image PNG --out OUT [--requests 15]

Writes OUT/worker.txt and OUT/direct.txt (py-spy's collapsed stacks: `frames count` per line) and
OUT/times.json (each contestant's request times while profiled and not). Needs py-spy on PATH and
permission to attach (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import start_mlxq  # noqa: E402
from bench.bench_vision import Direct, VisionServer, same_weights_everywhere  # noqa: E402
from bench.common import start_redis  # noqa: E402


def profiled(contestant, pid: int, out: Path, requests: int, tokens: int) -> list[float]:
    """Request times of `contestant` while py-spy samples process `pid` into `out`."""
    spy = subprocess.Popen(["py-spy", "record", "--native", "--rate", "100", "--format", "raw",
                            "--pid", str(pid), "--output", str(out)], stdout=subprocess.DEVNULL)
    time.sleep(2)  # attached
    times = [contestant.request(tokens) for _ in range(requests)]
    spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
    spy.wait(60)
    return times


def main() -> None:
    """Start mlxq and a direct caller, time each plain, then each under py-spy."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--image", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=15)
    parser.add_argument("--answer-tokens", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = same_weights_everywhere(args.model)
    redis_url, redis_proc = start_redis()
    mlxq = start_mlxq(model_dir, redis_url)
    try:
        direct = Direct(model_dir, args.image)
        server = VisionServer("mlxq", mlxq.base, mlxq.model, mlxq.procs, args.image)
        worker_pid = mlxq.procs[0].process.pid
        times = {"mlxq": [], "direct": []}
        for _ in range(3):  # warm both, then alternate plain timings
            server.request(args.answer_tokens), direct.request(args.answer_tokens)
        for _ in range(args.requests):
            times["mlxq"].append(server.request(args.answer_tokens))
            times["direct"].append(direct.request(args.answer_tokens))
        times["mlxq_profiled"] = profiled(server, worker_pid, args.out / "worker.txt", args.requests,
                                          args.answer_tokens)
        times["direct_profiled"] = profiled(direct, os.getpid(), args.out / "direct.txt", args.requests,
                                            args.answer_tokens)
    finally:
        mlxq.close()
        redis_proc.stop()
    report = {name: {"median_ms": 1000 * statistics.median(v), "runs_ms": [round(1000 * t, 1) for t in v]}
              for name, v in times.items()}
    (args.out / "times.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: round(v["median_ms"], 1) for k, v in report.items()}))


if __name__ == "__main__":
    main()
