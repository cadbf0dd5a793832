"""What a decode step where many rows leave costs on this device, part by part: taking each leaving row's
KV cache out of the batch cache (mlx-lm's `BatchKVCache.extract`, as the decode loop does) against reading
the batch's padding once and slicing every row from it, and whether rows of new lengths cost more than
lengths seen before (kernels built per shape).

    python bench/device/leave_probe.py [--rows 64] [--layers 16] [--kv-heads 8] [--head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache


def batch(rows: int, layers: int, heads: int, dim: int, lengths: list[int]) -> list[BatchKVCache]:
    """A batch cache per layer holding `rows` sequences of the given lengths (bf16, random)."""
    out = []
    for layer in range(layers):
        caches = []
        for row, n in enumerate(lengths):
            c = KVCache()
            key = mx.random.key(layer * 1000 + row)
            c.update_and_fetch(mx.random.normal((1, heads, n, dim), key=key).astype(mx.bfloat16),
                               mx.random.normal((1, heads, n, dim), key=key).astype(mx.bfloat16))
            caches.append(c)
        out.append(BatchKVCache.merge(caches))
    mx.eval([c.state for c in out])
    return out


def by_extract(cache: list[BatchKVCache], rows: list[int]) -> float:
    """mlx-lm's way: one `extract` per row and layer, then one evaluation of all of them."""
    t0 = time.perf_counter()
    kept = [[c.extract(i) for c in cache] for i in rows]
    t1 = time.perf_counter()
    mx.eval([c.state for k in kept for c in k])
    return {"extract_s": t1 - t0, "eval_s": time.perf_counter() - t1}


def by_slices(cache: list[BatchKVCache], rows: list[int]) -> float:
    """The padding read once for every layer, then plain slices."""
    t0 = time.perf_counter()
    pads = [c.left_padding.tolist() for c in cache]
    kept = []
    for i in rows:
        layer_caches = []
        for c, pad in zip(cache, pads, strict=True):
            k = KVCache()
            k.keys = mx.contiguous(c.keys[i:i + 1, :, pad[i]:c._idx])
            k.values = mx.contiguous(c.values[i:i + 1, :, pad[i]:c._idx])
            k.offset = c._idx - pad[i]
            layer_caches.append(k)
        kept.append(layer_caches)
    t1 = time.perf_counter()
    mx.eval([c.state for k in kept for c in k])
    return {"slice_s": t1 - t0, "eval_s": time.perf_counter() - t1}


def main() -> None:
    """Build batches, time each way twice (new lengths, then the same lengths again), print JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args()
    report = {"device": str(mx.default_device()), "rows": args.rows, "layers": args.layers}
    for attempt, seed in (("new_lengths", 1), ("same_lengths", 1), ("other_new_lengths", 2)):
        lengths = [random.Random(seed * 100 + r).randrange(40, 400) for r in range(args.rows)]
        cache = batch(args.rows, args.layers, args.kv_heads, args.head_dim, lengths)
        report[f"extract_{attempt}"] = by_extract(cache, list(range(args.rows)))
        cache = batch(args.rows, args.layers, args.kv_heads, args.head_dim,
                      [n + 3 * (seed + 7) for n in lengths])  # lengths this way has not met either
        report[f"slices_{attempt}"] = by_slices(cache, list(range(args.rows)))
    print(json.dumps({k: ({kk: round(vv, 4) for kk, vv in v.items()} if isinstance(v, dict) else v)
                      for k, v in report.items()}, indent=1))


if __name__ == "__main__":
    main()
