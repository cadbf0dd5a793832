"""Do fewer, wider matrix products make a host-bound decode step cheaper? The worker's DecodeBatch on a Llama-shape
model, the same rows decoded with mlx-lm's layers as they are (seven products a layer) and with q/k/v and gate/up
each joined (four: workers/backends/fused.py), alternating blocks of steps in one process.

    python bench/device/fuse_probe.py --model DIR [--size 64] [--steps 30] [--blocks 6]

Prints one JSON line: per variant, the median step (ms) of each block, and the agreement of the two variants' tokens.
A probe for deciding, not a figure to publish.
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
from workers.backends import fused, sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch, Joining  # noqa: E402


def use(model, joined: bool) -> None:
    """The model's projections joined, or as mlx-lm made them (views of the joined weights)."""
    if joined:
        fused.fuse_projections(model)
    else:
        fused.unfuse(model)
    mx.eval(model.parameters())


def batch_of(model, tokenizer, size: int, steps: int) -> DecodeBatch:
    vocab = model.args.vocab_size
    batch = DecodeBatch(model, vocab, set())
    joining = []
    for i in range(size):
        ids = tokenizer.encode(f"Request {i}: write a long story about the sea, number {i}.")
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        joining.append(Joining(object(), cache, ids[:-1], ids[-1], 10**6,
                               sampling.row_for(Sampling(temperature=0.0), vocab)))
    batch.insert_many(joining)
    return batch


def block(batch: DecodeBatch, steps: int) -> tuple[float, list[int]]:
    """Median step (ms) over `steps` steps, and the tokens of the last step."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = batch.step()
        times.append(1000 * (time.perf_counter() - t0))
    mx.eval(batch.inputs)
    return statistics.median(times), [t.token for t in out]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=6)
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    medians: dict[str, list[float]] = {"plain": [], "fused": []}
    tokens = {}
    for joined in (False, True):  # agreement: the same rows, the same steps
        use(model, joined)
        batch = batch_of(model, tokenizer, args.size, 4)
        for _ in range(4):
            out = batch.step()
        mx.eval(batch.inputs)
        tokens[joined] = [t.token for t in out]
    agree = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True)) / len(tokens[False])
    batch = batch_of(model, tokenizer, args.size, args.steps)
    for b in range(2 * args.blocks):
        joined = bool(b % 2)
        use(model, joined)
        block(batch, 3)  # settle after the switch
        medians["fused" if joined else "plain"].append(round(block(batch, args.steps)[0], 2))
    print(json.dumps({"size": args.size, "steps": args.steps, "medians_ms": medians,
                      "plain_ms": statistics.median(medians["plain"]), "fused_ms": statistics.median(medians["fused"]),
                      "agreement_after_4_steps": agree}), flush=True)


if __name__ == "__main__":
    main()
