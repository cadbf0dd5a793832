"""Two GPUs, one MLX worker each: 64 chats on one worker against two, long transcriptions on both, a worker killed.

One run, three parts (`--parts`), each on a fresh private Redis, web tier (gunicorn, `--web-workers` processes,
as `mlxq up`) and workers: one `python -m workers.main` per device of `--gpus`, seeing only it
(CUDA_VISIBLE_DEVICES; `cpu` sets none: `--gpus cpu,cpu` is the smoke test of a machine without GPUs).

- `chats`: bench_concurrency's N-at-once case (`--chats` streaming chats of `--max-tokens` tokens, its prompts,
  new every round, and its workloads: greedy, sampled at `--temperature`, mixed, which has temperature 1.0
  among its requests) against ONE worker (the first device) and against a worker per device, each behind a web
  tier and Redis of its own. Both setups are up at once and measured interleaved (rotating order, one round at a
  time, the other setup idle), after a warm-up round of each workload on each. Per round: aggregate completion
  tokens/s (every request's tokens over the wall time from the first request sent to the last finished), TTFT
  p50/p95, failures, the requests and tokens each worker served (the RQ job's worker_name, read with RQ's JSON
  serializer: nothing over HTTP names a finished call's worker) and each process's CPU seconds per second; per
  workload, all workers ÷ one (the rounds' medians, and round by round).
- `transcriptions`: `--jobs` async transcriptions (POST /v1/jobs/transcriptions, chunking as `--chunking`: left
  out by default, the API's own default) of one `--audio-minutes` recording built as bench_speech builds it
  (tests/long_audio.py), submitted at once to every worker: wall time, each job's wait, run time and worker(s),
  jobs per worker, the aggregate real-time factor (audio seconds of every job over the wall time). The texts are
  the reference of `kill`.
- `kill`: `--kill-jobs` such transcriptions, then `--kill-chats` long chats (`--kill-chat-tokens`, three in four
  streamed, the rest synchronous); once every worker runs a transcription past its first checkpoint and the chats
  are decoding, the worker running a transcription with the most chats gets SIGKILL. Checks, pass or fail: each
  call it was running ended with an error (an HTTP error status or an SSE error event) within `--kill-bound-s`;
  no call hung; the other calls, and new ones after the kill, were answered; every transcription succeeded, those
  the dead worker was running resumed on another one (its recovery sweep: the dead worker's liveness key expires
  after worker_dead_after_s, 6 s, and a sweep runs every 5 s), and every text equals the reference (part
  `transcriptions`' text in this run, else one job of the recording run alone first).

    python bench/bench_gpus.py --model /tmp/m1b [--gpus 0,1] [--parts chats,transcriptions,kill] [--rounds 3]
        [--chats 64] [--audio-minutes 30] [--jobs 8] [--kill-jobs 8] [--out r.json]
    python bench/bench_gpus.py --model ~/.cache/mlxq/models/smollm2-135m --gpus cpu,cpu --chats 4 --rounds 1 \\
        --max-tokens 32 --audio-minutes 1 --jobs 2 --kill-chats 4 --kill-chat-tokens 200      # a CPU smoke test

Prints the JSON report (written to --out too; each part's to OUT.partial.json as soon as it is done), then a
summary. `bench/device/gpus.sh` runs it on the lent two-H100 machine.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from bench import bench_concurrency as concurrency  # noqa: E402  (its prompts and sampling workloads)
from bench.bench_speech import job_text, submit_job, wav_seconds  # noqa: E402
from bench.common import Proc, cpu_seconds, free_port, percentile, start_redis, wait_http, write_report  # noqa: E402
from jobs import records  # noqa: E402
from jobs.queues import fetch_job  # noqa: E402
from mlxq.cli import default_web_workers, gunicorn_argv  # noqa: E402
from tests.long_audio import build  # noqa: E402

TEXT, SPEECH = "bench", "speech"
"""The aliases the models are served under (each stack's own aliases.json)."""
PARTS = ("chats", "transcriptions", "kill")
WARMUP_AUDIO = REPO / "tests" / "fixtures" / "speech" / "garden.wav"
TERMINAL = ("succeeded", "failed", "canceled")
ROUNDS = itertools.count()
T0 = time.monotonic()


def log(message: str) -> None:
    """A progress line on stderr, with the seconds since the bench started."""
    print(f"[{time.monotonic() - T0:7.1f}s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the service: Redis, web, a worker per device


class Stack:
    """A fresh private Redis, the web tier and one worker per device, the models under aliases, a spool of its own."""

    def __init__(self, tag: str, devices: list[str], models: dict[str, Path], default_model: str, web_workers: int):
        self.tag, self.devices, self.default_model, self.web_workers = tag, devices, default_model, web_workers
        self.models = models
        self.procs: list[Proc] = []
        self.workers: dict[str, Proc] = {}  # worker name -> its process
        self.labels: dict[str, str] = {}  # worker name -> w<i>-gpu<d> / w<i>-cpu
        self.visible: dict[str, str | None] = {}  # worker name -> its CUDA_VISIBLE_DEVICES (None: not set)
        self.dirs: list[str] = []

    def start(self) -> "Stack":
        """Start Redis, the workers and gunicorn; return once /ready answers and every worker beats."""
        self.redis_url, redis_proc = start_redis()
        self.procs.append(redis_proc)
        self.conn = redis.Redis.from_url(self.redis_url)
        env = self._env()
        for i, device in enumerate(self.devices):
            label = f"w{i}-cpu" if device == "cpu" else f"w{i}-gpu{device}"
            name = f"{self.tag}-{label}"
            worker_env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
            if device != "cpu":
                worker_env["CUDA_VISIBLE_DEVICES"] = device
            proc = Proc([sys.executable, "-m", "workers.main", "--name", name], worker_env, f"gpus-{name}").start()
            self.procs.append(proc)
            self.workers[name], self.labels[name] = proc, label
            self.visible[name] = worker_env.get("CUDA_VISIBLE_DEVICES")
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        web = Proc(gunicorn_argv("127.0.0.1", port, self.web_workers), env, f"gpus-{self.tag}-web")
        self.procs.append(web.start())
        self._wait_ready(600)
        return self

    def _env(self) -> dict:
        """The environment of web and workers: this stack's Redis, aliases, default model and spool."""
        models_dir, spool = tempfile.mkdtemp(prefix="mlxq-gpus-models-"), tempfile.mkdtemp(prefix="mlxq-gpus-spool-")
        self.dirs += [models_dir, spool]
        aliases = {TEXT: str(self.models[TEXT]), SPEECH: str(self.models[SPEECH])}
        (Path(models_dir) / "aliases.json").write_text(json.dumps(aliases))
        return {**os.environ, "REDIS_URL": self.redis_url, "MLXQ_REDIS_URL": self.redis_url,
                "MLXQ_MODELS_DIR": models_dir, "MLXQ_DEFAULT_MODEL": self.default_model, "MLXQ_SPOOL_DIR": spool,
                "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def _wait_ready(self, timeout: float) -> None:
        """Wait until /ready answers 200 and the admin API lists every worker; a process that exits is an error."""
        deadline = time.monotonic() + timeout
        while not self._ready():
            for proc in self.procs:
                if proc.process.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited ({proc.process.returncode}):\n{tail(proc.log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.tag}: not ready within {timeout:.0f}s")
            time.sleep(0.5)

    def _ready(self) -> bool:
        try:
            wait_http(self.base + "/ready", 2)
            return {s["name"] for s in self.states()} >= set(self.workers)
        except (TimeoutError, httpx.HTTPError, ValueError, KeyError):
            return False

    def states(self) -> list[dict]:
        """GET /v1/admin/workers: each live worker's state (name, pid, device, memory, jobs in hand)."""
        return httpx.get(self.base + "/v1/admin/workers", timeout=10).json()["data"]

    def describe(self) -> list[dict]:
        """Each live worker: label, name, its CUDA_VISIBLE_DEVICES, the device and pid it reports (admin API)."""
        return [{"label": self.label(s["name"]), "name": s["name"], "device": s.get("device"), "pid": s.get("pid"),
                 "cuda_visible_devices": self.visible.get(s["name"])} for s in self.states()]

    def label(self, worker_name: str | None) -> str:
        """A worker's short label (`unknown` for a call no worker took)."""
        return self.labels.get(worker_name or "", worker_name or "unknown")

    def cpu_now(self) -> dict[str, float]:
        """CPU seconds used so far by each process (a worker, gunicorn with its web workers, Redis)."""
        return {proc.name: cpu_seconds(proc.process.pid) for proc in self.procs}

    def kill(self, worker_name: str) -> None:
        """SIGKILL a worker's process group (it runs in a session of its own) and reap it."""
        proc = self.workers[worker_name]
        os.killpg(proc.process.pid, signal.SIGKILL)
        proc.process.wait(10)

    def close(self) -> None:
        """Stop the web tier, then the workers together, then Redis; remove the stack's directories."""
        web = [p for p in self.procs if p.name.endswith("-web")]
        workers = [p for p in self.procs if p in self.workers.values()]
        rest = [p for p in self.procs if p not in web and p not in workers]
        for group in (web, workers, rest):
            with ThreadPoolExecutor(max(1, len(group))) as pool:
                list(pool.map(lambda p: p.process and p.stop(), group))
        for path in self.dirs:
            shutil.rmtree(path, ignore_errors=True)


@contextmanager
def running(*stacks: Stack):
    """Start the stacks together (their workers load at once); stop them all at the end, however it ends."""
    try:
        with ThreadPoolExecutor(len(stacks)) as pool:
            list(pool.map(Stack.start, stacks))
        yield stacks
    finally:
        for stack in stacks:
            stack.close()


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------- calls


class Call(threading.Thread):
    """One chat completion call on a thread of its own, with an X-Request-ID (the RQ job's meta keeps it, so the
    worker that ran a call can be found, even a synchronous one); `result` fills in as the answer comes."""

    def __init__(self, base: str, body: dict, request_id: str, started: float, timeout: float = 900):
        super().__init__(daemon=True)
        self.base, self.body, self.request_id, self.started, self.timeout = base, body, request_id, started, timeout
        self.connection: http.client.HTTPConnection | None = None
        self.result = {"request_id": request_id, "stream": bool(body.get("stream")), "ok": False, "outcome": None,
                       "id": None, "ttft": None, "tokens": 0, "status": None, "error": None, "end": None}

    def run(self) -> None:
        """Send the call and read its answer: ok and outcome done, http_error, error_event, cut or exception."""
        host, port = self.base.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=self.timeout)
        out = self.result
        try:
            self.connection.request("POST", "/v1/chat/completions", json.dumps(self.body),
                                    {"Content-Type": "application/json", "X-Request-ID": self.request_id})
            response = self.connection.getresponse()
            out["status"] = response.status
            if not 200 <= response.status < 300:
                out.update(outcome="http_error", error=error_code(response.read()))
            elif out["stream"]:
                self._read_stream(response)
            else:
                answer = json.loads(response.read())
                out.update(ok=True, outcome="done", id=answer.get("id"), tokens=answer["usage"]["completion_tokens"])
        except Exception as exc:  # noqa: BLE001 (every failure counts, whatever it is)
            out.update(outcome=out["outcome"] or "exception", error=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            out["end"] = time.perf_counter()
            self.connection.close()

    def _read_stream(self, response: http.client.HTTPResponse) -> None:
        """Read SSE lines to the end: the call's id, first content, usage, [DONE] or an error event."""
        out, finished = self.result, False
        while line := response.readline():
            line = line.decode().rstrip("\r\n")
            if line == "data: [DONE]":
                finished = True
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.update(outcome="error_event", error=(chunk.get("error") or {}).get("code") or "error")
                return
            out["id"] = out["id"] or chunk.get("id")
            if chunk.get("usage"):
                out["tokens"] = chunk["usage"]["completion_tokens"]
            if out["ttft"] is None and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                out["ttft"] = time.perf_counter() - self.started
        out.update(ok=finished, outcome="done" if finished else "cut")

    def abort(self) -> None:
        """Cut the connection of a call that outlived its bound (its thread then ends)."""
        sock = self.connection.sock if self.connection else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def error_code(data: bytes) -> str:
    """The error code of an error answer's JSON envelope (else its first bytes)."""
    try:
        return json.loads(data)["error"].get("code") or "error"
    except (ValueError, KeyError, TypeError, AttributeError):
        return data[:120].decode(errors="replace")


def chat_body(index: int, workload: str, max_tokens: int, temperature: float, stream: bool = True) -> dict:
    """bench_concurrency's request `index` of a workload (its prompt with the current round's mark)."""
    return {"model": TEXT, "max_tokens": max_tokens, **concurrency.sampling_fields(workload, index, temperature),
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}),
            "messages": concurrency.messages(index)}


def new_round() -> int:
    """A new round: bench_concurrency's prompts carry its mark, so no prompt cache has seen them."""
    number = next(ROUNDS)
    concurrency.ROUND_TAG = f" of round {number}"
    return number


def run_calls(calls: list[Call], timeout: float) -> None:
    """Start the calls together and wait for them (at most `timeout` seconds in all)."""
    for call in calls:
        call.start()
    deadline = time.monotonic() + timeout
    for call in calls:
        call.join(max(0.0, deadline - time.monotonic()))


def rq_workers(conn: redis.Redis, job_ids: list[str]) -> dict[str, str | None]:
    """The worker that took each RQ job (None: not taken, or gone)."""
    jobs = Job.fetch_many(job_ids, connection=conn, serializer=JSONSerializer) if job_ids else []
    return {job_id: (job.worker_name if job is not None else None) for job_id, job in zip(job_ids, jobs, strict=True)}


def status_of(job: Job) -> str:
    """An RQ job's status as loaded (started, finished, failed...)."""
    status = job.get_status(refresh=False)
    return status.value if status is not None else ""


def rq_calls(conn: redis.Redis, prefix: str) -> dict[str, dict]:
    """Every RQ job of this stack whose call carried an X-Request-ID starting with `prefix`, by that id: its
    job id, status and worker."""
    ids = [key.decode()[len("rq:job:"):] for key in conn.scan_iter(match="rq:job:*", count=1000)]
    ids = [job_id for job_id in ids if ":" not in job_id]
    out = {}
    for job in Job.fetch_many(ids, connection=conn, serializer=JSONSerializer) if ids else []:
        request_id = (job.meta or {}).get("request_id", "") if job is not None else ""
        if request_id.startswith(prefix):
            out[request_id] = {"id": job.id, "status": status_of(job), "worker": job.worker_name}
    return out


def calls_split(stack: Stack, results: list[dict]) -> dict[str, dict]:
    """Requests and completion tokens each worker served, from the calls' ids (RQ's worker_name)."""
    workers = rq_workers(stack.conn, [r["id"] for r in results if r["id"]])
    split: dict[str, dict] = {}
    for r in results:
        row = split.setdefault(stack.label(workers.get(r["id"])), {"requests": 0, "tokens": 0})
        row["requests"] += 1
        row["tokens"] += r["tokens"] if r["ok"] else 0
    return dict(sorted(split.items()))


# ---------------------------------------------------------------- part A: chats, one worker against all


def chat_round(stack: Stack, workload: str, args) -> dict:
    """N streaming chats of a workload at once against a stack: its figures, split and CPU use."""
    number = new_round()
    cpu_before = stack.cpu_now()
    started = time.perf_counter()
    calls = [Call(stack.base, chat_body(i, workload, args.max_tokens, args.temperature),
                  f"chats-{number}-{i}", started) for i in range(args.chats)]
    run_calls(calls, 900)
    results = [c.result for c in calls]
    figures = round_figures(started, [r for r in results if r["end"] is not None], len(calls))
    wall, cpu_after = figures["wall_s"], stack.cpu_now()
    figures["cpu_per_wall"] = {name.removeprefix(f"gpus-{stack.tag}-"): round((cpu_after[name] - cpu_before[name])
                                                                             / wall, 2)
                               for name in cpu_before} if wall > 0 else {}
    figures["split"] = calls_split(stack, results)
    return figures


def round_figures(started: float, results: list[dict], n: int) -> dict:
    """A round's figures: aggregate tokens/s over the wall time from the first request to the last end, TTFT."""
    ok = [r for r in results if r["ok"]]
    wall = max((r["end"] for r in results), default=started) - started
    ttfts = [r["ttft"] for r in ok if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    return {"n": n, "completed": len(ok), "failed": n - len(ok), "tokens": tokens, "wall_s": round(wall, 3),
            "aggregate_tps": round(tokens / wall, 1) if wall > 0 else 0.0,
            **{f"ttft_p{q}_s": round(percentile(ttfts, q), 3) if ttfts else None for q in (50, 95, 99)},
            "errors": sorted({f"{r['outcome']}: {r['error']}" for r in results if not r["ok"]})[:5]}


def combine(runs: list[dict]) -> dict:
    """One setup's rounds of one workload: medians, failures summed, every round kept (the run-to-run spread)."""
    def median(key: str):
        values = [r[key] for r in runs if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    return {"rounds": len(runs), "aggregate_tps": median("aggregate_tps"), "ttft_p50_s": median("ttft_p50_s"),
            "ttft_p95_s": median("ttft_p95_s"), "failed": sum(r["failed"] for r in runs),
            "errors": sorted({e for r in runs for e in r["errors"]})[:5],
            "cpu_per_wall": {name: round(statistics.median(r["cpu_per_wall"][name] for r in runs), 2)
                             for name in runs[0]["cpu_per_wall"]},
            "each_round": [{k: r[k] for k in ("aggregate_tps", "ttft_p50_s", "ttft_p95_s", "failed", "wall_s",
                                              "split", "cpu_per_wall")} for r in runs]}


def part_chats(args, models: dict[str, Path]) -> dict:
    """Part A: one worker against a worker per device, interleaved round by round, every workload."""
    one = Stack("chats-one", args.devices[:1], models, TEXT, args.web_workers)
    every = Stack("chats-all", args.devices, models, TEXT, args.web_workers)
    workloads = args.workloads.split(",")
    runs: dict[tuple[str, str], list[dict]] = {(w, s.tag): [] for w in workloads for s in (one, every)}
    with running(one, every) as stacks:
        log(f"chats: stacks up ({len(one.workers)} and {len(every.workers)} workers); warm-up rounds")
        for workload in workloads:  # MLX builds the kernels of each batch shape the first time it meets it
            for stack in stacks:
                chat_round(stack, workload, args)
        for r in range(args.rounds):
            for workload in rotated(workloads, r):
                for stack in rotated(list(stacks), r):
                    runs[workload, stack.tag].append(chat_round(stack, workload, args))
                    last = runs[workload, stack.tag][-1]
                    log(f"chats: round {r + 1} {workload:7} {stack.tag}: {last['aggregate_tps']:.0f} tok/s, "
                        f"failed {last['failed']}, split {last['split']}")
        setups = {"one_worker": one.describe(), "all_workers": every.describe()}
    results = {w: {"one_worker": combine(runs[w, one.tag]), "all_workers": combine(runs[w, every.tag])}
               for w in workloads}
    return {"n": args.chats, "max_tokens": args.max_tokens, "temperature": args.temperature, "rounds": args.rounds,
            "workloads": workloads, "setups": setups, "results": results,
            "all_over_one": {w: ratio_entry(runs[w, one.tag], runs[w, every.tag]) for w in workloads}}


def rotated(items: list, r: int) -> list:
    """The items starting at position r (modulo their count): a rotating order."""
    return items[r % len(items):] + items[:r % len(items)]


def ratio_entry(one: list[dict], every: list[dict]) -> dict:
    """All workers ÷ one worker in aggregate tokens/s: of the medians, and round by round."""
    def median(runs):
        return statistics.median(r["aggregate_tps"] for r in runs)

    pairs = [round(b["aggregate_tps"] / a["aggregate_tps"], 3) if a["aggregate_tps"] else None
             for a, b in zip(one, every, strict=True)]
    return {"of_medians": round(median(every) / median(one), 3) if median(one) else None, "each_round": pairs}


# ---------------------------------------------------------------- transcriptions


def submit(base: str, path: Path, chunking: str | None) -> str:
    """POST /v1/jobs/transcriptions of the speech model (the file streamed from disk); the job's id."""
    return submit_job(base, path, chunking, model=SPEECH)


def submit_all(base: str, path: Path, count: int, chunking: str | None) -> list[str]:
    """Submit `count` transcriptions of a file at once; their ids."""
    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda _: submit(base, path, chunking), range(count)))


def wait_jobs(base: str, job_ids: list[str], timeout: float) -> dict[str, dict]:
    """Poll the jobs' records until each has ended or `timeout` passes; the last record of each."""
    deadline = time.monotonic() + timeout
    latest: dict[str, dict] = {}
    with httpx.Client(base_url=base, timeout=30) as client:
        while True:
            for job_id in job_ids:
                if latest.get(job_id, {}).get("status") not in TERMINAL:
                    latest[job_id] = client.get(f"/v1/jobs/{job_id}").json()
            if all(r.get("status") in TERMINAL for r in latest.values()) or time.monotonic() > deadline:
                return latest
            time.sleep(0.5)


def runs_of(stack: Stack, job_id: str) -> list[dict]:
    """The RQ jobs that ran a transcription, in order (its first run, then each continuation "<id>_<n>"), with
    the worker that took each and its status."""
    current = (records.load(stack.conn, job_id) or {}).get("rq_job_id") or job_id
    last = int(current[len(job_id) + 1:]) if current != job_id else 0
    rq_ids = [job_id] + [f"{job_id}_{n}" for n in range(1, last + 1)]
    jobs = Job.fetch_many(rq_ids, connection=stack.conn, serializer=JSONSerializer)
    return [{"rq_id": rq_id, "worker": stack.label(job.worker_name), "status": status_of(job)}
            for rq_id, job in zip(rq_ids, jobs, strict=True) if job is not None]


def job_entry(stack: Stack, record: dict, t0: float, texts: dict[str, str]) -> dict:
    """One transcription job: status, attempts, wait and run time (the record's own times as stored: the API
    gives whole seconds), the workers that ran it, its text's key."""
    stored = records.load(stack.conn, record["id"]) or record
    started, finished = stored.get("started_at"), stored.get("finished_at")
    entry = {"id": record["id"], "status": record.get("status"), "attempts": record.get("attempts"),
             "queued_s": round(started - stored["created_at"], 2) if started else None,
             "run_s": round(finished - started, 2) if started and finished else None,
             "done_at_s": round(finished - t0, 2) if finished else None, "runs": runs_of(stack, record["id"]),
             "error": record.get("error"), "text": None}
    entry["worker"] = entry["runs"][-1]["worker"] if entry["runs"] else None
    if entry["status"] == "succeeded":
        entry["text"] = keep_text(job_text(stack.base, record["id"]), texts)
    return entry


def keep_text(text: str, texts: dict[str, str]) -> str:
    """Store a transcript once in the report's texts; its key (the first 12 hex digits of its SHA-256)."""
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    texts.setdefault(key, text)
    return key


def warm_speech(stack: Stack, args) -> dict:
    """Two short async transcriptions per worker at once, so that every worker has likely met the path before
    the measured jobs: how many each worker ran."""
    ids = submit_all(stack.base, WARMUP_AUDIO, 2 * len(stack.workers), args.chunking)
    done = wait_jobs(stack.base, ids, 600)
    bad = [r for r in done.values() if r.get("status") != "succeeded"]
    if bad:
        raise RuntimeError(f"a warm-up transcription did not succeed: {bad[0]}")
    return dict(Counter(run["worker"] for job_id in ids for run in runs_of(stack, job_id)))


def summary_of(samples: list[float]) -> dict:
    """n, p50, max of samples."""
    if not samples:
        return {"n": 0}
    return {"n": len(samples), "p50": round(percentile(samples, 50), 2), "max": round(max(samples), 2)}


def part_transcriptions(args, models: dict[str, Path], path: Path, audio_s: float, texts: dict) -> dict:
    """Part B: `--jobs` transcriptions of the recording at once on every worker."""
    with running(Stack("transcriptions", args.devices, models, SPEECH, args.web_workers)) as (stack,):
        warmup = warm_speech(stack, args)
        log(f"transcriptions: warmed ({warmup}); submitting {args.jobs} jobs of {audio_s / 60:.1f} min")
        t0 = time.time()
        ids = submit_all(stack.base, path, args.jobs, args.chunking)
        uploaded_s = time.time() - t0
        final = wait_jobs(stack.base, ids, args.wait_s)
        jobs = [job_entry(stack, final[job_id], t0, texts) for job_id in ids]
        workers = stack.describe()
    ended = [j["done_at_s"] for j in jobs if j["done_at_s"] is not None]
    wall = max(ended) if len(ended) == len(jobs) else None
    per_worker = Counter(run["worker"] for j in jobs for run in j["runs"])
    keys = Counter(j["text"] for j in jobs if j["text"])
    checks = {"all_succeeded": check(all(j["status"] == "succeeded" for j in jobs),
                                     f"{sum(j['status'] == 'succeeded' for j in jobs)} of {len(jobs)} succeeded"),
              "every_worker_used": check(all(per_worker.get(w["label"]) for w in workers),
                                         f"runs per worker: {dict(per_worker)}"),
              "texts_identical": check(len(keys) == 1, f"{len(keys)} distinct text(s) among {sum(keys.values())}")}
    return {"audio_s": round(audio_s, 2), "jobs": args.jobs, "chunking": args.chunking or "default (left out)",
            "workers": workers, "warmup_runs_per_worker": warmup, "upload_s": round(uploaded_s, 2),
            "wall_s": round(wall, 2) if wall else None,
            "rtf_aggregate": round(args.jobs * audio_s / wall, 1) if wall else None,
            "runs_per_worker": dict(per_worker), "run_s": summary_of([j["run_s"] for j in jobs if j["run_s"]]),
            "reference_text": keys.most_common(1)[0][0] if keys else None, "each_job": jobs, "checks": checks}


def check(passed: bool, detail: str) -> dict:
    """A pass/fail check with what it saw."""
    return {"pass": bool(passed), "detail": detail}


# ---------------------------------------------------------------- part C: a worker killed mid-load


def transcribing(stack: Stack, job_ids: list[str]) -> dict[str, str]:
    """Worker name -> a transcription it runs now that has checkpointed some audio already (progress done_s > 0)."""
    out = {}
    for job_id in job_ids:
        record = records.load(stack.conn, job_id) or {}
        job = fetch_job(stack.conn, record.get("rq_job_id") or job_id)
        if job is not None and job.get_status() == JobStatus.STARTED \
                and ((record.get("progress") or {}).get("done_s") or 0) > 0:
            out[job.worker_name] = job_id
    return out


def wait_for(condition, timeout: float, what: str) -> float:
    """Poll `condition` every 0.2 s until it holds; seconds waited (TimeoutError past `timeout`)."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(0.2)
    return time.monotonic() - t0


def decoding(stack: Stack, calls: list[Call]) -> bool:
    """Whether every call still running has been taken by a worker, and every such stream has its first token."""
    taken = rq_calls(stack.conn, "kill-")
    for call in calls:
        if not call.is_alive():
            continue
        if taken.get(call.request_id, {}).get("status") != "started":
            return False
        if call.result["stream"] and call.result["ttft"] is None:
            return False
    return True


def kill_chats(stack: Stack, args) -> list[Call]:
    """Start the long chats of the kill (mixed sampling; every fourth one synchronous)."""
    new_round()
    started = time.perf_counter()
    calls = [Call(stack.base, chat_body(i, "mixed", args.kill_chat_tokens, args.temperature, stream=i % 4 != 3),
                  f"kill-{i}", started, timeout=args.wait_s) for i in range(args.kill_chats)]
    for call in calls:
        call.start()
    return calls


def settle_calls(stack: Stack, calls: list[Call], deadline: float, killed: float) -> list[dict]:
    """Wait for the calls until `deadline` (perf_counter); those still running then are `hung` (and cut). What
    became of each: its worker, outcome, error and the seconds from the kill to its end."""
    for call in calls:
        call.join(max(0.0, deadline - time.perf_counter()))
        if call.is_alive():
            call.abort()
            call.join(10)
            call.result.update(outcome="hung", ok=False)  # (after the thread's own ending: cut)
    taken = rq_calls(stack.conn, "kill-")
    return [{**{k: c.result[k] for k in ("request_id", "stream", "id", "ok", "outcome", "status", "error", "tokens")},
             "worker": stack.label(taken.get(c.request_id, {}).get("worker")),
             "ended_after_kill_s": round(c.result["end"] - killed, 2) if c.result["end"] else None}
            for c in calls]


def after_kill_calls(stack: Stack, args) -> list[dict]:
    """Two new short chats per surviving worker (streamed and not) once the kill's calls have ended: answered?"""
    new_round()
    started = time.perf_counter()
    calls = [Call(stack.base, chat_body(i, "greedy", 16, args.temperature, stream=i % 2 == 0), f"after-{i}",
                  started, timeout=300) for i in range(2 * (len(stack.workers) - 1))]
    run_calls(calls, 300)
    keys = ("request_id", "stream", "ok", "outcome", "status", "error")
    return [{k: call.result[k] for k in keys} for call in calls]


def load_and_pick(stack: Stack, job_ids: list[str], args) -> tuple[list[Call], str, dict]:
    """Once every worker runs a transcription past its first checkpoint, start the chats; once they decode, the
    worker to kill. The calls, the victim's name, and what was waited and seen."""
    every_worker = lambda: set(transcribing(stack, job_ids)) >= set(stack.workers)  # noqa: E731
    seen = {"waited_for_transcriptions_s": round(wait_for(every_worker, args.start_wait_s, "a transcription past "
                                                          "its first checkpoint on every worker"), 2)}
    calls = kill_chats(stack, args)
    seen["waited_for_chats_s"] = round(wait_for(lambda: decoding(stack, calls), args.start_wait_s,
                                                "the chats decoding"), 2)
    running_now = transcribing(stack, job_ids)
    chats = Counter(info["worker"] for info in rq_calls(stack.conn, "kill-").values() if info["status"] == "started")
    candidates = [name for name in stack.workers if name in running_now] or list(stack.workers)
    victim = max(candidates, key=lambda name: chats[name])  # running a transcription, with the most chats
    seen["at_kill"] = {stack.label(name): {"transcription": running_now.get(name), "chats": chats[name]}
                       for name in stack.workers}
    return calls, victim, seen


def part_kill(args, models: dict[str, Path], path: Path, reference: str | None, texts: dict) -> dict:
    """Part C: transcriptions and chats on every worker, one worker killed; what became of each."""
    with running(Stack("kill", args.devices, models, SPEECH, args.web_workers)) as (stack,):
        warmup = {"transcriptions": warm_speech(stack, args), "chats": warm_chats(stack, args)}
        if reference is None:
            reference = reference_text(stack, path, args, texts)
        log(f"kill: warmed ({warmup}); submitting {args.kill_jobs} transcriptions")
        t0 = time.time()
        ids = submit_all(stack.base, path, args.kill_jobs, args.chunking)
        calls, victim, seen = load_and_pick(stack, ids, args)
        log(f"kill: SIGKILL {stack.label(victim)}; at the kill {seen['at_kill']}")
        stack.kill(victim)
        killed, killed_at = time.perf_counter(), time.time()
        on_victim = {rid for rid, info in rq_calls(stack.conn, "kill-").items() if info["worker"] == victim}
        victim_calls = settle_calls(stack, [c for c in calls if c.request_id in on_victim],
                                    killed + args.kill_bound_s, killed)
        log(f"kill: the dead worker's {len(victim_calls)} calls: {dict(Counter(r['outcome'] for r in victim_calls))}")
        after = after_kill_calls(stack, args)
        other_calls = settle_calls(stack, [c for c in calls if c.request_id not in on_victim],
                                   time.perf_counter() + args.wait_s, killed)
        final = wait_jobs(stack.base, ids, args.wait_s)
        jobs = [job_entry(stack, final[job_id], t0, texts) for job_id in ids]
        log(f"kill: transcriptions ended: {dict(Counter(j['status'] for j in jobs))}")
        victim, workers = stack.label(victim), stack.describe()
    return {"workers": workers, "warmup": warmup, **seen, "victim": victim, "killed_at_s": round(killed_at - t0, 2),
            "kill_bound_s": args.kill_bound_s, "chat_tokens": args.kill_chat_tokens, "reference_text": reference,
            "transcriptions": jobs, "calls_on_victim": victim_calls, "other_calls": other_calls,
            "calls_after_kill": after,
            "checks": kill_checks(victim, victim_calls, other_calls, after, jobs, reference, args.kill_bound_s)}


def warm_chats(stack: Stack, args) -> dict:
    """A round of short chats (the text model loads on the workers that take them): requests per worker."""
    number = new_round()
    started = time.perf_counter()
    calls = [Call(stack.base, chat_body(i, "mixed", 16, args.temperature), f"warm-{number}-{i}", started)
             for i in range(args.kill_chats)]
    run_calls(calls, 600)
    return {label: row["requests"] for label, row in calls_split(stack, [c.result for c in calls]).items()}


def reference_text(stack: Stack, path: Path, args, texts: dict) -> str:
    """The recording transcribed by one job alone (part `transcriptions` did not run): its text's key."""
    log("kill: no transcriptions part in this run: a reference job alone first")
    job_id = submit(stack.base, path, args.chunking)
    record = wait_jobs(stack.base, [job_id], args.wait_s)[job_id]
    if record.get("status") != "succeeded":
        raise RuntimeError(f"the reference transcription did not succeed: {record}")
    return keep_text(job_text(stack.base, job_id), texts)


def kill_checks(victim: str, on_victim: list[dict], others: list[dict], after: list[dict], jobs: list[dict],
                reference: str, bound_s: float) -> dict:
    """The kill's checks, each pass or fail with what it saw."""
    interrupted = [r for r in on_victim if r["outcome"] != "done" or r["ended_after_kill_s"] is None]
    errors = [r for r in interrupted if r["outcome"] in ("http_error", "error_event")]
    ends = [r["ended_after_kill_s"] for r in interrupted if r["ended_after_kill_s"] is not None]
    resumed = [j for j in jobs if any(run["worker"] == victim and run["status"] == "failed" for run in j["runs"])]
    moved = [j for j in resumed if j["status"] == "succeeded" and j["runs"][-1]["worker"] != victim
             and (j["attempts"] or 0) >= 2]
    every_call = on_victim + others + after
    return {
        "victim_calls_ended_with_error": check(
            interrupted and len(errors) == len(interrupted),
            f"{len(errors)} of {len(interrupted)} calls running on {victim} ended with an error "
            f"({dict(Counter(r['outcome'] + ' ' + str(r['error']) for r in interrupted))}); "
            f"{len(on_victim) - len(interrupted)} had finished before the kill"
            + ("" if interrupted else "; none was running: raise --kill-chat-tokens")),
        "victim_calls_within_bound": check(
            interrupted and len(ends) == len(interrupted) and max(ends) <= bound_s,
            f"ended {min(ends, default=0):.1f}-{max(ends, default=0):.1f} s after the kill (bound {bound_s:g} s)"),
        "no_call_hung": check(not any(r["outcome"] == "hung" for r in every_call),
                              f"{sum(r['outcome'] == 'hung' for r in every_call)} hung of {len(every_call)}"),
        "other_calls_answered": check(all(r["ok"] for r in others),
                                      f"{sum(r['ok'] for r in others)} of {len(others)} on the other workers "
                                      f"(or queued at the kill) answered"),
        "calls_after_kill_answered": check(after and all(r["ok"] for r in after),
                                           f"{sum(r['ok'] for r in after)} of {len(after)}"),
        "transcriptions_succeeded": check(all(j["status"] == "succeeded" for j in jobs),
                                          f"{dict(Counter(j['status'] for j in jobs))}"),
        "interrupted_resumed_elsewhere": check(
            resumed and len(moved) == len(resumed),
            f"{len(moved)} of {len(resumed)} transcriptions running on {victim} at the kill finished on another "
            f"worker (attempts {[j['attempts'] for j in resumed]}, runs "
            f"{[[r['worker'] for r in j['runs']] for j in resumed]})"
            + ("" if resumed else "; none was interrupted")),
        "texts_match_reference": check(all(j["text"] == reference for j in jobs),
                                       f"{sum(j['text'] == reference for j in jobs)} of {len(jobs)} equal the "
                                       f"reference {reference}"),
    }


# ---------------------------------------------------------------- the report


def summary(report: dict) -> str:
    """The report as text: each part's figures and checks, and how long each part took."""
    lines = []
    chats = report.get("chats")
    if chats:
        lines.append(f"A. chats: {chats['n']} at once, {chats['max_tokens']} tokens, {chats['rounds']} rounds per "
                     f"setup after a warm-up, interleaved; devices {report['devices']}")
        lines.append(f"{'workload':9} {'setup':12} {'tok/s':>7} {'ttft p50':>9} {'ttft p95':>9} {'failed':>6}"
                     "  rounds' tok/s | requests per worker, each round")
        for workload, setups in chats["results"].items():
            for name, c in setups.items():
                rounds = [r["aggregate_tps"] for r in c["each_round"]]
                split = ["/".join(f"{k} {v['requests']}" for k, v in r["split"].items()) for r in c["each_round"]]
                lines.append(f"{workload:9} {name:12} {num(c['aggregate_tps']):>7} {num(c['ttft_p50_s'], 3):>9} "
                             f"{num(c['ttft_p95_s'], 3):>9} {c['failed']:>6}  {[round(x) for x in rounds]} | "
                             f"{'; '.join(split)}")
                lines.append(f"{'':22} CPU s per s: " + ", ".join(f"{k} {v}" for k, v in c["cpu_per_wall"].items()))
            ratio = chats["all_over_one"][workload]
            lines.append(f"{'':9} all ÷ one: {num(ratio['of_medians'], 2)} (rounds {ratio['each_round']})")
    speech = report.get("transcriptions")
    if speech:
        lines.append(f"B. transcriptions: {speech['jobs']} jobs of {speech['audio_s'] / 60:.1f} min, chunking "
                     f"{speech['chunking']}: wall {num(speech['wall_s'], 1)} s, real-time factor "
                     f"{num(speech['rtf_aggregate'], 1)}x in all; runs per worker {speech['runs_per_worker']}; "
                     f"a job's run p50 {speech['run_s'].get('p50')} s, max {speech['run_s'].get('max')} s")
        lines.append("   each job (worker: wait + run s): " + ", ".join(
            f"{j['worker']}: {j['queued_s']}+{j['run_s']}" for j in speech["each_job"]))
        lines.extend(check_lines(speech["checks"]))
    kill = report.get("kill")
    if kill:
        chats = len(kill["calls_on_victim"]) + len(kill["other_calls"])
        lines.append(f"C. kill: {len(kill['transcriptions'])} transcriptions and {chats} chats; {kill['victim']} "
                     f"killed {kill['killed_at_s']} s after the submissions (at the kill: {kill['at_kill']})")
        lines.extend(check_lines(kill["checks"]))
    lines.append("seconds per part: " + ", ".join(f"{k} {v}" for k, v in report.get("part_s", {}).items()))
    failed = [f"{part}.{name}" for part in PARTS for name, c in (report.get(part) or {}).get("checks", {}).items()
              if not c["pass"]]
    lines.append("checks: " + ("all passed" if not failed else "FAILED " + ", ".join(failed)))
    return "\n".join(lines)


def check_lines(checks: dict) -> list[str]:
    """One line per check."""
    return [f"   {'PASS' if c['pass'] else 'FAIL'} {name}: {c['detail']}" for name, c in checks.items()]


def num(value, digits: int = 0) -> str:
    """A figure, or - when there is none."""
    return "-" if value is None else f"{value:,.{digits}f}"


def model_dir(ref: str) -> Path:
    """A model directory, or a store name resolved in the local store."""
    if Path(ref).expanduser().is_dir():
        return Path(ref).expanduser().resolve()
    from jobs.settings import load_settings
    from jobs.store import resolve

    return Path(resolve(ref, load_settings()).path)


def parse_args() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the text model: a directory or a store name")
    parser.add_argument("--speech-model", default="whisper-tiny.en", help="a Whisper model directory or store name")
    parser.add_argument("--gpus", default="0,1", help="a worker per entry: its CUDA_VISIBLE_DEVICES, or cpu (none)")
    parser.add_argument("--parts", default=",".join(PARTS), help="any of " + ",".join(PARTS))
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds per setup and workload (chats)")
    parser.add_argument("--chats", type=int, default=64, help="chats at once (chats)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workloads", default=",".join(concurrency.WORKLOADS), help="any of greedy,sampled,mixed")
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled workload's temperature")
    parser.add_argument("--web-workers", type=int, default=default_web_workers(),
                        help="gunicorn processes (default: `mlxq up`'s, half the cores, 2 to 8)")
    parser.add_argument("--audio-minutes", type=float, default=30)
    parser.add_argument("--jobs", type=int, default=8, help="transcriptions at once (transcriptions)")
    parser.add_argument("--kill-jobs", type=int, default=None, help="transcriptions in the kill (default: --jobs)")
    parser.add_argument("--chunking", default=None, choices=["auto"], help="chunking_strategy (default: left out)")
    parser.add_argument("--kill-chats", type=int, default=16)
    parser.add_argument("--kill-chat-tokens", type=int, default=2000, help="max_tokens of the kill's chats")
    parser.add_argument("--kill-bound-s", type=float, default=120, help="the dead worker's calls must end within")
    parser.add_argument("--start-wait-s", type=float, default=300, help="the longest wait before the kill")
    parser.add_argument("--wait-s", type=float, default=3600, help="the longest wait for jobs and calls to end")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.devices = [d.strip() for d in args.gpus.split(",") if d.strip()]
    args.parts = [p for p in args.parts.split(",") if p]
    args.kill_jobs = args.kill_jobs or args.jobs
    if len(args.devices) < 2:
        parser.error("--gpus: two devices at least (e.g. 0,1, or cpu,cpu)")
    if args.kill_jobs < len(args.devices) or args.jobs < 1:
        parser.error("--kill-jobs: one transcription per worker at least (each must be running one at the kill)")
    if set(args.parts) - set(PARTS):
        parser.error(f"--parts: unknown {', '.join(sorted(set(args.parts) - set(PARTS)))}")
    if set(args.workloads.split(",")) - set(concurrency.WORKLOADS):
        parser.error(f"--workloads: choose from {', '.join(concurrency.WORKLOADS)}")
    return args


def main() -> None:
    """Run the parts asked for, one after another, each on a fresh service; print the report and its summary."""
    args = parse_args()
    models = {TEXT: model_dir(args.model), SPEECH: model_dir(args.speech_model)}
    report = {"machine": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(sys.argv), "devices": args.devices,
              "models": {k: str(v) for k, v in models.items()}, "part_s": {}, "texts": {}}
    path = audio_s = None
    if {"transcriptions", "kill"} & set(args.parts):
        t = time.monotonic()
        path = build(args.audio_minutes)
        audio_s = wav_seconds(path)
        report["recording"] = {"file": str(path), "audio_s": round(audio_s, 2),
                               "build_s": round(time.monotonic() - t, 1)}
    for part in PARTS:
        if part not in args.parts:
            continue
        t = time.monotonic()
        log(f"{part}: starting")
        if part == "chats":
            report[part] = part_chats(args, models)
        elif part == "transcriptions":
            report[part] = part_transcriptions(args, models, path, audio_s, report["texts"])
        else:
            reference = (report.get("transcriptions") or {}).get("reference_text")
            report[part] = part_kill(args, models, path, reference, report["texts"])
        report["part_s"][part] = round(time.monotonic() - t, 1)
        log(f"{part}: done in {report['part_s'][part]} s")
        if args.out:  # what is measured so far, should a later part run out of time
            args.out.with_suffix(".partial.json").write_text(json.dumps(report, indent=1))
    write_report(report, args.out)
    print(summary(report))


if __name__ == "__main__":
    main()
