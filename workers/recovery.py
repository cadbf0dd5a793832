"""What a dead worker left behind: its jobs, resumed or failed; and spooled uploads nobody needs.

A worker runs this when it starts and every few seconds. Interactive jobs a dead worker was running
are failed with `worker_died` (their callers wait for an answer now, not later). A batch transcription
resumes from its last checkpoint as a continuation at the front of `batch` (it keeps its place in the
order of submissions; jobs.lifecycle.continue_job, as a warm stop hands one back); one that keeps
killing the worker is failed after MAX_ATTEMPTS starts. Other batch jobs (async chat) are failed:
re-running them would stream their output twice. The dead worker's RQ jobs are retired through
workers/rqjobs.py.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import redis
from rq.job import Job

from jobs import contract, records
from jobs.connection import get_redis
from jobs.errors import JobError, WorkerDied
from jobs.lifecycle import continue_job, end, worker_is_dead
from jobs.queues import BATCH, known_worker_queues, lane_of
from jobs.settings import Settings
from workers import rqjobs

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""How many times a batch job may be started (first run plus restarts after crashes) before the
worker gives up on it: a job that crashed the worker this many times would likely crash it again."""


def recover(conn: redis.Redis, settings: Settings, own_name: str) -> list[str]:
    """Fail or resume every job a dead worker was running; return their ids (logical ones)."""
    recovered = []
    for queue in known_worker_queues(conn):
        for job, execution_id in rqjobs.started(queue, conn):
            if job.worker_name != own_name and worker_is_dead(conn, job.worker_name):
                rqjobs.retire(job, execution_id, f"the worker {job.worker_name} died while running this job")
                recovered.append(_restart(conn, settings, job) if lane_of(queue) == BATCH
                                 else _fail_dead(conn, settings, job))
    if recovered:
        log.warning("recovered %d job(s) from a dead worker: %s", len(recovered), ", ".join(recovered))
    return recovered


def _fail_dead(conn: redis.Redis, settings: Settings, job: Job, message: str = "The worker died while running "
               "this job.", code: str = "worker_died") -> str:
    """End a job for good because its worker died: error event, record, webhook, checkpoint, upload."""
    job_id = rqjobs.logical_id(job)
    end(conn, settings, job_id, error=WorkerDied(message, code=code).as_data())
    return job_id


def _restart(conn: redis.Redis, settings: Settings, job: Job) -> str:
    """Continue a resumable batch job from its checkpoint, or fail it; return its logical id."""
    try:
        request = contract.parse(rqjobs.payload(job))
    except JobError:  # an unreadable payload cannot resume
        return _fail_dead(conn, settings, job)
    if not isinstance(request, contract.TranscriptionRequest):
        return _fail_dead(conn, settings, job)
    record = records.load(conn, request.id) or {}
    attempts = max(1, int(record.get("attempts") or request.attempts))
    if attempts >= MAX_ATTEMPTS:
        return _fail_dead(conn, settings, job, f"the job crashed the worker {attempts} times", "worker_crashed")
    continue_job(conn, settings, request, queue=job.origin, func=job.func_name, timeout_s=job.timeout,
                 attempts=attempts + 1, owner=rqjobs.owner_of(job))
    return request.id


def clean_spool(settings: Settings, now: float | None = None) -> list[Path]:
    """Remove spooled uploads no job needs: their record ended (or expired) over result_ttl_s ago.

    Jobs remove their own upload when they end; this catches what a crash or a lost record left. The
    spool holds one directory per job id; entries whose name starts with "." are partial uploads.
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
