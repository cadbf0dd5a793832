"""Would fewer, wider matrix products make a host-bound decode step cheaper? The worker's DecodeBatch on a Llama-shape
model, the same rows decoded with mlx-lm's layers as they are (seven products a layer) and with q/k/v and gate/up
each in one product (four), alternating blocks of steps in one process.

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
from mlx_lm.models.activations import swiglu  # noqa: E402
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from jobs.contract import Sampling  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch, Joining  # noqa: E402


def fused_attention(self, x, mask=None, cache=None):
    """mlx-lm's Llama attention with one product for queries, keys and values."""
    B, L, _ = x.shape
    qkv = x @ self.qkv_t
    q_end = self.n_heads * self.head_dim_
    k_end = q_end + self.n_kv_heads * self.head_dim_
    queries = qkv[..., :q_end].reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
    keys = qkv[..., q_end:k_end].reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = qkv[..., k_end:].reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = self.rope(queries, offset=cache.offset)
    keys = self.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
    return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def fused_mlp(self, x):
    """mlx-lm's Llama MLP with one product for gate and up."""
    gate, up = mx.split(x @ self.gate_up_t, 2, axis=-1)
    return self.down_proj(swiglu(gate, up))


def prepare_fused(model) -> None:
    """Give each layer its concatenated weights (transposed once), beside the originals."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        a.head_dim_ = a.q_proj.weight.shape[0] // a.n_heads
        a.qkv_t = mx.contiguous(mx.concatenate([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).T)
        m.gate_up_t = mx.contiguous(mx.concatenate([m.gate_proj.weight, m.up_proj.weight]).T)
        mx.eval(a.qkv_t, m.gate_up_t)


def use(model, fused: bool) -> None:
    """Switch every layer's attention and MLP to the fused or the original call."""
    attention, mlp = type(model.model.layers[0].self_attn), type(model.model.layers[0].mlp)
    if not hasattr(attention, "_original"):
        attention._original, mlp._original = attention.__call__, mlp.__call__
    attention.__call__ = fused_attention if fused else attention._original
    mlp.__call__ = fused_mlp if fused else mlp._original


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
    prepare_fused(model)
    medians: dict[str, list[float]] = {"plain": [], "fused": []}
    tokens = {}
    for fused in (False, True):  # agreement: the same rows, the same steps
        use(model, fused)
        batch = batch_of(model, tokenizer, args.size, 4)
        for _ in range(4):
            out = batch.step()
        mx.eval(batch.inputs)
        tokens[fused] = [t.token for t in out]
    agree = sum(a == b for a, b in zip(tokens[False], tokens[True], strict=True)) / len(tokens[False])
    batch = batch_of(model, tokenizer, args.size, args.steps)
    for b in range(2 * args.blocks):
        fused = bool(b % 2)
        use(model, fused)
        block(batch, 3)  # settle after the switch
        medians["fused" if fused else "plain"].append(round(block(batch, args.steps)[0], 2))
    print(json.dumps({"size": args.size, "steps": args.steps, "medians_ms": medians,
                      "plain_ms": statistics.median(medians["plain"]), "fused_ms": statistics.median(medians["fused"]),
                      "agreement_after_4_steps": agree}), flush=True)


if __name__ == "__main__":
    main()
