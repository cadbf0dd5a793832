"""Decode speed under a JSON schema vs without one, through mlxq, same model, one run.

Streamed chats of `--max-tokens` tokens, greedy, alternating: free text, and the same question under a
`response_format` JSON schema whose one string field must be long (so both run to max_tokens).
Decode tokens/s is counted from the first content chunk to the last (wall clock), as a client sees it.

    python bench/bench_structured.py [--model DIR] [--rounds 5] [--max-tokens 128] [--breakdown] [--out r.json]

`--breakdown`: the worker's milliseconds per step by part for each run (bench_concurrency's), medians per format.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_concurrency import worker_breakdown  # noqa: E402
from bench.bench_text import reexec_with_worker_blas, start_mlxq  # noqa: E402
from bench.common import decode_rate, start_redis, write_report  # noqa: E402

QUESTION = [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]
STORY = {"type": "json_schema", "json_schema": {"name": "story", "strict": True, "schema": {
    "type": "object", "properties": {"story": {"type": "string", "minLength": 2000}}, "required": ["story"],
    "additionalProperties": False}}}


def decode(client, model: str, max_tokens: int, response_format: dict | None) -> tuple[float, int]:
    """(tokens/s from the first content chunk to the last, completion tokens) of one streamed chat."""
    body = {"model": model, "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"response_format": response_format} if response_format else {})}
    return decode_rate(client.stream_lines("/v1/chat/completions", body))


def main() -> None:
    """Start mlxq on the model, alternate free and constrained streams, print the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path.home() / ".cache/mlxq/models/smollm2-135m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--breakdown", action="store_true",
                        help="the worker logs at DEBUG level; each run reports its milliseconds per step by part")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()
    redis_url, redis_proc = start_redis()
    server = start_mlxq(args.model, redis_url, worker_env={"MLXQ_LOG_LEVEL": "DEBUG"} if args.breakdown else None)
    worker_log = next(proc.log for proc in server.procs if proc.name.endswith("worker"))
    runs = {"free": [], "json_schema": []}
    parts = {"free": [], "json_schema": []}
    try:
        for fmt in (None, STORY):  # warm both paths (the grammar's tokenizer view is built once per model)
            offset = worker_log.stat().st_size
            decode(server.client, server.model, 8, fmt)
            if args.breakdown:  # its summary is logged a moment after its last token: not the first run's
                worker_breakdown(worker_log, offset)
        for _ in range(args.rounds):
            for name, fmt in (("free", None), ("json_schema", STORY)):
                offset = worker_log.stat().st_size
                runs[name].append(decode(server.client, server.model, args.max_tokens, fmt))
                if args.breakdown:
                    parts[name].append(worker_breakdown(worker_log, offset))
    finally:
        for proc in server.procs:
            proc.stop()
        redis_proc.stop()
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "command": " ".join(sys.argv)}
    for name, samples in runs.items():
        report[name] = {"decode_tps_runs": [round(s, 2) for s, _ in samples], "tokens": [t for _, t in samples],
                        "decode_tps_p50": round(statistics.median(s for s, _ in samples), 2)}
        measured = [p for p in parts[name] if p]
        if measured:  # each part's median over the runs
            report[name]["worker_ms_per_step"] = {k: round(statistics.median(p.get(k, 0.0) for p in measured), 3)
                                                  for k in sorted({k for p in measured for k in p})}
    report["json_schema_vs_free"] = round(report["json_schema"]["decode_tps_p50"] / report["free"]["decode_tps_p50"], 3)
    write_report(report, args.out)


if __name__ == "__main__":
    main()
