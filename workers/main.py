"""The worker entry point (`python -m workers.main`, `mlxq worker`): one process that owns MLX.

Start-up: settings, the platform choice (re-exec with a faster BLAS on Linux CPUs), failing the
interactive jobs a dead worker left behind, warming the default model, then an RQ SimpleWorker (no
fork: the models stay resident) on `interactive` then `batch`. A heartbeat thread keeps the liveness
key and the running job's RQ heartbeat fresh. SIGTERM is RQ's warm shutdown: the job in progress
finishes, then the process exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid

import redis
from rq import SimpleWorker
from rq.job import Job
from rq.job_lifecycle import record_job_failure
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from jobs import keys, spool
from jobs.connection import get_redis
from jobs.events import EventPublisher, has_ended
from jobs.queues import INTERACTIVE, WORKER_QUEUES, get_queue
from jobs.settings import Settings, load_settings
from jobs.status import fetch_job
from jobs.store import ModelNotFound, resolve
from workers import platform
from workers.recovery import clean_spool, recover_batch_jobs
from workers.registry import ModelTooLarge
from workers.rqworker import Worker

log = logging.getLogger("workers.main")

WORKER_DIED = "the worker died while running this job"
RECOVERY_EVERY_S = 5.0
"""Seconds between sweeps for jobs that a dead worker left behind."""

SPOOL_CLEAN_EVERY_S = 3600.0
"""Seconds between removals of spooled uploads whose jobs ended long ago."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Command-line options (everything else comes from settings / the environment)."""
    parser = argparse.ArgumentParser(prog="mlxq worker", description=__doc__.splitlines()[0])
    parser.add_argument("--burst", action="store_true", help="drain the queues, then exit")
    parser.add_argument("--name", default=None, help="worker name (default: mlxq-<host>-<pid>-<random>)")
    return parser.parse_args(argv)


def configure_logging() -> None:
    """Log to stderr with timestamps (RQ's loggers then reuse this handler)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def host_identity() -> str:
    """This host and PID namespace: a PID is only meaningful within both."""
    try:
        return f"{socket.gethostname()}|{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _pid_running(pid: int) -> bool:
    """Whether a process with this PID exists here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def worker_is_dead(connection: redis.Redis, worker_name: str | None) -> bool:
    """Dead: its liveness key expired, or it ran here and its process is gone (no need to wait)."""
    raw = connection.get(keys.worker_alive(worker_name or ""))
    if raw is None:
        return True
    try:
        alive = json.loads(raw)
    except ValueError:
        return False
    same_place = isinstance(alive, dict) and alive.get("host") == host_identity()
    pid = alive.get("pid") if same_place else None
    return isinstance(pid, int) and (pid == os.getpid() or not _pid_running(pid))


def recover_orphaned_jobs(connection: redis.Redis, publisher: EventPublisher, own_name: str,
                          spool_dir) -> list[str]:
    """Fail the interactive jobs a dead worker was running, with a `worker_died` error event.

    Batch jobs are left to RQ's abandoned-job handling (checkpoint resume comes later).
    """
    registry = StartedJobRegistry(INTERACTIVE, connection=connection, serializer=JSONSerializer)
    recovered = []
    for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
        job = fetch_job(connection, job_id)
        if job is None or job.worker_name == own_name or not worker_is_dead(connection, job.worker_name):
            continue
        fail_orphan(connection, publisher, job, registry, execution_id, spool_dir)
        recovered.append(job_id)
    if recovered:
        log.warning("failed %d job(s) orphaned by a dead worker: %s", len(recovered), ", ".join(recovered))
    return recovered


def fail_orphan(connection: redis.Redis, publisher: EventPublisher, job: Job, registry: StartedJobRegistry,
                execution_id: str, spool_dir) -> None:
    """Publish the error event (unless the job already ended), drop its upload, move the job to failed."""
    if not has_ended(connection, job.id):
        publisher.error(job.id, WORKER_DIED, "worker_died", status=500)
    spool.discard(spool_dir, job.id)
    with connection.pipeline() as pipe:
        record_job_failure(job, f"{WORKER_DIED} (worker {job.worker_name})", pipe)
        pipe.zrem(registry.key, f"{job.id}:{execution_id}")
        pipe.execute()


class Heartbeat:
    """A thread refreshing the liveness key and, during a job, RQ's worker/job/execution heartbeats."""

    def __init__(self, worker: SimpleWorker, settings: Settings, publisher: EventPublisher):
        self.worker, self.settings, self.publisher = worker, settings, publisher
        self.connection = worker.connection
        self.key = keys.worker_alive(worker.name)
        self.value = json.dumps({"host": host_identity(), "pid": os.getpid(), "name": worker.name})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._jobs: dict[str, Job] = {}  # execution id -> its job, fetched once
        self._next_recovery = 0.0
        self._next_spool_clean = 0.0

    def start(self) -> "Heartbeat":
        """Beat once now, then every settings.worker_heartbeat_s."""
        self.beat()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and remove the liveness key (a clean exit is noticed at once)."""
        self._stop.set()
        self._thread.join(10)
        self.connection.delete(self.key)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.worker_heartbeat_s):
            try:
                self.beat()
            except redis.RedisError as exc:
                # Keep beating: Redis may come back before the liveness key expires.
                log.warning("heartbeat failed: %s", exc)

    def beat(self) -> None:
        """One heartbeat: liveness key, the running job's heartbeats, and now and then recovery."""
        self.connection.set(self.key, self.value, px=int(self.settings.worker_dead_after_s * 1000))
        self._beat_job()
        now = time.monotonic()
        if now >= self._next_recovery:
            self._next_recovery = now + RECOVERY_EVERY_S
            recover_all(self.connection, self.settings, self.publisher, self.worker.name)
        if now >= self._next_spool_clean:
            self._next_spool_clean = now + SPOOL_CLEAN_EVERY_S
            clean_spool(self.settings)

    def _beat_job(self) -> None:
        """SimpleWorker runs jobs on its main thread and cannot heartbeat them itself; do it here."""
        execution = next(iter(list(self.worker.executions.values())), None)
        if execution is None:
            self._jobs.clear()
            return
        job = self._jobs.get(execution.id) or Job.fetch(execution.job_id, connection=self.connection,
                                                         serializer=JSONSerializer)
        self._jobs = {execution.id: job}
        self.worker.maintain_heartbeats(job, execution)


def recover_all(connection: redis.Redis, settings: Settings, publisher: EventPublisher, own_name: str) -> None:
    """Fail interactive jobs a dead worker left behind; resume (or fail) its batch jobs from checkpoints."""
    recover_orphaned_jobs(connection, publisher, own_name, settings.spool_dir)
    recover_batch_jobs(connection, settings, own_name=own_name, is_dead=lambda n: worker_is_dead(connection, n))


def warm_default_model(runtime, settings: Settings) -> None:
    """Load the default model now so the first request does not pay for it; one missing or too large warns."""
    try:
        info = resolve(settings.default_model, settings)
        resident = runtime.warm(info)
    except (ModelNotFound, ModelTooLarge) as exc:
        # The worker can still serve other models; requests for this one get the same error.
        log.warning("default model not warmed: %s", exc)
        return
    log.info("warmed %s in %.2fs", info.id, resident.load_s)


def _exit_before_work(signum, frame) -> None:
    """SIGTERM before the worker takes jobs: nothing to finish, so leave at once.

    os._exit, not sys.exit: the model may be mid-load (MLX threads busy), and an interpreter
    finalizing under running MLX work can abort instead of exiting.
    """
    log.info("SIGTERM before taking jobs: exiting")
    logging.shutdown()
    os._exit(0)


def build_worker(settings: Settings, name: str | None) -> Worker:
    """The GPU worker (an RQ SimpleWorker: no fork) on interactive then batch, with the JSON serializer."""
    connection = get_redis(settings.redis_url)
    queues = [get_queue(q, connection) for q in WORKER_QUEUES]
    name = name or f"mlxq-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return Worker(queues, connection=connection, serializer=JSONSerializer, name=name)


def apply_platform_choice(argv: list[str]) -> platform.PlatformInfo:
    """Measure (or read the cached) BLAS choice and re-exec with it preloaded when it is not yet."""
    device = platform.backend()
    blas = platform.choose_blas(device=device)
    platform.reexec_with_blas(blas, argv)  # returns only when no re-exec is needed
    return platform.PlatformInfo(device, blas, platform.float32_max_bytes())


def main(argv: list[str] | None = None) -> int:
    """Run the worker until SIGTERM/SIGINT (or, with --burst, until the queues are empty)."""
    signal.signal(signal.SIGTERM, _exit_before_work)  # until RQ installs its warm shutdown
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    configure_logging()
    settings = load_settings()
    info = apply_platform_choice(argv)
    # Imported after the re-exec decision: mlx-lm and transformers take seconds to import.
    from workers import tasks
    from workers.engine import Runtime

    runtime = Runtime.create(settings, info)
    tasks.set_runtime(runtime)
    worker = build_worker(settings, args.name)
    publisher = EventPublisher(worker.connection, settings.result_ttl_s, settings.event_log_max)
    recover_all(worker.connection, settings, publisher, worker.name)
    warm_default_model(runtime, settings)
    heartbeat = Heartbeat(worker, settings, publisher).start()
    log.info("worker %s on queues %s | backend %s | BLAS %s | model budget %.0f MiB | float32 up to %.0f MiB",
             worker.name, ",".join(WORKER_QUEUES), info.backend, info.blas.describe(),
             runtime.registry.budget_bytes / 2**20, info.float32_max_bytes / 2**20)
    try:
        worker.work(burst=args.burst, logging_level="INFO")
    finally:
        heartbeat.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
