"""Fair share on one worker: another key's chat while one key's backlog of async chats fills the batch (issue 37).

One service (a private Redis, the web tier, one worker) with two user keys and an admin key. Key B streams short
chats (`--tokens`, greedy) one after another, first with nothing else running (idle), then while key A's backlog of
`--backlog` async chats (`--backlog-tokens` each, temperature 1.0: the APIs' default) fills the worker's batch and
queue. Reported, idle and loaded: each chat's time to first token and whole time (the median and the best), the
loaded decode step (the median gap between B's streamed tokens), and the bound the issue sets, 2 × idle + one step.
Then B submits one async chat of `--tokens` tokens: how long it took to finish, and how many of A's jobs were still
queued then (fair share takes B's job at the next free place, not after A's backlog).

    python bench/bench_tenants.py --model DIR [--backlog 192] [--backlog-tokens 256] [--chats 5] [--tokens 32] [--out F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_gpus import SPEECH, TEXT, Stack, running  # noqa: E402
from bench.common import write_report  # noqa: E402

BULK, OTHER, ADMIN = "bench-key-a", "bench-key-b", "bench-key-admin"
ASK = [{"role": "user", "content": "Write a short poem about a river."}]


class TenantStack(Stack):
    """bench_gpus's stack with two user keys and an admin key."""

    def _env(self) -> dict:
        return {**super()._env(), "MLXQ_API_KEYS": f"{BULK},{OTHER}", "MLXQ_ADMIN_KEY": ADMIN}

    def states(self) -> list[dict]:
        return httpx.get(self.base + "/v1/admin/workers", timeout=10, headers=auth(ADMIN)).json()["data"]


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def stream_chat(base: str, tokens: int) -> dict:
    """One of key B's streamed chats: time to first token, whole time, gaps between its chunks with text."""
    body = {"model": TEXT, "messages": ASK, "max_tokens": tokens, "temperature": 0, "stream": True}
    began, arrivals = time.perf_counter(), []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=auth(OTHER), timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter() - began)
    total = time.perf_counter() - began
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_s": round(arrivals[0], 3) if arrivals else None, "total_s": round(total, 3),
            "gap_s": round(statistics.median(gaps), 4) if gaps else None}


def summary(runs: list[dict]) -> dict:
    """The chats' medians and bests."""
    def of(key: str) -> dict:
        values = [r[key] for r in runs if r[key] is not None]
        return {"median": round(statistics.median(values), 3), "best": round(min(values), 3)} if values else {}
    return {"ttft_s": of("ttft_s"), "total_s": of("total_s"), "gap_s": of("gap_s"), "runs": runs}


def in_hand(stack: Stack) -> int:
    """Jobs the workers hold now."""
    return sum(len(s.get("jobs", [])) for s in stack.states())


def queued(base: str) -> int:
    """Jobs waiting in the batch queue."""
    rows = httpx.get(base + "/v1/admin/queues", headers=auth(ADMIN), timeout=10).json()["data"]
    return sum(r["depth"] for r in rows if r["queue"].startswith("batch"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--device", default="0", help="CUDA_VISIBLE_DEVICES of the worker, or cpu")
    parser.add_argument("--backlog", type=int, default=192, help="key A's async chats")
    parser.add_argument("--backlog-tokens", type=int, default=256)
    parser.add_argument("--chats", type=int, default=5, help="key B's chats, idle and loaded")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--full", type=int, default=None, help="jobs in hand that mean a full batch "
                        "(default: 64 on a GPU, 16 on a CPU: MLXQ_MAX_BATCH's defaults)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    full = args.full or (16 if args.device == "cpu" else 64)
    stack = TenantStack("tenants", [args.device], {TEXT: args.model, SPEECH: args.model}, TEXT, 2)
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "command": " ".join(sys.argv), "args": {k: str(v) for k, v in vars(args).items()}}
    with running(stack):
        for _ in range(2):  # warm-up: the kernels of a one-row batch
            stream_chat(stack.base, args.tokens)
        report["idle"] = summary([stream_chat(stack.base, args.tokens) for _ in range(args.chats)])
        job = {"model": TEXT, "messages": ASK, "max_tokens": args.backlog_tokens, "temperature": 1.0}
        with httpx.Client(base_url=stack.base, headers=auth(BULK), timeout=60) as bulk, ThreadPoolExecutor(16) as pool:
            backlog = list(pool.map(lambda _: bulk.post("/v1/jobs/chat/completions", json=job).json()["id"],
                                    range(args.backlog)))
            began = time.monotonic()
            while in_hand(stack) < min(full, args.backlog) and time.monotonic() - began < 120:
                time.sleep(0.05)
            report["backlog"] = {"in_hand": in_hand(stack), "queued": queued(stack.base)}
            report["loaded"] = summary([stream_chat(stack.base, args.tokens) for _ in range(args.chats)])
            with httpx.Client(base_url=stack.base, headers=auth(OTHER), timeout=60) as other:
                sent = time.monotonic()
                mine = other.post("/v1/jobs/chat/completions",
                                  json={**job, "max_tokens": args.tokens, "temperature": 0}).json()["id"]
                while other.get(f"/v1/jobs/{mine}").json()["status"] not in ("succeeded", "failed", "canceled"):
                    time.sleep(0.05)
                report["async"] = {"done_s": round(time.monotonic() - sent, 3), "status":
                                   other.get(f"/v1/jobs/{mine}").json()["status"],
                                   "backlog_still_queued": queued(stack.base)}
            list(pool.map(lambda i: bulk.delete(f"/v1/jobs/{i}"), backlog))
    idle, loaded = report["idle"], report["loaded"]
    bound = 2 * idle["total_s"]["best"] + loaded["gap_s"]["median"]
    report["verdict"] = {"loaded_best_total_s": loaded["total_s"]["best"], "bound_s": round(bound, 3),
                         "within": loaded["total_s"]["best"] <= bound,
                         "ratio_total_median": round(loaded["total_s"]["median"] / idle["total_s"]["median"], 2),
                         "ratio_ttft_median": round(loaded["ttft_s"]["median"] / idle["ttft_s"]["median"], 2)}
    write_report(report, args.out)
    print(f"idle   ttft {idle['ttft_s']}  total {idle['total_s']}  step {idle['gap_s']}")
    print(f"loaded ttft {loaded['ttft_s']}  total {loaded['total_s']}  step {loaded['gap_s']}  "
          f"(backlog: {report['backlog']})")
    print(f"B's async chat: {report['async']}")
    print(f"verdict: {report['verdict']}")


if __name__ == "__main__":
    main()
