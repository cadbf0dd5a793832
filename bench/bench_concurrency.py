"""Concurrency benchmark: N streaming chats at once, mlxq vs mlx_lm.server vs the engine, one run.

For each N, workload and contestant, N requests of `--max-tokens` tokens, each with a prompt of its
own, all start together; each round's prompts are new (as users' chats are: a prompt cache has not seen
them), or with `--repeat-prompts` the same every round (a round of prompt-cache hits). Workloads (`--workloads`, default all three), side by side in the report:
greedy (temperature 0); sampled (temperature `--temperature`, nothing else); mixed (request i takes
the i-th of MIX in turn: greedy, temperature 1, top_p, top_k, a repetition and a presence penalty,
a seed). Contestants: mlxq and mlx_lm.server over HTTP (streaming chats, one body for both), and
with `--direct` (the default) mlx-lm's BatchGenerator in this process: the same prompts through the
chat template, all N inserted at once, ONE sampler shared by every row (greedy; the workload's
temperature; for mixed temperature 0.7 with top_p 0.9): the engine's ceiling, no server around it.
It runs no stop tokens, so each of its rows gives exactly `--max-tokens` tokens.

Reported per workload, N and contestant: aggregate tokens/s (every request's completion tokens
over the wall time from the first request, or insert, to the last token), time to first token
p50/p99, and failed requests (an HTTP error, a dropped connection or a stream that ended without
its last chunk), each the median of `--rounds` rounds (failures: the sum), and for the servers each
process's CPU seconds per second of the round (Linux: a process near 1.0 per core it can use is the
limit); then the ratios of
issue 31: mlxq sampled and mixed ÷ mlxq greedy, and mlxq ÷ mlx_lm.server and ÷ direct per workload.
Rounds alternate: within a round every workload runs on every contestant in turn (rotating order),
one at a time, so none shares the machine with another's work and drift moves all alike; the
direct engine's KV caches are freed after each of its rounds. Before its rounds, each N and
workload runs once unmeasured on every contestant (16 to 23 tokens a request, so rows also leave mid-batch):
MLX compiles kernels for each new batch shape and kind of work the first time it meets it (up to
seconds on CUDA), a cost a running service pays once. `--breakdown` adds mlxq's worker's
milliseconds per step by part (the engine's step, publishing, admission...) to each round.
Direct mlx-lm's single-stream decode is measured beside each N = 1 round, for the N = 1 ratio.

With `--control` a second mlx_lm.server runs beside the first: how far two identical servers come
apart in one run is how finely the run resolves a difference between mlxq and mlx_lm.server.

    python bench/bench_concurrency.py --model DIR [--n 1,8,32,64] [--max-tokens 128] [--rounds 3]
        [--workloads greedy,sampled,mixed] [--temperature 0.7] [--no-direct] [--control] [--repeat-prompts]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench.bench_text import (  # noqa: E402
    Direct,
    mlxq_name,
    other_mlxq_settings,
    reexec_with_worker_blas,
    same_weights_everywhere,
    start_mlx_lm_server,
    start_mlxq,
)
from bench.common import KeepAliveClient, cpu_seconds, percentile, start_redis, write_report  # noqa: E402
from mlxq.cli import default_web_workers  # noqa: E402

TOPICS = ["a lighthouse", "a dragon", "the sea", "a city at night", "an old map", "a garden", "a river", "a train"]
WORKLOADS = ("greedy", "sampled", "mixed")
MIX = ({"temperature": 0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
       {"temperature": 0.8, "top_k": 40}, {"temperature": 0.9, "repetition_penalty": 1.1},
       {"temperature": 1.0, "presence_penalty": 0.5}, {"temperature": 0.8, "seed": None})
"""The mixed workload's requests in turn; temperature 1.0 alone is OpenAI's and Anthropic's default.
The seeded one's seed is its request's index. mlx_lm.server reads every one of these fields."""
MLX_LM_SERVER_NOTES = [
    "mlx_lm.server serves a seeded request outside its batch: it lets the running batch finish, "
    "then runs the seeded request alone (server.py _is_batchable: args.seed is None).",
    "mlx_lm.server's repetition and presence penalties look at the last 20 tokens "
    "(repetition_context_size, presence_context_size); mlxq's presence penalty counts the whole answer.",
    "mlx_lm.server decodes at most --decode-concurrency (default 32) requests at once; the rest wait.",
]


ROUNDS = itertools.count()
ROUND_TAG = ""
"""The round's mark in every prompt (`--repeat-prompts`: none): users send new chats, so each round's prompts are
new to the servers' prompt caches; the same prompts every round measure a round of cache hits instead."""


def messages(index: int) -> list[dict]:
    """Request `index`'s chat: a prompt of its own (in this round)."""
    return [{"role": "user", "content": f"Request {index}{ROUND_TAG}: write a long story about "
                                        f"{TOPICS[index % len(TOPICS)]}, number {index}."}]


REPEAT_PROMPTS = False
"""Whether every round sends the same prompts (`--repeat-prompts`)."""

SAMPLED_TOP_P = 1.0
"""The sampled workload's top_p (`--top-p`; 1: none)."""


def sampling_fields(workload: str, index: int, temperature: float) -> dict:
    """The sampling fields of request `index` in a workload (the same for mlxq and mlx_lm.server)."""
    if workload == "greedy":
        return {"temperature": 0}
    if workload == "sampled":
        return {"temperature": temperature, **({"top_p": SAMPLED_TOP_P} if SAMPLED_TOP_P < 1 else {})}
    fields = dict(MIX[index % len(MIX)])
    if "seed" in fields:
        fields["seed"] = index
    return fields


def one_stream(base: str, model: str, index: int, fields: dict, max_tokens: int, started: float, out: dict) -> None:
    """Stream one chat; record its time to first token, completion tokens and end (or its failure)."""
    client = KeepAliveClient(base, timeout=600)
    body = {"model": model, "max_tokens": max_tokens, **fields, "stream": True,
            "stream_options": {"include_usage": True}, "messages": messages(index)}
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


WATCHED: dict[str, int] = {}
"""Processes whose CPU time each round reports beside the servers' own (name -> pid): the shared Redis."""


def cpu_now(server) -> dict[str, float]:
    """CPU seconds used so far by each of the server's processes (with their children), the shared Redis
    and this benchmark's process (its client threads)."""
    used = {proc.name: cpu_seconds(proc.process.pid) for proc in server.procs}
    used.update({name: cpu_seconds(pid) for name, pid in WATCHED.items()})
    times = os.times()
    used["client"] = times.user + times.system
    return used


def round_of(server, workload: str, n: int, max_tokens: int, temperature: float, stagger: int = 0) -> dict:
    """N streams of one workload at once against one server; its aggregate figures, and the CPU seconds
    each process used during the round (a process near 1 s per second of wall time is the limit). With
    `stagger`, request i asks for `max_tokens + i % stagger` tokens: rows leave the batch at different steps."""
    results: dict[int, dict] = {}
    worker_log = next((proc.log for proc in server.procs if proc.name.endswith("worker")), None)
    log_from = worker_log.stat().st_size if BREAKDOWN and worker_log is not None else 0
    cpu_before = cpu_now(server)
    started = time.perf_counter()
    threads = [threading.Thread(target=one_stream, args=(server.base, server.model, i,
                                                         sampling_fields(workload, i, temperature),
                                                         max_tokens + (i % stagger if stagger else 0), started,
                                                         results))
               for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    out = figures(n, started, results)
    if BREAKDOWN and worker_log is not None:
        out["worker_ms_per_step"] = worker_breakdown(worker_log, log_from)
    cpu_after = cpu_now(server)
    out["cpu_per_wall"] = {name: (cpu_after[name] - cpu_before[name]) / out["wall_s"] if out["wall_s"] > 0 else None
                           for name in cpu_before}
    return out


BREAKDOWN = False
"""`--breakdown`: mlxq's workers log at DEBUG level, and each round reports where its worker's steps went."""

SPENT = re.compile(r"the loop over [\d.]+ s(?: \(until idle\))?: (\d+) batch steps of ([\d.]+) sequences on average; ms per step: (.*)$")


def worker_breakdown(log: Path, offset: int, wait_s: float = 5.0) -> dict | None:
    """Milliseconds per batch step by part (workers/scheduler.py's DEBUG summaries: the engine's step, publishing,
    admission...) over the worker's summaries logged since `offset`, weighted by their steps; `sequences` the
    average batch. The worker logs one when its last request ends, a moment after the client's last token."""
    deadline = time.monotonic() + wait_s
    while True:
        with open(log, "rb") as f:
            f.seek(offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
        found = [m for m in map(SPENT.search, lines) if m]
        if any("(until idle)" in m.group(0) for m in found) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    steps, total, rows = 0, {}, 0.0
    for m in found:
        n = int(m.group(1))
        steps += n
        rows += n * float(m.group(2))
        for part in m.group(3).split(", "):
            name, ms = part.rsplit(" ", 1)
            total[name] = total.get(name, 0.0) + n * float(ms)
    if not steps:
        return None
    return {"steps": steps, "sequences": round(rows / steps, 1), **{k: round(v / steps, 3) for k, v in total.items()}}


def figures(n: int, started: float, results: dict[int, dict]) -> dict:
    """A round's aggregate figures from each request's result (ok, ttft, tokens, end, decode_tps)."""
    ok = [r for r in results.values() if r["ok"]]
    wall = max((r["end"] for r in results.values()), default=started) - started
    ttfts = [r["ttft"] for r in ok]
    decode = [r["decode_tps"] for r in ok if r.get("decode_tps")]
    return {"n": n, "completed": len(ok), "failed": n - len(ok),
            "per_stream_decode_tps_p50": statistics.median(decode) if decode else None,
            "aggregate_tps": sum(r["tokens"] for r in ok) / wall if wall > 0 else 0.0,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None, "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "wall_s": wall, "errors": sorted({r["error"] for r in results.values() if "error" in r})[:5]}


class DirectBatch:
    """mlx-lm's BatchGenerator driven in this process, one sampler shared by every row: the engine's ceiling."""

    name = "direct"

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    def round(self, workload: str, n: int, max_tokens: int, temperature: float) -> dict:
        """N sequences inserted at once, decoded to max_tokens each; the same figures as a server's round."""
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator

        prompts = [self.tokenizer.apply_chat_template(messages(i), add_generation_prompt=True) for i in range(n)]
        # Every row decodes in one batch and prefills in one: nothing of the engine waits its turn.
        generator = BatchGenerator(self.model, max_tokens=max_tokens, sampler=shared_sampler(workload, temperature),
                                   completion_batch_size=n, prefill_batch_size=n)
        try:
            started = time.perf_counter()
            results = self._decode(generator, generator.insert(prompts, [max_tokens] * n), started)
        finally:
            generator.close()
            del generator
            mx.clear_cache()  # its KV caches go back before a server's round
        return figures(n, started, results)

    @staticmethod
    def _decode(generator, uids: list[int], started: float) -> dict[int, dict]:
        """Step the generator until every sequence has finished; each one's result, as one_stream records it."""
        first: dict[int, float] = {}
        tokens = dict.fromkeys(uids, 0)
        results: dict[int, dict] = {}
        step = getattr(generator, "next_generated", generator.next)  # an older mlx-lm's next() gives the tokens
        while len(results) < len(uids):
            responses = step()
            if not responses:
                raise RuntimeError(f"the generator stopped with {len(uids) - len(results)} sequences unfinished")
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                tokens[r.uid] += 1
                if r.finish_reason is not None:
                    results[r.uid] = {"ok": True, "ttft": first[r.uid] - started, "tokens": tokens[r.uid], "end": now,
                                      "decode_tps": (tokens[r.uid] - 1) / (now - first[r.uid])
                                      if tokens[r.uid] > 1 and now > first[r.uid] else None}
        return results


def shared_sampler(workload: str, temperature: float):
    """The one sampler of the direct engine's rows: greedy (mlx-lm's default), the workload's temperature,
    or for mixed temperature 0.7 with top_p 0.9."""
    from mlx_lm.sample_utils import make_sampler

    if workload == "greedy":
        return None
    if workload == "sampled":
        return make_sampler(temp=temperature, top_p=SAMPLED_TOP_P if SAMPLED_TOP_P < 1 else 0.0)
    return make_sampler(temp=0.7, top_p=0.9)


def run_round(contestant, workload: str, n: int, max_tokens: int, temperature: float, stagger: int = 0) -> dict:
    """One round of a workload on a server (over HTTP, `stagger`: round_of's) or on the direct engine."""
    global ROUND_TAG
    if not REPEAT_PROMPTS:
        ROUND_TAG = f" of round {next(ROUNDS)}"
    if isinstance(contestant, DirectBatch):
        return contestant.round(workload, n, max_tokens, temperature)
    return round_of(contestant, workload, n, max_tokens, temperature, stagger)


def combine(runs: list[dict]) -> dict:
    """Several rounds of one N on one contestant: each figure's median, failures summed, every round kept."""
    keys = ("per_stream_decode_tps_p50", "aggregate_tps", "ttft_p50_s", "ttft_p99_s", "wall_s")
    out = {"n": runs[0]["n"], "rounds": len(runs), "completed": sum(r["completed"] for r in runs),
           "failed": sum(r["failed"] for r in runs),
           "errors": sorted({e for r in runs for e in r["errors"]})[:5]}
    for key in keys:
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    cpu = [r["cpu_per_wall"] for r in runs if r.get("cpu_per_wall")]
    if cpu:  # a server's rounds: each process's CPU seconds per second of the round
        out["cpu_per_wall"] = {name: statistics.median(c[name] for c in cpu if c.get(name) is not None)
                               for name in cpu[0]}
    out["each_round"] = [{k: r[k] for k in ("aggregate_tps", "ttft_p50_s", "failed")} for r in runs]
    parts = [r["worker_ms_per_step"] for r in runs if r.get("worker_ms_per_step")]
    if parts:  # --breakdown: each part's median over the rounds (a part missing from a round counts 0 there)
        names = {name for p in parts for name in p}
        out["worker_ms_per_step"] = {name: statistics.median(p.get(name, 0.0) for p in parts) for name in sorted(names)}
    return out


def ratios(results: dict) -> dict:
    """Issue 31's ratios of aggregate tokens/s per workload and N: mlxq ÷ mlxq greedy, ÷ mlx_lm.server, ÷ direct,
    each the ratio of the medians; and `paired`: the median of the round-by-round ratios (round r of one beside
    round r of the other, minutes apart at most), which a machine drifting between rounds moves less."""
    def of(workload: str, name: str, n: str) -> dict:
        return results.get(workload, {}).get(name, {}).get(n, {})

    out: dict[str, dict] = {}
    for workload, contestants in results.items():
        for n in contestants.get("mlxq", {}):
            mine = of(workload, "mlxq", n)
            row, paired = {}, {}
            for other, theirs in (("mlxq_greedy", of("greedy", "mlxq", n)),
                                  ("mlx_lm_server", of(workload, "mlx_lm_server", n)),
                                  ("direct", of(workload, "direct", n))):
                if other == "mlxq_greedy" and workload == "greedy":
                    continue
                a, b = mine.get("aggregate_tps"), theirs.get("aggregate_tps")
                row[f"mlxq_vs_{other}"] = a / b if a and b else None
                each = [x["aggregate_tps"] / y["aggregate_tps"] for x, y in
                        zip(mine.get("each_round", []), theirs.get("each_round", []), strict=False)
                        if x["aggregate_tps"] and y["aggregate_tps"]]
                paired[f"mlxq_vs_{other}"] = statistics.median(each) if each else None
            row["paired"] = paired
            out.setdefault(workload, {})[n] = row
    return out


def summary(report: dict) -> str:
    """The report as a table: per workload and N each contestant's tok/s, TTFT and failures, then the ratios."""
    def num(value, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [f"{'workload':9} {'N':>3} {'contestant':16} {'tok/s':>8} {'ttft p50':>9} {'ttft p99':>9} {'failed':>6}"
             "  rounds' tok/s"]
    for workload, contestants in report["results"].items():
        for n in next(iter(contestants.values()), {}):
            for name, by_n in contestants.items():
                c = by_n[n]
                lines.append(f"{workload:9} {n:>3} {name:16} {num(c['aggregate_tps']):>8} {num(c['ttft_p50_s'], 3):>9} "
                             f"{num(c['ttft_p99_s'], 3):>9} {c['failed']:>6}  "
                             f"{[round(x['aggregate_tps']) for x in c['each_round']]} {c['errors'][:1] or ''}")
                if c.get("worker_ms_per_step"):
                    lines.append(f"{'':9} {'':>3} {'':16} worker ms per step: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in sorted(c["worker_ms_per_step"].items(), key=lambda kv: -kv[1])))
                if c.get("cpu_per_wall"):
                    lines.append(f"{'':9} {'':>3} {'':16} CPU s per s: " + ", ".join(
                        f"{k.removeprefix(name + '-')} {num(v, 2)}" for k, v in c["cpu_per_wall"].items()))
            ratios_n = dict(report["ratios"].get(workload, {}).get(n, {}))
            paired = ratios_n.pop("paired", {})
            lines.append(f"{'':9} {n:>3} mlxq ÷ " + ", ".join(f"{k.removeprefix('mlxq_vs_')} {num(v, 2)}"
                                                            for k, v in ratios_n.items())
                         + "; paired by round: " + ", ".join(f"{k.removeprefix('mlxq_vs_')} {num(v, 2)}"
                                                             for k, v in paired.items()))
    if report.get("direct_decode_tps"):  # measured at N = 1 only
        lines.append(f"direct single-stream decode {num(report['direct_decode_tps'], 1)} tok/s; "
                     + ", ".join(f"{k} {v:.3f}" for k, v in report.items() if k.endswith("_vs_direct")))
    lines.extend(f"note: {note}" for note in report.get("mlx_lm_server_notes", []))
    return "\n".join(lines)


def measure(contestants: list, workloads: list[str], counts: list[int], args, single: Direct) -> tuple[dict, list]:
    """Every N, workload and contestant: a warm-up round each, then the rounds; results and N = 1 direct decodes."""
    results: dict[str, dict] = {w: {} for w in workloads}
    single_runs = []
    for n in counts:
        for workload in workloads:
            for c in contestants:
                # This N's batch shapes, compiled before they are timed, and rows leaving a batch mid-way (the cut of its
                # caches): on a fresh CUDA machine each first sight of such work stalled a measured round for seconds.
                run_round(c, workload, n, 16, args.temperature, stagger=8)
        rounds = {(w, c.name): [] for w in workloads for c in contestants}
        for r in range(args.rounds):
            if n == 1:
                single_runs.append(single.decode(args.max_tokens))
            for workload in workloads[r % len(workloads):] + workloads[:r % len(workloads)]:  # rotating orders
                for c in contestants[r % len(contestants):] + contestants[:r % len(contestants)]:
                    rounds[workload, c.name].append(run_round(c, workload, n, args.max_tokens, args.temperature))
        for (workload, name), runs in rounds.items():
            results[workload].setdefault(name, {})[str(n)] = combine(runs)
        if args.out:  # what is measured so far, should a later N run out of time
            args.out.with_suffix(".partial.json").write_text(json.dumps(results, indent=1))
        if args.profile:
            for workload in workloads:
                profiled_round(contestants[0], workload, n, args)
    return results, single_runs


def profiled_round(server, workload: str, n: int, args) -> None:
    """Two more rounds on mlxq, unmeasured, with py-spy sampling its worker (every thread; native frames
    with `--profile-native`): args.profile/worker-WORKLOAD-N.txt holds the collapsed stacks (`frames count` per line)."""
    import subprocess

    args.profile.mkdir(parents=True, exist_ok=True)
    worker = next(proc for proc in server.procs if proc.name.endswith("worker"))
    out = args.profile / f"worker-{workload}-{n}.txt"
    spy = subprocess.Popen(["py-spy", "record", "--pid", str(worker.process.pid), "--rate", "200", "--threads",
                            "--format", "raw", "--output", str(out), *(["--native"] if args.profile_native else []),
                            *(["--idle"] if args.profile_idle else [])], stdout=subprocess.DEVNULL,
                           stderr=subprocess.STDOUT)
    time.sleep(1.0)  # py-spy attaches
    try:
        for _ in range(2):
            run_round(server, workload, n, args.max_tokens, args.temperature)
    finally:
        spy.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        spy.wait(60)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--n", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="any of greedy,sampled,mixed")
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled workload's temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="the sampled workload's top_p (1: none)")
    parser.add_argument("--direct", action=argparse.BooleanOptionalAction, default=True,
                        help="mlx-lm's BatchGenerator in this process, one shared sampler (the engine's ceiling)")
    parser.add_argument("--control", action="store_true", help="a second mlx_lm.server, as a control")
    parser.add_argument("--server", action=argparse.BooleanOptionalAction, default=True,
                        help="mlx_lm.server as a contestant (--no-server: mlxq against itself and the engine only)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                        help="also run another mlxq with these environment settings (repeatable), e.g. "
                             "PYTHONPATH=OLD_CHECKOUT for before against after in one run")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="after each N's rounds, two more (unmeasured) on mlxq per workload with py-spy on its worker")
    parser.add_argument("--profile-native", action="store_true",
                        help="with --profile, native frames too (MLX's C++: slows the worker several times over)")
    parser.add_argument("--profile-idle", action="store_true",
                        help="with --profile, keep idle samples too (a thread waiting for Redis, the GIL or the device)")
    parser.add_argument("--web-workers", type=int, default=default_web_workers(),
                        help="mlxq's gunicorn processes (default: `mlxq up`'s, half the cores, 2 to 8)")
    parser.add_argument("--repeat-prompts", action="store_true",
                        help="the same prompts every round (prompt-cache hits after the first); default: new ones each round")
    parser.add_argument("--breakdown", action="store_true",
                        help="mlxq's workers log at DEBUG level; each round reports its worker's milliseconds per step "
                             "by part (the engine, publishing, admission...)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.also_stream_interval_ms = None  # (bench_text's shorthand, read by other_mlxq_settings)
    global SAMPLED_TOP_P, REPEAT_PROMPTS, BREAKDOWN
    SAMPLED_TOP_P, REPEAT_PROMPTS, BREAKDOWN = args.top_p, args.repeat_prompts, args.breakdown
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(sorted(unknown))} (choose from {', '.join(WORKLOADS)})")
    return args


def main() -> None:
    """Start both servers, run every N and workload against each contestant, print the report."""
    args = parse_args()
    reexec_with_worker_blas()
    counts = [int(n) for n in args.n.split(",")]
    workloads = args.workloads.split(",")
    report = {"machine": platform.node(), "platform": platform.platform(), "date": time.strftime("%Y-%m-%d %H:%M"),
              "model": str(args.model), "max_tokens": args.max_tokens, "temperature": args.temperature,
              "workloads": workloads, "mix": [sampling_fields("mixed", i, args.temperature) for i in range(len(MIX))],
              "direct_sampler": {"greedy": "greedy", "sampled": f"temperature {args.temperature}",
                                 "mixed": "temperature 0.7, top_p 0.9"} if args.direct else None,
              "mlx_lm_server_notes": MLX_LM_SERVER_NOTES, "command": " ".join(sys.argv)}
    redis_url, redis_proc = start_redis()
    servers = []
    try:
        model_dir = same_weights_everywhere(args.model)
        single = Direct(model_dir)
        single.decode(16)  # warm-up
        WATCHED["redis"] = redis_proc.process.pid
        debug = {"MLXQ_LOG_LEVEL": "DEBUG"} if args.breakdown else None
        servers = [start_mlxq(model_dir, redis_url, worker_env=debug, web_workers=args.web_workers)]
        for db, env in enumerate(other_mlxq_settings(args), start=1):
            # Its own Redis database: two workers on one queue would take each other's jobs.
            servers.append(start_mlxq(model_dir, f"{redis_url.rsplit('/', 1)[0]}/{db}", mlxq_name(env), env,
                                      worker_env=debug, web_workers=args.web_workers))
        if args.server:
            servers.append(start_mlx_lm_server(model_dir))
        if args.control:
            servers.append(start_mlx_lm_server(model_dir, "mlx_lm_server_2"))
        contestants = servers + ([DirectBatch(single.model, single.tokenizer)] if args.direct else [])
        report["results"], single_runs = measure(contestants, workloads, counts, args, single)
    finally:
        for server in servers:
            server.close()
        redis_proc.stop()
    report["ratios"] = ratios(report["results"])
    report["direct_decode_tps"] = statistics.median(single_runs) if single_runs else None
    greedy = report["results"].get("greedy", {})  # the single-stream decode is greedy
    for name in ("mlxq", "mlx_lm_server", "mlx_lm_server_2"):
        one = greedy.get(name, {}).get("1", {}).get("per_stream_decode_tps_p50")
        if one and report.get("direct_decode_tps"):
            report[f"{name}_single_stream_decode_vs_direct"] = one / report["direct_decode_tps"]
    write_report(report, args.out)


if __name__ == "__main__":
    main()
