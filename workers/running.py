"""A job the scheduler runs, and the two ways it ends: with its answer, or with an error."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import redis
from rq.job import Job

from jobs.errors import JobError
from jobs.lifecycle import JobRun, continue_job
from workers import rqjobs, worker_metrics
from workers.backends.base import Outcome

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


@dataclass(eq=False)  # compared and hashed by identity: a task is a key of its batch's members
class Task:
    """A job being run: its RQ job, its request, its lifecycle handle and where it runs."""

    job: Job
    execution: object
    request: object
    run: JobRun
    backend: object
    lane: str  # the queue it came from
    timeout_s: float
    started: float = field(default_factory=time.monotonic)
    gen: object = None  # a solo task's run, in pieces
    used_s: float = 0.0  # time spent running a solo task's pieces (pauses don't count)
    waited_s: float | None = None  # time in its queue before it started


def finish(scheduler, task: Task, outcome: Outcome) -> None:
    """End a task with its answer, then close its run (the answer is out first)."""
    task.run.finish(outcome.done, outcome.result, outcome.before)
    rqjobs.succeed(task.job, task.execution, outcome.done)
    worker_metrics.job_ended(scheduler.conn, task, outcome.done, None)
    scheduler.release(task)
    log.info("finished %s in %.2fs", task.job.id, time.monotonic() - task.started)


def fail(scheduler, task: Task, exc: BaseException) -> None:
    """End a task with the error `exc` means to a client."""
    data = task.run.fail(exc)
    rqjobs.fail(task.job, task.execution, f"{data['code']}: {data['message']}")
    worker_metrics.job_ended(scheduler.conn, task, None, exc)
    scheduler.release(task)
    log.info("failed %s: %s %s", task.job.id, data["status"], data["code"])


def fail_all(scheduler, tasks: list[Task], reason: BaseException) -> None:
    """End every task with the same error (a cold stop)."""
    for task in tasks:
        fail(scheduler, task, reason)


def resumable(task: Task) -> bool:
    """Whether the task can stop between pieces and go on elsewhere from its checkpoint."""
    return bool(task.backend and task.backend.resumable and task.request.is_async)


def hand_back(scheduler, task: Task) -> None:
    """Stop a resumable task between pieces; a continuation from its checkpoint goes first in `batch`."""
    continuation = continue_job(scheduler.conn, scheduler.settings, task.request, queue=task.job.origin,
                                func=task.job.func_name, timeout_s=task.job.timeout)
    rqjobs.succeed(task.job, task.execution, {"handed_back_to": continuation})
    scheduler.release(task)
    log.info("handed %s back to the queue as %s", task.run.job_id, continuation)


def ride_out_redis(scheduler, exc: Exception) -> None:
    """Redis stayed away past the connection's retries: wait for it, then settle the tasks in progress."""
    log.error("Redis unreachable (%s); waiting for it to come back", exc)
    delay = 0.5
    while not scheduler.cold:
        try:
            scheduler.conn.ping()
            break
        except REDIS_DOWN:
            time.sleep(delay)
            delay = min(delay * 2, 10.0)
    log.warning("Redis is back")
    for task in scheduler.active():
        try:
            if resumable(task) and task.gen is not None:
                hand_back(scheduler, task)  # nothing is lost: it resumes from its last checkpoint
            else:
                fail(scheduler, task, JobError("the queue (Redis) was unreachable while this job ran", status=503,
                                               code="queue_unavailable"))
        except REDIS_DOWN:
            return  # gone again: the next round of the loop waits again
