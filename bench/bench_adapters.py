"""What applying a LoRA adapter to a resident model costs in the worker: memory (counted, MLX's, the process's)
and time, through the worker's own model manager.

    .venv/bin/python -m bench.bench_adapters [--model smollm2-135m] [--adapter smollm2-135m-pirate]

The adapter is taken from the adapter store (MLXQ_ADAPTERS_DIR); `mlxq models pull-demo` puts the demo one there.
"""

from __future__ import annotations

import argparse
import time

from jobs.adapters import adapter_entry
from jobs.contract import AdapterRef
from jobs.settings import load_settings
from jobs.store import resolve


def main() -> None:
    """Load the model as the worker does, apply the adapter, print what it took."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--adapter", default="smollm2-135m-pirate")
    args = parser.parse_args()
    import mlx.core as mx

    from workers import memory
    from workers.adapters import share_copy
    from workers.main import build_scheduler

    settings = load_settings()
    entry = adapter_entry(settings, args.adapter)
    if entry is None:
        raise SystemExit(f"adapter {args.adapter!r} is not in {settings.adapters_dir}: mlxq models pull-demo")
    info = resolve(args.model, settings)
    models = build_scheduler(settings, "bench-adapters").models
    base = models.get(info)
    print(f"{info.id}: {base.nbytes / 2**20:.1f} MiB, float32 {base.float32}, loaded in {base.load_s:.2f} s")
    mx.synchronize()
    active, rss = mx.get_active_memory(), memory.figures()["rss_bytes"]
    started = time.perf_counter()
    adapted = models.get(info, adapter=AdapterRef(entry.name, str(entry.path), entry.base))
    took = time.perf_counter() - started
    mx.synchronize()
    print(f"{entry.name}: counted {adapted.nbytes / 2**20:.2f} MiB; MLX active +{(mx.get_active_memory() - active) / 2**20:.2f}"
          f" MiB; process RSS +{(memory.figures()['rss_bytes'] - rss) / 2**20:.1f} MiB; applied in "
          f"{1000 * adapted.load_s:.0f} ms ({1000 * took:.0f} ms in all, mlx-lm's tuner imported)")
    started = time.perf_counter()
    share_copy(base.model)
    print(f"copying the model's modules alone (weights shared): {1000 * (time.perf_counter() - started):.1f} ms")


if __name__ == "__main__":
    main()
