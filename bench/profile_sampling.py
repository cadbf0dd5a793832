"""What the batched sampler's parts cost per decode step, on random logits of a model's vocabulary size.

Each part is timed on its own (evaluated, synchronized, median of many steps) for B rows: the uniforms,
the draw, the filters' sort, the penalties' bookkeeping, and the whole `process` + `sample` for the
greedy, sampled and mixed spreads of bench/bench_decode.py.

    python bench/profile_sampling.py [--vocab 49152] [--rows 8,64] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_decode import settings  # noqa: E402
from jobs.contract import Sampling  # noqa: E402
from workers.backends import sampling  # noqa: E402


def timed(fn, steps: int) -> float:
    """Median milliseconds of fn() evaluated and synchronized."""
    mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def bisect(logprobs: mx.array, top_p: mx.array, iterations: int = 24) -> mx.array:
    """The top_p threshold by bisection on the log-probability (no sort)."""
    x = logprobs.astype(mx.float32)
    probs = mx.exp(x)
    low, high = mx.min(x, axis=-1), mx.max(x, axis=-1)
    for _ in range(iterations):
        mid = (low + high) / 2
        mass = mx.sum(mx.where(x >= mid[:, None], probs, 0), axis=-1)
        enough = mass >= top_p
        low, high = mx.where(enough, mid, low), mx.where(enough, high, mid)
    return low


bisect_compiled = mx.compile(bisect)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="8,64")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    v = args.vocab
    for b in (int(x) for x in args.rows.split(",")):
        parts = step_parts(b, v)
        print(f"B={b} V={v}:", {name: round(timed(fn, args.steps), 3) for name, fn in parts.items()}, flush=True)


def step_parts(b: int, v: int) -> dict:
    """The parts of a sampling step for b rows, each a function to time."""
    logits = mx.random.normal((b, v)).astype(mx.bfloat16)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    inputs = mx.zeros((b,), mx.uint32)
    seeds = np.arange(b, dtype=np.uint32)
    top_p, top_k, min_p = mx.full((b,), 0.9), mx.full((b,), 40, mx.int32), mx.zeros((b,))
    parts = {
        "logsumexp": lambda: logits - mx.logsumexp(logits, axis=-1, keepdims=True),
        "uniform": lambda: mx.array(sampling.uniforms(seeds, seeds, seeds)),  # made on the host
        "argmax": lambda: mx.argmax(logprobs, axis=-1),
        "sort_all_rows": lambda: mx.sort(logprobs, axis=-1),
        "thresholds_all_rows": lambda: sampling.thresholds(logprobs, top_p, top_k, min_p, sampling.CANDIDATES),
        "topk1024_sort": lambda: mx.sort(mx.topk(logprobs, 1024, axis=-1), axis=-1),
        "bisect_top_p_24": lambda: bisect(logprobs, top_p),
        "bisect_top_p_24_compiled": lambda: bisect_compiled(logprobs, top_p),
        "counts_update": lambda: mx.zeros((b, v)).at[mx.arange(b), inputs.astype(mx.int32)].add(1.0),
    }
    for workload in ("greedy", "sampled", "mixed"):
        batch = sampling.BatchSampler(v)
        batch.extend([sampling.row_for(Sampling(**settings(workload, i)), v) for i in range(b)], [[1, 2, 3]] * b)

        def whole(batch=batch):
            processed = batch.process(logits, inputs, [True] * b)
            return batch.sample(processed - mx.logsumexp(processed, axis=-1, keepdims=True))
        parts[f"process+sample {workload}"] = whole
    return parts


if __name__ == "__main__":
    main()
