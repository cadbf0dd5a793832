"""Where a decode step's host time goes: mlxq's DecodeBatch alone, N rows, with H ms of busy host work after
each step (standing in for the service's detokenizing and publishing).

Prints, per H: the step's wall time, the time inside `DecodeBatch.step`, and how much of it `mx.async_eval`
(queuing the next forward pass) took. If host work overlapped the device's, the step would stay near
max(device, H); on the lent H200 (2026-11-26) it grew by H in full, because queuing a pass is itself host
work (MLX encodes every kernel on the calling thread). Not a figure to publish: a profiler.

    python bench/profile_decode_host.py --model DIR [--rows 64] [--steps 100] [--host-ms 0,3,6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generation_stream  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from jobs.contract import Sampling  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch  # noqa: E402

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


def run(model, tokenizer, rows: int, steps: int, host_ms: float) -> dict:
    """One measured decode of `rows` greedy sequences; per-step milliseconds."""
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
    QUEUED["s"], inside, measured = 0.0, 0.0, steps - 4
    began = time.perf_counter()
    for _ in range(measured):
        t = time.perf_counter()
        batch.step()
        inside += time.perf_counter() - t
        busy(host_ms)
    took = time.perf_counter() - began
    batch.remove([slot.key for slot in batch.slots])
    mx.clear_cache()
    return {"step_ms": round(1000 * took / measured, 2), "in_step_ms": round(1000 * inside / measured, 2),
            "async_eval_ms": round(1000 * QUEUED["s"] / measured, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--host-ms", default="0,3,6")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    mx.async_eval = _timed_async_eval
    for _ in range(args.repeats):
        for host in (float(h) for h in args.host_ms.split(",")):
            print(f"{mx.default_device()} rows {args.rows} host {host:g} ms:",
                  run(model, tokenizer, args.rows, args.steps, host), flush=True)


if __name__ == "__main__":
    main()
