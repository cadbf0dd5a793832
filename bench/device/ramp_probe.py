"""Where a burst's time to first token goes: N streamed chats at once through mlxq, each split at the web tier's
enqueue and the worker's start (both from the RQ job), per web-process count.

    python bench/device/ramp_probe.py --model DIR [--n 64] [--rounds 3] [--web-workers 2,4] [--max-tokens 32]

Per request: `web` = sent → enqueued (client, HTTP, validation, enqueue), `queue` = enqueued → started by the
worker, `first` = started → first content chunk at the client (preparing, the prompt turn, the first token's
publish and relay). Per round: the spread of the enqueues and of the starts (last − first), the starts' groups
(the worker's looks), the TTFT p50 / max. A probe, not a figure to publish: it says which part to shorten.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402
from rq.job import Job  # noqa: E402

from bench.bench_concurrency import messages  # noqa: E402
from bench.bench_text import start_mlxq  # noqa: E402
from bench.common import KeepAliveClient, cpu_seconds, start_redis  # noqa: E402


def one(base: str, index: int, max_tokens: int, tag: str, out: dict) -> None:
    """Stream one greedy chat; record when it was sent, its job id and its first content chunk (wall clock)."""
    client = KeepAliveClient(base, timeout=600)
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": f"[{tag}] " + messages(index)[0]["content"]}]}
    sent, first, job = time.time(), None, None
    try:
        for line in client.stream_lines("/v1/chat/completions", body):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            job = job or chunk.get("id")
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.time()
        out[index] = {"sent": sent, "first": first, "job": job, "end": time.time()}
    except Exception as exc:  # noqa: BLE001
        out[index] = {"sent": sent, "error": repr(exc)[:200]}
    finally:
        client.close()


def burst(server, conn: redis.Redis, n: int, max_tokens: int, tag: str) -> dict:
    """One burst of N chats; its per-part figures (ms)."""
    out: dict[int, dict] = {}
    cpu = {p.name: cpu_seconds(p.process.pid) for p in server.procs}
    t0 = time.time()
    threads = [threading.Thread(target=one, args=(server.base, i, max_tokens, tag, out)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    wall = max(r.get("end", t0) for r in out.values()) - t0
    cpu = {p.name: round((cpu_seconds(p.process.pid) - cpu[p.name]) / wall, 2) for p in server.procs}
    ok = [r for r in out.values() if r.get("first") and r.get("job")]
    jobs = Job.fetch_many([r["job"] for r in ok], connection=conn)
    rows = []
    for r, job in zip(ok, jobs, strict=True):
        if job is None or job.enqueued_at is None or job.started_at is None:
            continue
        rows.append({"sent": r["sent"] - t0, "enq": _epoch(job.enqueued_at) - t0, "start": _epoch(job.started_at) - t0,
                     "first": r["first"] - t0})

    starts = _clusters([r["start"] for r in rows])  # the worker's looks

    def ms(values: list[float]) -> dict:
        return {"p50": round(1000 * statistics.median(values), 1), "max": round(1000 * max(values), 1)} if values else {}

    return {"n": n, "ok": len(ok), "timed": len(rows), "wall_s": round(wall, 3), "cpu_per_wall": cpu,
            "sent_last_ms": round(1000 * max(r["sent"] for r in rows), 1) if rows else None,
            "web": ms([r["enq"] - r["sent"] for r in rows]), "queue": ms([r["start"] - r["enq"] for r in rows]),
            "first": ms([r["first"] - r["start"] for r in rows]), "ttft": ms([r["first"] - r["sent"] for r in rows]),
            "enqueued_spread_ms": round(1000 * (max(r["enq"] for r in rows) - min(r["enq"] for r in rows)), 1)
            if rows else None,
            "start_groups": [len(group) for group in starts],
            "start_group_at_ms": [round(1000 * min(group), 1) for group in starts],
            "enqueued_by_ms": {f"{b}": sum(r["enq"] <= b / 1000 for r in rows) for b in (10, 25, 50, 100, 200)},
            "errors": sorted({r["error"] for r in out.values() if "error" in r})[:3]}


def _epoch(at: datetime) -> float:
    """RQ's timestamps (naive UTC) as seconds since the epoch."""
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()


def _clusters(times: list[float], gap_s: float = 0.003) -> list[list[float]]:
    """`times` in clusters whose neighbours are within `gap_s` (the worker's looks, for start times)."""
    out, last = [], None
    for t in sorted(times):
        if last is None or t - last > gap_s:
            out.append([])
        out[-1].append(t)
        last = t
    return out


def main() -> None:
    """Start mlxq per web-process count; warm it; run the bursts; print a JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--web-workers", default="2,4")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    redis_url, redis_proc = start_redis()
    report = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": {}}
    try:
        for db, count in enumerate(int(c) for c in args.web_workers.split(",")):
            url = f"{redis_url.rsplit('/', 1)[0]}/{db}"
            server = start_mlxq(args.model, url, f"ramp{count}", worker_env={"MLXQ_LOG_LEVEL": "DEBUG"},
                                web_workers=count)
            conn = redis.Redis.from_url(url)
            try:
                for warm in range(2):
                    burst(server, conn, args.n, args.max_tokens, f"warm{warm}-{count}")
                report["runs"][f"web{count}"] = [burst(server, conn, args.n, args.max_tokens, f"r{r}-{count}")
                                                 for r in range(args.rounds)]
            finally:
                server.close()
    finally:
        redis_proc.stop()
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
