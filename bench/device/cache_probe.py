"""MLX's buffer cache on this device, as the worker uses it (workers/memory.py): the default cache limit, how far
the cache grows over work of changing shapes with and without a bound, what emptying it costs, and whether
emptying it from another thread (the worker's heartbeat) while the main thread computes is safe.

    python bench/device/cache_probe.py [--seconds 20]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import threading
import time

import mlx.core as mx

GIB = 2**30


def work(step: int) -> mx.array:
    """One step of decode-like work whose shapes change with `step` (as prompts and batches do)."""
    n = 256 + (step * 97) % 2048  # a sequence length between 256 and 2304
    q = mx.random.normal((4, 8, n, 64), key=mx.random.key(step))
    scores = mx.softmax((q @ q.transpose(0, 1, 3, 2)) / 8.0, axis=-1)
    return (scores @ q).sum()


def grow(limit: int | None, steps: int) -> dict:
    """Run `steps` steps under a cache limit (None: MLX's default); the cache and peak afterwards."""
    mx.clear_cache()
    mx.reset_peak_memory()
    previous = mx.set_cache_limit(limit) if limit is not None else None
    started = time.perf_counter()
    for step in range(steps):
        mx.eval(work(step))
    out = {"limit_gib": None if limit is None else limit / GIB, "run_s": time.perf_counter() - started,
           "cache_gib": mx.get_cache_memory() / GIB,
           "peak_gib": mx.get_peak_memory() / GIB, "active_gib": mx.get_active_memory() / GIB}
    started = time.perf_counter()
    mx.clear_cache()
    out["clear_ms"] = (time.perf_counter() - started) * 1000
    if previous is not None:
        mx.set_cache_limit(previous)
    return out


def concurrent_clear(seconds: float, shapes: int) -> dict:
    """The main thread computes (checking each answer against a first computation) while another thread
    empties the cache and trims malloc every 5 ms."""
    reference = {step: work(step).item() for step in range(shapes)}
    stop, clears = threading.Event(), [0]
    trim = ctypes.CDLL(None).malloc_trim

    def clearer():
        while not stop.wait(0.005):
            mx.clear_cache()
            trim(0)
            clears[0] += 1

    thread = threading.Thread(target=clearer)
    thread.start()
    steps = mismatches = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            expected = reference[steps % shapes]
            mismatches += abs(work(steps % shapes).item() - expected) > 1e-3 * max(1.0, abs(expected))
            steps += 1
    finally:
        stop.set()
        thread.join()
    return {"steps": steps, "clears": clears[0], "mismatches": int(mismatches)}


def main() -> None:
    """Print the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--shapes", type=int, default=32, help="distinct shapes in the concurrent check")
    args = parser.parse_args()
    default_limit = mx.set_cache_limit(mx.get_memory_limit())
    mx.set_cache_limit(default_limit)
    report = {"device": str(mx.default_device()), "memory_limit_gib": mx.get_memory_limit() / GIB,
              "default_cache_limit_gib": default_limit / GIB,
              "warm-up": grow(None, args.steps), "unbounded": grow(None, args.steps),
              "bounded_1gib": grow(GIB, args.steps), "unbounded_again": grow(None, args.steps),
              "concurrent_clear": concurrent_clear(args.seconds, args.shapes)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
