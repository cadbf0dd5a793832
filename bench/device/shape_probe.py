"""What the first decode step at a batch size never met before costs on this device, against the steps
after it (MLX builds kernels per shape the first time it meets one, and keeps them on disk for later
processes). Runs the worker's DecodeBatch on a model for each size in turn, a fresh batch each time.

    python bench/device/shape_probe.py --model DIR [--sizes 64,21,24,63] [--steps 6] [--groups 3] [--beside MS]

Prints one JSON line per size: the first step's ms and the median of the others'. `--groups` joins the rows
in that many groups of different prompt lengths (as a burst of chats joins the worker's batch); `--beside MS`
runs a thread beside the steps that holds Python's lock for MS ms of pure-Python work every 10 ms (what the
worker's publishing and preparing threads do), to see whether the steps wait for it.
"""

from __future__ import annotations

import argparse
import json
import json as jsonlib
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from jobs.contract import Sampling  # noqa: E402
from workers.backends import sampling  # noqa: E402
from workers.backends.decoding import DecodeBatch, Joining  # noqa: E402


def busy_beside(ms: float, stop: threading.Event) -> None:
    """Hold Python's lock with pure-Python work for `ms` every 10 ms until stopped."""
    events = [{"type": "delta", "data": {"index": i, "content": "word " * 3}} for i in range(64)]
    while not stop.is_set():
        until = time.perf_counter() + ms / 1000
        while time.perf_counter() < until:
            jsonlib.dumps(events)
        time.sleep(max(0.0, 0.01 - ms / 1000))


def probe(model, tokenizer, size: int, steps: int, temperature: float, groups: int = 1) -> dict:
    """Decode `steps` steps of a fresh batch of `size` sequences; each step's wall time (the last one
    waited for)."""
    vocab = model.args.vocab_size
    batch = DecodeBatch(model, vocab, set())
    joining = []
    for i in range(size):
        group = i * groups // size
        ids = tokenizer.encode(f"Request {i}: write a long story about the sea, number {i}." + " And more." * 8 * group)
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        mx.eval([c.state for c in cache])
        row = sampling.row_for(Sampling(temperature=temperature), vocab)
        joining.append(Joining(object(), cache, ids[:-1], ids[-1], steps + 2, row))
    for g in range(groups):  # each group joins at a step of its own, as bursts of chats do
        batch.insert_many([j for i, j in enumerate(joining) if i * groups // size == g])
        if g < groups - 1:
            batch.step()
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
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--beside", type=float, default=0.0, metavar="MS")
    args = parser.parse_args()
    model, tokenizer = load(str(args.model))
    stop = threading.Event()
    if args.beside:
        threading.Thread(target=busy_beside, args=(args.beside, stop), daemon=True).start()
    for size in map(int, args.sizes.split(",")):
        result = probe(model, tokenizer, size, args.steps, args.temperature, args.groups)
        print(json.dumps({**result, "groups": args.groups, "beside_ms": args.beside}), flush=True)
    stop.set()


if __name__ == "__main__":
    main()
