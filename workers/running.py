"""A job the scheduler runs, and the three ways it stops: with its answer, with an error, or handed back.

An end is told (the job's lifecycle: record, webhook, the client's terminal event), then recorded (RQ,
the metrics); the scheduler then frees the task's place (workers/scheduler.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rq.executions import Execution
from rq.job import Job

from jobs.contract import Request
from jobs.lifecycle import JobRun, continue_job, end_calls
from workers import rqjobs, worker_metrics
from workers.backends.base import Backend, Outcome

log = logging.getLogger(__name__)


@dataclass(eq=False)  # compared and hashed by identity: a task is a key of its batch's members
class Task:
    """A job being run: its RQ job, its request, its lifecycle handle and where it runs."""

    job: Job
    execution: Execution
    run: JobRun
    lane: str  # the queue it came from
    timeout_s: float
    request: Request | None = None  # None until its payload is parsed (one that does not parse fails)
    backend: Backend | None = None
    started: float = field(default_factory=time.monotonic)
    gen: Iterator[Outcome | None] | None = None  # a solo task's run, in pieces
    used_s: float = 0.0  # time spent running a solo task's pieces (pauses don't count)
    waited_s: float | None = None  # time in its queue before it started
    cache_lookups: list = field(default_factory=list)  # its prompts' prompt-cache lookups: (tier, hit, tokens)


def tell(task: Task, result: Outcome | BaseException) -> dict | None:
    """The job's end as its client sees it (record, webhook, terminal event); the error event's data, if
    it failed. `record_many` must follow: several tasks ending at one step are all told first, then recorded
    together (their clients' answers do not wait for each other's bookkeeping)."""
    if isinstance(result, Outcome):
        task.run.finish(result.done, result.result, result.before)
        return None
    return task.run.fail(result)


def tell_many(ended: list[tuple[Task, Outcome | BaseException]]) -> Iterator[tuple[Task, Outcome | BaseException,
                                                                                 dict | None]]:
    """`tell` each task's end, yielding it with its result and what `tell` returned (for `record_many`) as it is told;
    the answers of synchronous calls all in one go (jobs.lifecycle.end_calls: told one after another, the last of 64
    chats ending at one step waited for 128 round trips before it)."""
    calls = [(task, result) for task, result in ended if isinstance(result, Outcome) and not task.run.has_record]
    if calls:
        run = calls[0][0].run
        end_calls(run.conn, run.settings, [(task.run.job_id, result.done, result.before) for task, result in calls])
        for task, result in calls:
            task.run.ended = True
            yield task, result, None
    answered = {id(task) for task, _ in calls}
    for task, result in ended:
        if id(task) not in answered:
            yield task, result, tell(task, result)


def record_many(told: list[tuple[Task, Outcome | BaseException, dict | None]]) -> None:
    """Record the ends of told tasks in RQ and the metrics (`told`: each task, its result and what `tell`
    returned): the successes and the metrics in one round trip each, however many."""
    if not told:
        return
    done = [(task, result) for task, result, _ in told if isinstance(result, Outcome)]
    rqjobs.succeed_many([(task.job, task.execution, result.done if result.kept is None else result.kept)
                         for task, result in done])
    for task, result, data in told:
        if not isinstance(result, Outcome):
            rqjobs.fail(task.job, task.execution, f"{data['code']}: {data['message']}")
    worker_metrics.jobs_ended(told[0][0].run.conn, [
        (task, result.done, None) if isinstance(result, Outcome) else (task, None, result) for task, result, _ in told])
    for task, result, data in told:
        if isinstance(result, Outcome):
            log.info("finished %s in %.2fs", task.job.id, time.monotonic() - task.started)
        else:
            log.info("failed %s: %s %s", task.job.id, data["status"], data["code"])


def resumable(task: Task) -> bool:
    """Whether the task stopped between pieces and can go on elsewhere from its checkpoint."""
    return bool(task.backend and task.backend.resumable and task.request.is_async and task.gen is not None)


def hand_back(task: Task) -> None:
    """Stop a resumable task between pieces: it goes on from its checkpoint, first in its batch queue."""
    continuation = continue_job(task.run.conn, task.run.settings, task.request, queue=task.job.origin,
                                func=task.job.func_name, timeout_s=task.job.timeout,
                                owner=rqjobs.owner_of(task.job))
    rqjobs.succeed(task.job, task.execution, {"handed_back_to": continuation})
    log.info("handed %s back to the queue as %s", task.run.job_id, continuation)
