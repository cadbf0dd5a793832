"""Where the added latency of a 1-token chat goes: timestamps through web, Redis, RQ and the worker.

Starts mlxq (gunicorn+gevent and the worker) with bench/trace/ on PYTHONPATH, whose hooks append
`job stage time` lines per process, sends N isolated 1-token chats (a pause before each, as the
benchmark's alternating pattern does), and prints the median time between consecutive stages.

    python bench/trace_text.py --model DIR [--n 150] [--gap-ms 20]

A diagnostic, not a benchmark: the hooks themselves cost a few microseconds per stage.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import PROMPT, HTTPServer, start_mlxq  # noqa: E402
from bench.common import percentile, start_redis  # noqa: E402

SPANS = [
    ("HTTP in", "client_send", "web_request_in"),
    ("parse, validate, resolve", "web_request_in", "web_enqueue_start"),
    ("RQ builds the job", "web_enqueue_start", "web_job_built"),
    ("to the worker (EXEC, BLPOP and claim)", "web_job_built", "wk_dequeued"),
    ("RQ prepares the job", "wk_dequeued", "wk_prepared"),
    ("RQ calls the function", "wk_prepared", "wk_job_function"),
    ("job set-up", "wk_job_function", "wk_generate"),
    ("generation (as direct)", "wk_generate", "wk_publish_answer"),
    ("publish, pub/sub to web", "wk_publish_answer", "web_got_done"),
    ("response built", "web_got_done", "web_response_ready"),
    ("HTTP out", "web_response_ready", "client_received"),
]
"""The critical path of a call, span by span: together they make up the whole call."""
SIDE_SPANS = [("web's enqueue transaction", "web_job_built", "web_enqueue_done"),
              ("worker's publish call", "wk_publish_answer", "wk_published")]
"""Spans that overlap the critical path."""
SUB_SPANS = [("to the worker: EXEC, BLPOP and claim", "web_job_built", "wk_claimed"),
             ("to the worker: RQ's dequeue", "wk_claimed", "wk_dequeued"),
             ("back: publish to the pub/sub reader", "wk_publish_answer", "web_hub_got"),
             ("back: pub/sub reader to the request", "web_hub_got", "web_got_done")]
"""The parts of two spans of the critical path (to the worker, and publish to the web)."""


def start_traced_mlxq(model_dir: Path, redis_url: str, trace_dir: Path) -> HTTPServer:
    """Start mlxq (bench_text's start_mlxq) with the hooks of bench/trace/ loaded in web and worker."""
    hooks = REPO / "bench" / "trace"
    env = {"MLXQ_TRACE_DIR": str(trace_dir), "GUNICORN_CMD_ARGS": f"-c {hooks / 'gunicorn_conf.py'}",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(hooks), os.environ.get("PYTHONPATH", "")])}
    return start_mlxq(model_dir, redis_url, "trace", env, worker_env={"MLXQ_TRACE_ROLE": "worker"})


def read_traces(trace_dir: Path) -> dict[str, dict[str, float]]:
    """Every job's first time at each stage, from all processes' trace files."""
    seen: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for path in trace_dir.glob("trace-*.txt"):
        for line in path.read_text().splitlines():
            job_id, stage, moment = line.split()
            seen[job_id].setdefault(stage, float(moment))
    return seen


def main() -> None:
    """Trace N calls and print the median milliseconds between consecutive stages."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--n", type=int, default=150)
    parser.add_argument("--gap-ms", type=float, default=20.0)
    args = parser.parse_args()
    trace_dir = Path(tempfile.mkdtemp(prefix="mlxq-trace-"))
    redis_url, redis_proc = start_redis()
    server = None
    try:
        server = start_traced_mlxq(args.model, redis_url, trace_dir)
        body = {"model": "bench", "messages": PROMPT, "max_tokens": 1, "temperature": 0}
        for _ in range(10):  # warm-up, not traced below
            server.client.post_json("/v1/chat/completions", body)
        traced = []
        for _ in range(args.n):
            time.sleep(args.gap_ms / 1000)
            sent = time.time()
            answer = server.client.post_json("/v1/chat/completions", body)
            received = time.time()
            traced.append((answer["id"], sent, received))
    finally:
        if server is not None:
            server.close()
        redis_proc.stop()
    stages = read_traces(trace_dir)
    rows = []
    for job_id, sent, received in traced:
        row = {**stages.get(job_id, {}), "client_send": sent, "client_received": received}
        if all(stage in row for _, start, end in SPANS + SIDE_SPANS + SUB_SPANS for stage in (start, end)):
            rows.append(row)
    print(f"{len(rows)} of {len(traced)} calls traced completely; ms: median (p10, p90)")
    for label, start, end in SPANS + [("whole call", "client_send", "client_received")] + SIDE_SPANS + SUB_SPANS:
        gaps = [(row[end] - row[start]) * 1000 for row in rows]
        print(f"  {label:<38} {statistics.median(gaps):7.3f}  ({percentile(gaps, 10):7.3f}, {percentile(gaps, 90):7.3f})")

if __name__ == "__main__":
    main()
