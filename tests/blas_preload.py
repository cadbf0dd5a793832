"""A pytest plugin (loaded with -p, before output capture starts) that re-runs pytest with fast BLAS.

The mlx[cpu] wheel's bundled BLAS is ~25x slower than OpenBLAS on Linux, and a library can only be
swapped in by LD_PRELOAD at process start; this makes the test process pick what the worker picks
(workers.platform: measured once, then cached).
"""

from __future__ import annotations

import os
import sys

_MARK = "MLXQ_TESTS_BLAS_DONE"


def _reexec_with_fast_blas() -> None:
    """Replace this process with the same pytest command and the chosen BLAS preloaded."""
    if os.environ.get(_MARK):
        return
    os.environ[_MARK] = "1"
    from workers.platform import choose_blas

    choice = choose_blas()
    if choice.active():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]], choice.env(os.environ))


_reexec_with_fast_blas()
