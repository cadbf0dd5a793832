"""Job state as readers see it, and noticing a job whose worker died."""

from __future__ import annotations

import redis
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.events import EventPublisher, has_ended


def fetch_job(connection: redis.Redis, job_id: str) -> Job | None:
    """Return the RQ job `job_id`, or None when it does not exist (or expired)."""
    try:
        return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return None


def worker_is_alive(connection: redis.Redis, worker_name: str | None) -> bool:
    """Whether the worker named `worker_name` refreshed its liveness key recently."""
    return bool(worker_name) and bool(connection.exists(keys.worker_alive(worker_name)))


def any_worker_alive(connection: redis.Redis) -> bool:
    """Whether at least one mlxq worker is alive."""
    return next(connection.scan_iter(match=keys.WORKER_ALIVE_PATTERN, count=100), None) is not None


def fail_if_orphaned(connection: redis.Redis, publisher: EventPublisher, job_id: str) -> bool:
    """Publish an error event for a job whose worker died or that failed silently; True if so.

    Safe to call from many readers at once: the event protocol keeps only the first terminal event.
    """
    if has_ended(connection, job_id):
        return False
    job = fetch_job(connection, job_id)
    if job is None:
        publisher.error(job_id, "The job no longer exists (expired or deleted).", "job_lost", status=500)
        return True
    status = job.get_status(refresh=False)
    if status == JobStatus.STARTED and not worker_is_alive(connection, job.worker_name):
        publisher.error(job_id, "The worker died while running this job.", "worker_died", status=500)
        return True
    if status in (JobStatus.FAILED, JobStatus.STOPPED) and not has_ended(connection, job_id):
        publisher.error(job_id, "The job failed in the worker.", "job_failed", status=500)
        return True
    if status == JobStatus.CANCELED:
        publisher.error(job_id, "The job was canceled.", "canceled", status=499)
        return True
    return False


def request_cancel(connection: redis.Redis, job_id: str, ttl_s: int) -> None:
    """Ask for a job to stop: flag it for the worker, and drop it from its queue if not started."""
    connection.set(keys.cancel_flag(job_id), 1, ex=ttl_s)
    job = fetch_job(connection, job_id)
    if job is not None and job.get_status() in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
        job.cancel()
