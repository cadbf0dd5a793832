"""gunicorn hooks (`--config python:web.gunicorn_conf`): prometheus_client's multiprocess mode, and each
worker's connections opened as it boots.

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


def post_worker_init(worker) -> None:
    """A worker has loaded the app: subscribe its event hub and open its Redis connection now, not during its
    first call (the first synchronous call each web worker served took ~20 ms more without this)."""
    services = worker.wsgi.extensions.get("mlxq") if hasattr(worker.wsgi, "extensions") else None
    if services is not None and not services.warm():
        worker.log.warning("Redis did not answer while this web worker started; its first call connects")


def child_exit(server, worker) -> None:
    """A worker process ended: its live gauges no longer count (counters keep their totals)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def on_exit(server) -> None:
    """Remove the directory made in on_starting."""
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)
