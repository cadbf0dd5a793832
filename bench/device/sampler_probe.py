"""What a batch's sampling adds to a decode step on this device, with no server around it: the worker's DecodeBatch on
a model loaded as the worker loads it (float32 on a CPU, projections joined on CUDA), timed in alternating blocks of steps in one process:
- `greedy` rows against `sampled` rows (`--temperature`, 0.7, and `--top-p`, none, by default; on a CPU also
  `sampled_mlx`: the same rows drawing with MLX's kernels instead of the host's numpy) and issue 31's `mixed` rows (greedy, temperature 1, top_p, top_k, a repetition and a presence
  penalty, a seed, in turn), and `mixed_plain`: the same rows with the filters' arithmetic and the repetition penalty
  run uncompiled (sampling.cut_points and sampling.repetition as before they were compiled);
- one row under bench_structured's JSON schema (`json_1`) against one free greedy row (`free_1`); with
  `--grammar-parts`, what of the difference is whose: `free_read_1` reads its tokens back each step as a grammar's
  row does (its forward pass queued first) but applies no mask, `json_fixed_1` applies the same all-allowing mask
  every step (no llguidance), so json_1 - json_fixed_1 is llguidance's mask, json_fixed_1 - free_read_1 the mask's
  upload and application, free_read_1 - free_1 the read-back; `json_fixed_plain_1` applies it uncompiled.

    python bench/device/sampler_probe.py --model DIR [--sizes 32,64] [--steps 30] [--blocks 5] [--grammar-parts]
        [--out F]
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
import numpy as np  # noqa: E402

from bench.bench_decode import MIX, batch_of  # noqa: E402
from bench.bench_structured import STORY  # noqa: E402
from bench.bench_text import reexec_with_worker_blas  # noqa: E402
from jobs.contract import Sampling  # noqa: E402
from web.structured import grammar_for  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch  # noqa: E402
from workers.backends.grammar import GrammarProcessor  # noqa: E402
from workers.backends.text import TextBackend  # noqa: E402

COMPILED = ("cut_points", "repetition", "allowed_only")


class Fixed:
    """A grammar's stand-in: the same mask every step (`words`, packed as GrammarProcessor's), or None (any token)."""

    error = None

    def __init__(self, words):
        self.words = words

    def mask_words(self, last):
        """The mask, whatever the last token."""
        return self.words


def block(batch: DecodeBatch, steps: int, plain: bool) -> float:
    """Milliseconds a step over `steps` steps (with `plain`, the compiled parts run uncompiled)."""
    saved = {name: getattr(sampling, name) for name in COMPILED}
    if plain:
        for name in COMPILED:
            setattr(sampling, name, saved[name].plain)
    try:
        batch.step()
        began = time.perf_counter()
        for _ in range(steps):
            batch.step()
        return 1000 * (time.perf_counter() - began) / steps
    finally:
        for name, fn in saved.items():
            setattr(sampling, name, fn)


def main() -> None:
    """Build every variant's batch, time them in alternating blocks, print the medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sizes", default="32,64")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--grammar-parts", action="store_true",
                        help="also free_read_1 and json_fixed_1: the parts of a constrained row's step")
    parser.add_argument("--temperature", type=float, default=0.7, help="the sampled rows' (default 0.7)")
    parser.add_argument("--top-p", type=float, default=1.0, help="the sampled rows' (default 1: none)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reexec_with_worker_blas()  # on a CPU, the BLAS the worker picks
    on_cpu = mx.default_device() == mx.cpu
    model, tokenizer = TextBackend().load(args.model, float32=on_cpu)  # as the worker: float32 on a CPU, joined on CUDA
    vocab = model.args.vocab_size
    budget = (args.blocks + 1) * (args.steps + 1) + 8
    greedy = lambda i: sampling.row_for(Sampling(temperature=0.0), vocab)  # noqa: E731
    sampled = lambda i: sampling.row_for(Sampling(temperature=args.temperature, top_p=args.top_p), vocab)  # noqa: E731
    mixed = lambda i: sampling.row_for(Sampling(**MIX[i % len(MIX)]), vocab)  # noqa: E731
    grammar = grammar_for(STORY)
    constrained = lambda i: sampling.row_for(Sampling(temperature=0.0), vocab,  # noqa: E731
                                             grammar=GrammarProcessor(grammar, tokenizer, vocab))
    variants = {}
    for size in (int(s) for s in args.sizes.split(",")):
        variants[f"greedy_{size}"] = (batch_of(model, tokenizer, size, greedy, budget), False)
        variants[f"sampled_{size}"] = (batch_of(model, tokenizer, size, sampled, budget), False)
        if on_cpu:  # the same rows drawing with MLX's kernels, as on a GPU (the host's numpy draw is a CPU's default)
            variants[f"sampled_mlx_{size}"] = (batch_of(model, tokenizer, size, sampled, budget), False)
            variants[f"sampled_mlx_{size}"][0].sampler.host = False
        variants[f"mixed_{size}"] = (batch_of(model, tokenizer, size, mixed, budget), False)
        variants[f"mixed_plain_{size}"] = (batch_of(model, tokenizer, size, mixed, budget), True)
    variants["free_1"] = (batch_of(model, tokenizer, 1, greedy, budget), False)
    variants["json_1"] = (batch_of(model, tokenizer, 1, constrained, budget, tokenizer.encode("{")[-1]), False)
    if args.grammar_parts:
        words = np.full(-(-vocab // 32), 0xFFFFFFFF, np.uint32)
        for name, stand_in in (("free_read_1", Fixed(None)), ("json_fixed_1", Fixed(words))):
            row = lambda i, g=stand_in: sampling.row_for(Sampling(temperature=0.0), vocab, grammar=g)  # noqa: E731
            variants[name] = (batch_of(model, tokenizer, 1, row, budget), False)
        variants["json_fixed_plain_1"] = (batch_of(model, tokenizer, 1, row, budget), True)  # (row: json_fixed_1's)
    for batch, plain in variants.values():  # first sight of each kind of work: kernels built, not timed
        block(batch, 2, plain)
    times = {name: [] for name in variants}
    names = list(variants)
    for b in range(args.blocks):
        for name in names[b % len(names):] + names[:b % len(names)]:
            batch, plain = variants[name]
            times[name].append(block(batch, args.steps, plain))
    ms = {name: statistics.median(t) for name, t in times.items()}
    ratios = {}
    for size in (int(s) for s in args.sizes.split(",")):
        ratios[f"sampled_vs_greedy_{size}"] = ms[f"greedy_{size}"] / ms[f"sampled_{size}"]
        if on_cpu:
            ratios[f"sampled_mlx_vs_greedy_{size}"] = ms[f"greedy_{size}"] / ms[f"sampled_mlx_{size}"]
        ratios[f"mixed_vs_greedy_{size}"] = ms[f"greedy_{size}"] / ms[f"mixed_{size}"]
        ratios[f"mixed_plain_vs_greedy_{size}"] = ms[f"greedy_{size}"] / ms[f"mixed_plain_{size}"]
    ratios["json_vs_free_1"] = ms["free_1"] / ms["json_1"]
    if args.grammar_parts:
        ratios["ms_llguidance"] = ms["json_1"] - ms["json_fixed_1"]
        ratios["ms_mask_applied"] = ms["json_fixed_1"] - ms["free_read_1"]
        ratios["ms_read_back"] = ms["free_read_1"] - ms["free_1"]
        ratios["ms_mask_compiled_saves"] = ms["json_fixed_plain_1"] - ms["json_fixed_1"]
    report = {"device": str(mx.default_device()), "model": str(args.model),
              "steps": args.steps, "blocks": args.blocks, "ms_per_step": ms,
              "blocks_ms": {k: [round(x, 3) for x in v] for k, v in times.items()},
              "tokens_per_s_ratios": ratios, "date": time.strftime("%Y-%m-%d %H:%M")}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
