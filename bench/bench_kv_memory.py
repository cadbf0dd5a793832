"""KV-cache quantization on the demo model: how many 2,048-token sequences fit a fixed KV budget with keys and
values in the model's dtype, at 8 and at 4 bits, from the sizes of real caches; and what it costs in quality
(greedy texts and token agreement against unquantized caches on the same prompts).

    .venv/bin/python -m bench.bench_kv_memory [--kv-mb 1024] [--tokens 32] [--out report.json]

The model is loaded as this worker holds it (float32 on a Linux CPU that upcasts small models: 32-bit keys and
values), with the BLAS the worker picks. Each cache is built the worker's way: a 2,048-token prompt processed
in 512-token chunks into the caches a batch gives it (workers/backends/quantized_kv.py), four of them merged
into one batch cache; its bytes are what the arrays hold, checked against what the worker's budget counts per
token (workers/backends/textbatch.py's kv_bytes_per_token). The same caches in float16 (what a GPU worker
holds: 16-bit keys and values) are filled with random keys and values of the model's shapes instead (float16
arithmetic on a CPU is too slow for a 2,048-token prompt), merged the same way. Quality is measured on the
float32 model.
"""

from __future__ import annotations

import argparse
import os
import platform as host
import sys
import time
from pathlib import Path

MODEL = "smollm2-135m"
SEQUENCE = 2048
CHUNK = 512
SYSTEM = {"role": "system", "content": "You are a patient teacher who answers in plain words, briefly."}
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?", "What do bees make?",
             "Count from one to five.", "What is rain?", "Write a haiku about the sea.",
             "Explain what a computer does in two sentences."]


def reexec_with_worker_blas() -> None:
    """Run with the BLAS the worker picks for itself (LD_PRELOAD takes effect only at start)."""
    from workers.platform import choose_blas

    choice = choose_blas()
    if not choice.active() and not os.environ.get("MLXQ_BENCH_REEXEC"):
        os.execve(sys.executable, [sys.executable, "-m", "bench.bench_kv_memory", *sys.argv[1:]],
                  {**choice.env(os.environ), "MLXQ_BENCH_REEXEC": "1"})


def load(float32: bool):
    """The demo model (and its tokenizer), upcast to float32 or in its stored dtype."""
    from jobs.settings import load_settings
    from jobs.store import resolve
    from workers.backends.text import TextBackend

    return TextBackend().load(resolve(MODEL, load_settings()).path, float32)


def sequence_bytes(model, kv, tokens: list[int], dtype=None) -> tuple[int, int]:
    """(bytes of one sequence's cache after `tokens`, bytes per sequence of four merged into a batch cache).

    With `dtype`, the caches are filled with random keys and values of the model's shapes in that dtype instead
    of running the model (float16 arithmetic on a CPU took minutes for one 2,048-token prompt): the same arrays."""
    import mlx.core as mx

    from workers.backends.quantized_kv import head_dims, make_cache

    cache = make_cache(model, kv)
    shape = (1, model.args.num_key_value_heads, CHUNK, head_dims(model))
    for start in range(0, len(tokens), CHUNK):
        if dtype is None:
            model(mx.array(tokens[start:start + CHUNK])[None], cache=cache)
        else:
            for c in cache:
                c.update_and_fetch(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
        mx.eval([c.state for c in cache])
    one = sum(c.nbytes for c in cache)
    batch = [type(layer).merge([layer] * 4) for layer in cache]
    mx.eval([c.state for c in batch])
    return one, sum(c.nbytes for c in batch) // 4


def greedy(model, ids: list[int], kv, n: int) -> list[int]:
    """`n` greedy tokens after a prompt, on the caches a batch gives a sequence (quantized or not)."""
    import mlx.core as mx

    from workers.backends.quantized_kv import make_cache

    cache = make_cache(model, kv)
    logits = model(mx.array(ids)[None], cache=cache)[0, -1]
    out = []
    for _ in range(n):
        out.append(mx.argmax(logits).item())
        logits = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens two answers share from their start."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    """Print (and with --out write) the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-mb", type=int, default=1024, help="memory the budget leaves for KV caches (MiB)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt for the quality check")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    reexec_with_worker_blas()
    import mlx.core as mx

    from bench.common import write_report
    from jobs.kv_quant import KVQuant
    from workers.backends import textgen
    from workers.backends.textbatch import kv_bytes_per_token

    print(f"{MODEL}; {host.processor() or host.machine()}, {os.cpu_count()} cores; mlx {mx.__version__}; "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}")
    room = args.kv_mb * 2**20
    settings = {"unquantized": None, "8": KVQuant(8, 64), "4": KVQuant(4, 64)}
    report = {"model": MODEL, "kv_mb": args.kv_mb, "sequence_tokens": SEQUENCE, "memory": {}, "quality": {}}
    print(f"\nKV budget {args.kv_mb} MiB, sequences of {SEQUENCE} tokens:")
    print(f"{'model dtype':>12} {'KV bits':>8} {'MiB/sequence':>13} {'budget counts':>14} {'fit at once':>12} "
          f"{'vs unquantized':>15}")
    model, tokenizer = load(True)
    for float32 in (False, True):
        dtype = "float32" if float32 else "float16"
        prompt = (textgen.text_prompt(tokenizer, " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog."
                                                          for i in range(400))) * 2)[:SEQUENCE]
        base = None
        for name, kv in settings.items():
            one, in_batch = sequence_bytes(model, kv, prompt, None if float32 else mx.float16)
            counted = kv_bytes_per_token(model, float32, kv) * SEQUENCE
            fit = room // max(one, in_batch)
            base = base or fit
            bits = str(kv.bits) if kv else ("32" if float32 else "16")
            report["memory"][f"{dtype} {bits}"] = {"bytes_per_sequence": one, "bytes_per_sequence_in_batch": in_batch,
                                                   "budget_counts": counted, "fit": fit, "ratio": fit / base}
            print(f"{dtype:>12} {bits:>8} {one / 2**20:>13.2f} {counted / 2**20:>14.2f} {fit:>12} {fit / base:>14.2f}x")
            assert counted == one == in_batch, (name, counted, one, in_batch)
    print(f"\nQuality: {args.tokens} greedy tokens per prompt (chat with a system prompt), against unquantized:")
    report["quality"] = {name: [] for name in list(settings)[1:]}
    for question in QUESTIONS:
        ids = textgen.chat_prompt(tokenizer, [SYSTEM, {"role": "user", "content": question}])
        reference = greedy(model, ids, None, args.tokens)
        print(f"\n{question}\n  16: {tokenizer.decode(reference)!r}")
        for name, kv in list(settings.items())[1:]:
            tokens = greedy(model, ids, kv, args.tokens)
            same = sum(a == b for a, b in zip(tokens, reference, strict=True))
            prefix = common_prefix(tokens, reference)
            report["quality"][name].append({"prompt": question, "text": tokenizer.decode(tokens), "prefix": prefix,
                                            "same_positions": same})
            print(f"  {name:>2}: {tokenizer.decode(tokens)!r}\n      same first {prefix} tokens, "
                  f"{same}/{args.tokens} positions")
    print("\nSummary:")
    for name, rows in report["quality"].items():
        first16 = sum(r["prefix"] >= 16 for r in rows)
        mean = sum(r["prefix"] for r in rows) / len(rows)
        print(f"  {name} bits: first 16 tokens identical on {first16}/{len(rows)} prompts; identical prefix "
              f"{mean:.1f} tokens on average (of {args.tokens})")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
