"""What a prompt-processing turn of the worker costs on this device: N new prompts of ~L tokens processed in one
pass (`prefill.feed_together`, as a burst of chats is), then their first tokens drawn and read back (as
`TextBatch._first_tokens` does), against mlx-lm's own batched prefill of the same prompts (left padding, one pass).
Each shape runs twice, to tell a shape met for the first time from one met before.

    python bench/device/prefill_probe.py --model DIR [--shapes 12x53,20x50,51x53,64x53] [--repeats 2] [--mlx-lm-first]

Prints one JSON line per run: ms for the pass, for the first tokens, and for mlx-lm's pass.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402

from jobs.contract import Sampling  # noqa: E402
from workers.backends import prefill, sampling  # noqa: E402
from workers.backends.prefill import Prompt  # noqa: E402


def prompts_of(model, rows: int, length: int, salt: int) -> list[list[int]]:
    """`rows` token lists of about `length` tokens (lengths differ by a few, as chats' do), new each call."""
    vocab = model.args.vocab_size
    return [[(salt * 7919 + r * 131 + i * 17) % (vocab - 10) + 5 for i in range(length - 3 + r % 7)]
            for r in range(rows)]


def worker_turn(model, ids: list[list[int]]) -> dict:
    """The worker's turn: one pass for all, then the first tokens drawn and read back."""
    prompts = [Prompt(None, [], make_prompt_cache(model), [], list(p), i) for i, p in enumerate(ids)]
    t0 = time.perf_counter()
    logits = prefill.feed_together(model, prompts)
    t1 = time.perf_counter()
    rows = sampling.BatchSampler(logits.shape[-1])
    rows.extend([sampling.row_for(Sampling(temperature=0.7), logits.shape[-1]) for _ in ids], [p[:-1] for p in ids])
    processed = rows.process(logits, mx.array([p[-1] for p in ids], mx.uint32), [False] * len(ids))
    tokens = rows.sample(processed - mx.logsumexp(processed, axis=-1, keepdims=True)).tolist()
    t2 = time.perf_counter()
    assert len(tokens) == len(ids)
    return {"pass_ms": round(1000 * (t1 - t0), 1), "first_tokens_ms": round(1000 * (t2 - t1), 1)}


def mlx_lm_pass(model, ids: list[list[int]]) -> float:
    """mlx-lm's batched prefill: left padding, one pass, the last position's logits evaluated."""
    width = max(map(len, ids))
    padding = [width - len(p) for p in ids]
    cache = [BatchKVCache(padding) for _ in model.layers]
    inputs = mx.array([[0] * pad + p for pad, p in zip(padding, ids, strict=True)])
    t0 = time.perf_counter()
    logits = model(inputs, cache=cache)[:, -1, :]
    mx.eval(logits, [(c.keys, c.values) for c in cache])
    return round(1000 * (time.perf_counter() - t0), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--shapes", default="12x53,20x50,51x53,64x53")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mlx-lm-first", action="store_true", help="run mlx-lm's pass before the worker's turn")
    args = parser.parse_args()
    model, _ = load(str(args.model))
    salt = 0
    for shape in args.shapes.split(","):
        rows, length = map(int, shape.split("x"))
        for repeat in range(args.repeats):
            salt += 1
            ids = prompts_of(model, rows, length, salt)
            if args.mlx_lm_first:  # a shape's first-time cost falls on whichever runs first
                direct = mlx_lm_pass(model, ids)
                turn = worker_turn(model, ids)
            else:
                turn = worker_turn(model, ids)
                direct = mlx_lm_pass(model, ids)
            print(json.dumps({"rows": rows, "length": length, "repeat": repeat, **turn, "mlx_lm_pass_ms": direct}),
                  flush=True)
            mx.clear_cache()


if __name__ == "__main__":
    main()
