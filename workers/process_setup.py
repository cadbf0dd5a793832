"""Process-wide settings the worker applies at start: MLX's environment (before MLX loads) and, on a GPU,
glibc's malloc.

Both are for a process that runs for weeks and serves work of every shape and size: MLX's defaults and
glibc's suit a script that runs one model on one input.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

MLX_ENVIRONMENT = {
    # MLX's CUDA backend keeps LRU caches keyed by shape (cuDNN attention and convolution plans, cuFFT plans,
    # CUDA graphs) and counts every miss over the process's life: past twice a cache's size it throws on each
    # further miss ("Cache thrashing is happening"). On the H100 a process that had run attention over 513
    # prompt lengths failed on the 514th; with this off, all 600 ran (bench/NOTES.md at 521c3a7). A worker
    # serves prompts and audio of every length; evicting and rebuilding a plan only costs time. MLX reads it
    # as it loads.
    "MLX_ENABLE_CACHE_THRASHING_CHECK": "0",
    # Prompt processing's attention through MLX's own kernels, not cuDNN's: cuDNN builds (and compiles, with
    # NVRTC) an execution plan for each new shape of batch, chunk and cached length, and a worker meets a new
    # one with nearly every prompt. On the H100 (2026-11-27, py-spy of the worker) prompt turns waited on
    # `nvrtcCompileProgram` under cuDNN's plan finalization; with this off, the fairness bench's short chat was
    # within its limit beside two long prompts in 9 rounds of 10 over two runs (with it on: max 63 ms against 47).
    # cuDNN's attention is faster once its plan exists (a 512-token turn after 3,488 tokens: 6.6 ms against 11.1).
    "MLX_CUDA_USE_CUDNN_SDPA": "0",
}
"""MLX settings the worker starts with unless the operator's environment sets them."""

MMAP_THRESHOLD_BYTES = 128 * 1024
"""On a GPU worker, blocks at least this large come straight from mmap and go back to the system when freed
(glibc's M_MMAP_THRESHOLD).

glibc's threshold starts here too but rises to the size of each large block freed (up to 32 MiB), after which
the audio and buffers of every batch come from the main heap and fragment it: on the H100 the worker's heap grew
by about 230 MiB over its first two hours of batched audio, then stayed. Fixed, the peak grew 38-63 MiB from a
30- to a 120-minute job instead of 272 (bench/NOTES.md at 521c3a7). Not on a CPU: there MLX's arrays are
malloc'd too, and each one would get fresh pages from the kernel (Whisper's sequential path took 1.6x as long)."""

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def apply(environ=os.environ) -> None:
    """Set MLX_ENVIRONMENT in `environ` where the operator has not (call it before MLX loads)."""
    if "mlx.core" in sys.modules:  # too late for the environment: MLX has read it
        log.warning("MLX was loaded before the worker's settings: %s not applied", ", ".join(MLX_ENVIRONMENT))
    for name, value in MLX_ENVIRONMENT.items():
        environ.setdefault(name, value)


def fix_mmap_threshold(backend: str, environ=os.environ) -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES on a GPU `backend`, unless the operator set
    MALLOC_MMAP_THRESHOLD_ (or this is not glibc); whether it was set here."""
    if backend == "cpu" or "MALLOC_MMAP_THRESHOLD_" in environ or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # a libc without mallopt (musl)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
