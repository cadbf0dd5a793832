"""What the first decode step at a batch size never met before costs on this device, against the steps
after it (MLX builds kernels per shape the first time it meets one, and keeps them on disk for later
processes). Runs the worker's DecodeBatch on a model for each size in turn, a fresh batch each time.

    python bench/device/shape_probe.py --model DIR [--sizes 64,21,24,63] [--steps 6]

Prints one JSON line per size: the first step's ms and the median of the others'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from jobs.contract import Sampling  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch, Joining  # noqa: E402


def probe(model, tokenizer, size: int, steps: int, temperature: float) -> dict:
    """Decode `steps` steps of a fresh batch of `size` sequences; each step's wall time (the last one
    waited for)."""
    vocab = model.args.vocab_size
    batch = DecodeBatch(model, vocab, set())
    joining = []
    for i in range(size):
        ids = tokenizer.encode(f"Request {i}: write a long story about the sea, number {i}.")
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        row = sampling.row_for(Sampling(temperature=temperature), vocab)
        joining.append(Joining(object(), cache, ids[:-1], ids[-1], steps + 2, row))
    batch.insert_many(joining)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch.step()
        times.append(1000 * (time.perf_counter() - t0))
    t0 = time.perf_counter()
    mx.eval(batch.inputs)
    times[-1] += 1000 * (time.perf_counter() - t0)
    t0 = time.perf_counter()
    batch.remove([batch.slots[0].key])  # one row leaves: the size below, reached by filtering
    batch.step()
    mx.eval(batch.inputs)
    leave = 1000 * (time.perf_counter() - t0)
    return {"size": size, "first_ms": round(times[0], 1), "second_ms": round(times[1], 1),
            "rest_median_ms": round(statistics.median(times[2:]), 1), "leave_then_step_ms": round(leave, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", default="64,21,24,63,40,5")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    for size in map(int, args.sizes.split(",")):
        print(json.dumps(probe(model, tokenizer, size, args.steps, args.temperature)), flush=True)


if __name__ == "__main__":
    main()
