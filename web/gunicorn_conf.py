"""gunicorn hooks (`--config python:web.gunicorn_conf`): prometheus_client's multiprocess mode.

The master makes a fresh directory for the workers' metric files before forking them (unless
PROMETHEUS_MULTIPROC_DIR is already set), marks a dead worker's gauges gone, and removes the
directory it made on exit.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_made: list[str] = []


def on_starting(server) -> None:
    """Before any worker starts: a metrics directory of this master's own."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        path = tempfile.mkdtemp(prefix="mlxq-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        _made.append(path)


def child_exit(server, worker) -> None:
    """A worker process ended: its live gauges no longer count (counters keep their totals)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server) -> None:
    """Remove the directory made in on_starting."""
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
