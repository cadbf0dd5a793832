"""The worker process's memory: MLX's buffer cache bounded within the memory budget, the figures operators see
(resident memory, MLX's active, cached and peak bytes), and freed memory handed back to the system when idle.

MLX keeps freed buffers for reuse. On a GPU its cache may grow to the device's memory limit unless bounded (a
worker that once ran work of many shapes keeps that memory for good); on a CPU it is small (32 MiB) and the
arrays come from glibc's malloc, whose free pages stay in the process until trimmed.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import resource
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_FRACTION = 1 / 16
"""Share of the memory budget MLX's buffer cache may hold on a GPU when settings.cache_limit_mb is -1 (3.5 GiB
of an H100's default budget of 56): enough to reuse a decode step's buffers, small beside the models and KV
caches it is taken from. MLX's own limit there is most of the device: on the H100 work of changing shapes left
49 GiB cached (docs/performance.md)."""

CPU_CACHE_BYTES = 32 * 2**20
"""The most MLX's buffer cache holds on a CPU when settings.cache_limit_mb is -1 (MLX's own default there).
There the arrays come from malloc, which keeps freed pages itself: a cache of a sixteenth of the budget
(1 GiB) raised the worker's resident memory under a mixed load by 450 MiB, for no speed (docs/performance.md)."""

MAX_CACHE_FRACTION = 0.5
"""A configured cache limit above this share of the budget is refused: it would leave models too little."""


def cache_limit_bytes(cache_limit_mb: int, budget_bytes: int, device: str) -> int:
    """settings.cache_limit_mb in bytes (-1: CACHE_FRACTION of the budget, at most CPU_CACHE_BYTES on a CPU);
    ValueError if it takes more than MAX_CACHE_FRACTION of the budget."""
    if cache_limit_mb < 0:
        share = int(budget_bytes * CACHE_FRACTION)
        return min(share, CPU_CACHE_BYTES) if device == "cpu" else share
    limit = cache_limit_mb * 2**20
    if limit > budget_bytes * MAX_CACHE_FRACTION:
        raise ValueError(f"MLXQ_CACHE_LIMIT_MB={cache_limit_mb} is more than half of the worker's memory budget "
                         f"({budget_bytes / 2**20:.0f} MiB): lower it or raise MLXQ_MEMORY_BUDGET_MB")
    return limit


def limit_cache(limit_bytes: int) -> None:
    """Bound MLX's buffer cache (freed buffers beyond it go back at once)."""
    import mlx.core as mx

    mx.set_cache_limit(limit_bytes)


def _proc_status() -> dict[str, int]:
    """VmRSS and VmHWM from /proc/self/status, in bytes (empty off Linux)."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    return {name: int(rest.split()[0]) * 1024 for name, _, rest in (line.partition(":") for line in lines)
            if name in ("VmRSS", "VmHWM")}


def figures() -> dict[str, int]:
    """The process's resident memory now and at its highest, and MLX's active, cached and peak bytes."""
    import mlx.core as mx

    status = _proc_status()
    # ru_maxrss: KiB on Linux, bytes on macOS; it stands in where /proc is missing.
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"rss_bytes": status.get("VmRSS", maxrss), "rss_peak_bytes": status.get("VmHWM", maxrss),
            "mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": mx.get_peak_memory()}


def _malloc_trim() -> bool:
    """glibc's malloc_trim(0): free heap pages back to the system; False where there is none (macOS, musl)."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except AttributeError:
        return False


def release() -> None:
    """Hand freed memory back to the system: MLX's buffer cache, then malloc's free pages."""
    import mlx.core as mx

    mx.clear_cache()
    _malloc_trim()


def freeze_heap() -> None:
    """Collect, then put every object alive now (modules, models, tokenizers, templates) out of the cycle
    collector's sight, so that its full collections look at what requests made since.

    A full collection over a worker holding just the demo text model took 62 ms on the 2-core machine, every
    thread of the process stopped meanwhile: a request that met one waited that long in its queue or before its
    first token (seen on the H100 as a 57 ms queue wait of a short chat, once every few rounds of the fairness
    bench). After the freeze, one took 0.0 ms. The models manager calls this after each load."""
    gc.collect()
    gc.freeze()


def collect_all() -> None:
    """A full collection that sees the frozen objects too (after a model is dropped: its cycles go now), then the
    survivors frozen again."""
    gc.unfreeze()
    freeze_heap()


IDLE_BEATS = 2
"""Heartbeats in a row that must find the worker idle before it hands memory back: a gap between two requests
of a steady stream is not idleness, and the next request would pay to get the pages back."""


class IdleRelease:
    """Calls release() once each time the worker has gone idle (fed the heartbeat's busy/idle view)."""

    def __init__(self, release_fn=release, idle_beats: int = IDLE_BEATS):
        self.release_fn, self.idle_beats = release_fn, idle_beats
        self.dirty = False  # work ran since the last release
        self.idle = 0  # heartbeats in a row that found the worker idle

    def beat(self, busy: bool) -> bool:
        """One heartbeat's view; True if it released memory now."""
        self.idle = 0 if busy else self.idle + 1
        self.dirty = self.dirty or busy
        if not self.dirty or self.idle < self.idle_beats:
            return False
        self.dirty = False
        started = time.perf_counter()
        try:
            self.release_fn()
        except Exception:  # best effort, on the heartbeat's thread: a failure here must not stop the beats
            log.exception("could not hand memory back")
            return False
        log.debug("idle: memory handed back in %.1f ms", (time.perf_counter() - started) * 1000)
        return True
