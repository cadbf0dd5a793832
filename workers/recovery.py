"""Recovering batch work a dead worker left behind, and removing spooled uploads nobody needs any more.

A transcription that was running when its worker died resumes from its last checkpoint as a
continuation at the front of `batch` (so it keeps its place in the order of submissions). A job
that keeps killing the worker is failed after MAX_ATTEMPTS starts. Batch jobs without checkpoints
(async chat) are failed with a `worker_died` error: re-running them would stream their output twice.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import redis
from rq.job import Job
from rq.job_lifecycle import record_job_failure
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from jobs import records
from jobs.connection import get_redis
from jobs.events import ERROR, EventPublisher
from jobs.queues import BATCH, TRANSCRIPTION
from jobs.settings import Settings
from jobs.status import fetch_job, worker_is_alive
from jobs.webhooks import finish_record
from workers.speech_tasks import CONTINUATION_TIMEOUT_S, enqueue_continuation, segments_key

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""How many times a batch job may be started (first run plus restarts after crashes) before the
worker gives up on it: a job that crashed the worker this many times would likely crash it again."""

RESUMABLE = frozenset({TRANSCRIPTION})
"""Job functions that checkpoint and can continue where a dead worker left them."""


def recover_batch_jobs(conn: redis.Redis, settings: Settings, own_name: str | None = None,
                       is_dead: Callable[[str | None], bool] | None = None) -> list[str]:
    """Restart (or fail) the batch jobs whose worker died; return their logical job ids.

    `is_dead(worker_name)` defaults to "its liveness key expired" (jobs.status.worker_is_alive).
    """
    is_dead = is_dead or (lambda name: not worker_is_alive(conn, name))
    registry = StartedJobRegistry(BATCH, connection=conn, serializer=JSONSerializer)
    recovered = []
    for rq_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
        job = fetch_job(conn, rq_id)
        if job is None:
            conn.zrem(registry.key, f"{rq_id}:{execution_id}")  # its hash expired: nothing to run
        elif job.worker_name != own_name and is_dead(job.worker_name):
            _retire(conn, registry, job, execution_id)
            recovered.append(_restart(conn, settings, job))
    if recovered:
        log.warning("recovered %d batch job(s) from a dead worker: %s", len(recovered), ", ".join(recovered))
    return recovered


def _retire(conn: redis.Redis, registry: StartedJobRegistry, job: Job, execution_id: str) -> None:
    """Move the dead worker's RQ job to failed (the logical job lives on in its continuation)."""
    with conn.pipeline() as pipe:
        record_job_failure(job, f"the worker {job.worker_name} died while running this job", pipe)
        pipe.zrem(registry.key, f"{job.id}:{execution_id}")
        pipe.execute()


def _restart(conn: redis.Redis, settings: Settings, job: Job) -> str:
    """Enqueue the job's continuation from its checkpoint, or fail it; return its logical id."""
    payload = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
    job_id = payload.get("job_id") or job.id
    if job.func_name not in RESUMABLE:
        _give_up(conn, settings, job_id, "The worker died while running this job.", "worker_died")
        return job_id
    record = records.load(conn, job_id)
    attempts = max(1, int((record or {}).get("attempts") or payload.get("attempts") or 1))
    if attempts >= MAX_ATTEMPTS:
        _give_up(conn, settings, job_id, f"the job crashed the worker {attempts} times", "worker_crashed")
        return job_id
    continuation = enqueue_continuation(conn, settings, {**payload, "attempts": attempts + 1}, job_id,
                                        job.timeout or CONTINUATION_TIMEOUT_S, func=job.func_name)
    records.update(conn, job_id, attempts=attempts + 1, rq_job_id=continuation.id)
    return job_id


def _give_up(conn: redis.Redis, settings: Settings, job_id: str, message: str, code: str) -> None:
    """Fail the logical job for good: error event, record, webhook, no checkpoint left."""
    error = {"message": message, "code": code, "status": 500}
    finish_record(conn, settings, job_id, records.FAILED, error)  # before the event a client may act on
    EventPublisher(conn, settings.result_ttl_s, settings.event_log_max).publish(job_id, ERROR, error)
    conn.delete(records.checkpoint_key(job_id), segments_key(job_id))


def clean_spool(settings: Settings, now: float | None = None) -> list[Path]:
    """Remove spooled uploads no job needs: their record ended (or expired) over result_ttl_s ago.

    The spool holds one directory per job id (`<spool_dir>/<job_id>/<file>`); entries whose name
    starts with "." are partial uploads, removed once older than result_ttl_s.
    """
    spool = Path(settings.spool_dir)
    if not spool.is_dir():
        return []
    conn = get_redis(settings.redis_url)
    now = time.time() if now is None else now
    removed = []
    for entry in sorted(spool.iterdir()):
        if not _expired(conn, entry, now - settings.result_ttl_s):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def _expired(conn: redis.Redis, entry: Path, cutoff: float) -> bool:
    """Whether a spool entry's job ended before `cutoff` (or, with no record left, it dates from before)."""
    if entry.name.startswith(".") or not entry.is_dir():
        return entry.stat().st_mtime < cutoff
    record = records.get(conn, entry.name)
    if record is None:  # expired, or a sync job (no record) whose caller did not remove it
        return entry.stat().st_mtime < cutoff
    return record["status"] in records.TERMINAL and (record["finished_at"] or 0) < cutoff
