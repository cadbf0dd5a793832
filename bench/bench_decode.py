"""Decode engine benchmark: mlxq's batch decode loop against mlx-lm's BatchGenerator, in one process.

No server, no HTTP, no Redis: N sequences with short prompts of their own decode `--max-tokens` tokens
each, all inserted at once; the figure is generated tokens over the wall time from the first step to
the last token (after an unmeasured warm-up round per shape, which MLX's kernel builds need). Workloads:
greedy; sampled (temperature 0.7); mixed (per sequence, in turn: greedy, temperature 1, 0.7 with
top_p 0.9, 0.8 with top_k 40, 0.9 with repetition_penalty 1.1, 1.0 with presence_penalty 0.5, a
seeded 0.8). Contestants:
- `mlxq`: workers/backends/decoding.py's DecodeBatch (one sampling computation for all rows);
- `engine_shared`: mlx-lm's BatchGenerator with one sampler shared by every row (its ceiling; for
  mixed, one sampler at temperature 0.7 and top_p 0.9 stands in for the spread);
- `engine_per_row`: BatchGenerator with a sampler per row (what mlxq did before: row-by-row sampling).

    python bench/bench_decode.py --model DIR [--n 8,32,64] [--max-tokens 128] [--rounds 2] [--out F]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import BatchGenerator  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

from bench.common import write_report  # noqa: E402
from jobs.contract import Sampling  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch  # noqa: E402

MIX = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
       dict(temperature=0.8, top_k=40), dict(temperature=0.9, repetition_penalty=1.1),
       dict(temperature=1.0, presence_penalty=0.5), dict(temperature=0.8, seed=7)]


def settings(workload: str, i: int) -> dict:
    """The sampling settings of sequence i of a workload."""
    return {"greedy": dict(temperature=0.0), "sampled": dict(temperature=0.7)}.get(workload) or MIX[i % len(MIX)]


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [tokenizer.encode(f"Request {i}: write a long story about the sea, number {i}.") for i in range(n)]


def batch_of(model, tokenizer, n: int, row_of, budget: int, first: int | None = None) -> DecodeBatch:
    """A DecodeBatch of n sequences with prompts of their own (`prompts`), no end of sequence (each runs its
    budget), row i's sampling `row_of(i)`; each one's first token its prompt's last, standing in for one drawn
    before joining (or `first`: one a grammar allows)."""
    batch = DecodeBatch(model, model.args.vocab_size, set())
    for i, ids in enumerate(prompts(tokenizer, n)):
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        batch.insert(object(), cache, ids[:-1], ids[-1] if first is None else first, budget, row_of(i))
    return batch


def run_mlxq(model, tokenizer, workload: str, n: int, max_tokens: int) -> float:
    """Tokens per second of DecodeBatch for n sequences."""
    vocab = model.args.vocab_size
    batch = batch_of(model, tokenizer, n, lambda i: sampling.row_for(Sampling(**settings(workload, i)), vocab),
                     max_tokens + 1)  # (the first token is not counted here)
    began, tokens = time.perf_counter(), 0
    while len(batch):
        out = batch.step()
        tokens += len(out)
        done = [t.key for t in out if t.finish_reason]
        if done:
            batch.remove(done)
    return tokens / (time.perf_counter() - began)


def run_engine(model, tokenizer, workload: str, n: int, max_tokens: int, shared: bool) -> float:
    """Tokens per second of mlx-lm's BatchGenerator for n sequences."""
    gen = BatchGenerator(model, stop_tokens=[], completion_batch_size=n, prefill_batch_size=n)
    if shared:
        common = make_sampler(temp=0.0 if workload == "greedy" else 0.7, top_p=0.9 if workload == "mixed" else 0.0)
        samplers, processors = [common] * n, None
    else:
        each = [settings(workload, i) for i in range(n)]
        samplers = [make_sampler(temp=s.get("temperature", 0.0), top_p=s.get("top_p", 0.0), top_k=s.get("top_k", 0))
                    for s in each]
        processors = [make_logits_processors(repetition_penalty=s.get("repetition_penalty"),
                                             presence_penalty=s.get("presence_penalty")) for s in each]
    gen.insert(prompts(tokenizer, n), max_tokens=[max_tokens] * n, samplers=samplers, logits_processors=processors)
    began, tokens, left = None, 0, n
    while left:
        _, responses = gen.next()
        if responses and began is None:  # prompt processing is over: decoding starts
            began = time.perf_counter()
        tokens += len(responses)
        left -= sum(r.finish_reason is not None for r in responses)
    gen.close()
    return tokens / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--n", default="8,32,64")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default="greedy,sampled,mixed")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    contestants = {"mlxq": lambda w, n: run_mlxq(model, tokenizer, w, n, args.max_tokens),
                   "engine_shared": lambda w, n: run_engine(model, tokenizer, w, n, args.max_tokens, True),
                   "engine_per_row": lambda w, n: run_engine(model, tokenizer, w, n, args.max_tokens, False)}
    report = {"model": str(args.model), "max_tokens": args.max_tokens, "device": str(mx.default_device()),
              "results": {}}
    for n in (int(x) for x in args.n.split(",")):
        for workload in args.workloads.split(","):
            figures = {}
            for name, run in contestants.items():
                run(workload, n)  # warm-up: kernels for this shape
                rounds = [run(workload, n) for _ in range(args.rounds)]
                figures[name] = {"tps": statistics.median(rounds), "rounds": rounds}
            mlxq = figures["mlxq"]["tps"]
            figures["ratios"] = {f"mlxq_vs_{k}": mlxq / v["tps"] for k, v in figures.items() if k != "mlxq"}
            report["results"][f"{workload}/{n}"] = figures
            print(workload, n, {k: round(v["tps"]) for k, v in figures.items() if "tps" in v},
                  {k: round(v, 3) for k, v in figures["ratios"].items()}, flush=True)
    for n in (int(x) for x in args.n.split(",")):
        greedy = report["results"].get(f"greedy/{n}", {}).get("mlxq", {}).get("tps")
        for workload in ("sampled", "mixed"):
            if greedy and f"{workload}/{n}" in report["results"]:
                ratio = report["results"][f"{workload}/{n}"]["mlxq"]["tps"] / greedy
                report["results"][f"{workload}/{n}"]["ratios"]["mlxq_vs_mlxq_greedy"] = ratio
                print(f"mlxq {workload} / greedy at {n}: {ratio:.3f}")
    write_report(report, args.out)


if __name__ == "__main__":
    main()
