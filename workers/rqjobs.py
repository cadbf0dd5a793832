"""The worker's side of RQ: take jobs, and record them started, heartbeating, finished or failed.

The scheduler runs requests itself (RQ's workers run one job function to its end; the scheduler
interleaves and will batch them), but every request is still an RQ job that rq-dashboard shows
started, then finished or failed, with RQ's registries, results and worker entry kept as RQ keeps
them. This module is the only place that does so, with RQ's public classes and functions
(tests/workers/test_rqjobs.py fails if an RQ release changes what they do).
"""

from __future__ import annotations

import redis
from rq import Queue, Worker
from rq.exceptions import DequeueTimeout, NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.job_lifecycle import record_job_failure
from rq.registry import StartedJobRegistry
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now

HEARTBEAT_TTL_S = 60
"""How long a started job stays in its started registry without a heartbeat (the worker beats every second)."""


def take(queues: list[Queue], connection: redis.Redis, wait_s: int | None = None) -> tuple[Job, Queue] | None:
    """The first job of the first non-empty queue, waiting up to `wait_s` seconds for one (None: don't wait)."""
    try:
        found = Queue.dequeue_any(queues, wait_s, connection=connection, serializer=JSONSerializer)
    except DequeueTimeout:
        return None
    return found if found else None


def describe(job_ids: list[str], connection: redis.Redis) -> dict[str, tuple[str | None, str, float]]:
    """What each job runs (its function name: the request kind), whose it is (`owner_of`) and that key's weight in
    fair share (its meta's `share`, else 1), in one round trip; (None, "", 1.0) if it is gone."""
    jobs = Job.fetch_many(job_ids, connection=connection, serializer=JSONSerializer)
    return {job_id: ((job.func_name, owner_of(job), float((job.meta or {}).get("share") or 1.0))
                     if job is not None else (None, "", 1.0))
            for job_id, job in zip(job_ids, jobs, strict=True)}


def claim(queue: Queue, job_id: str) -> Job | None:
    """Take one particular job off its queue (None if another worker took it first)."""
    if not queue.remove(job_id):  # LREM: exactly one worker removes it
        return None
    try:
        return Job.fetch(job_id, connection=queue.connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return None


def claim_many(queue: Queue, job_ids: list[str]) -> list[Job]:
    """Take these jobs off their queue in two round trips, however many (those another worker took first,
    or that expired, are left out); in queue order."""
    if not job_ids:
        return []
    with queue.connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            queue.remove(job_id, pipeline=pipe)  # LREM: exactly one worker removes each
        removed = pipe.execute()
    mine = [job_id for job_id, count in zip(job_ids, removed, strict=True) if count]
    jobs = Job.fetch_many(mine, connection=queue.connection, serializer=JSONSerializer) if mine else []
    return [job for job in jobs if job is not None]


def payload(job: Job) -> dict:
    """The request an RQ job carries (its one argument; {} when it carries none)."""
    return job.args[0] if job.args and isinstance(job.args[0], dict) else {}


def logical_id(job: Job) -> str:
    """The id of the job the RQ job runs (a continuation "<id>_<n>" runs job <id>)."""
    return str(payload(job).get("id") or job.id)


def owner_of(job: Job) -> str:
    """Whose job it is: the id of the key that submitted it (web.auth.owner_of; "" on an open server)."""
    return str((job.meta or {}).get("owner") or "")


def start(job: Job, worker_name: str) -> Execution:
    """Record the job started by `worker_name` (status, started registry, execution)."""
    return start_many([job], worker_name)[0]


def start_many(jobs: list[Job], worker_name: str) -> list[Execution]:
    """Record these jobs started by `worker_name`, in one round trip however many (a burst of chats taken
    together: one each cost the worker's loop a round trip per job before anyone's first token)."""
    if not jobs:
        return []
    with jobs[0].connection.pipeline() as pipe:
        executions = []
        for job in jobs:
            job.prepare_for_execution(worker_name, pipe)
            executions.append(Execution.create(job, HEARTBEAT_TTL_S, pipeline=pipe, worker_name=worker_name))
        pipe.execute()
    return executions


def heartbeat(running: list[tuple[Job, Execution]]) -> None:
    """Keep running jobs in their started registries (a job whose heartbeats stop is abandoned), in one
    round trip: one each, 64 jobs decoding together cost the worker's MLX thread a tenth of its time
    (the GIL) on a GPU."""
    if not running:
        return
    with running[0][0].connection.pipeline() as pipe:
        for job, execution in running:
            job.heartbeat(now(), HEARTBEAT_TTL_S, pipeline=pipe, xx=True)
            execution.heartbeat(job.started_job_registry, HEARTBEAT_TTL_S, pipe)
        pipe.execute()


def succeed(job: Job, execution: Execution, return_value) -> None:
    """Record the job finished, with its return value (kept for its result TTL)."""
    succeed_many([(job, execution, return_value)])


def succeed_many(finished: list[tuple[Job, Execution, object]]) -> None:
    """Record several jobs finished (each as `succeed`), in one round trip: 64 requests ending at one step cost
    the worker's loop a round trip each."""
    if not finished:
        return
    with finished[0][0].connection.pipeline() as pipe:
        for job, execution, return_value in finished:
            result_ttl = job.get_result_ttl(500)
            job.ended_at = now()
            job.set_status(JobStatus.FINISHED, pipeline=pipe)
            job.save(pipeline=pipe, include_meta=False, include_result=False)
            Result.create(job, Result.Type.SUCCESSFUL, ttl=result_ttl, return_value=return_value,
                          worker_name=execution.worker_name, pipeline=pipe, execution_id=execution.id)
            job.finished_job_registry.add(job, ttl=result_ttl, pipeline=pipe)
            job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
            execution.delete(job=job, pipeline=pipe)
        pipe.execute()


def fail(job: Job, execution: Execution | None, reason: str) -> None:
    """Record the job failed, with `reason` as its exception text (kept for its failure TTL)."""
    job.ended_at = now()
    with job.connection.pipeline() as pipe:
        job.save(pipeline=pipe, include_meta=False, include_result=False)
        record_job_failure(job, reason, pipe)
        if execution is not None:
            execution.delete(job=job, pipeline=pipe)
        pipe.execute()


def started(queue_name: str, connection: redis.Redis) -> list[tuple[Job, str]]:
    """The jobs started from a queue, each with its execution id; entries whose job expired are dropped."""
    registry = StartedJobRegistry(queue_name, connection=connection, serializer=JSONSerializer)
    found = []
    for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
        try:
            found.append((Job.fetch(job_id, connection=connection, serializer=JSONSerializer), execution_id))
        except NoSuchJobError:  # its hash expired: nothing to run
            registry.remove_execution(Execution(execution_id, job_id, connection))
    return found


def retire(job: Job, execution_id: str, reason: str) -> None:
    """Record failed a job whose worker died (a resumed job lives on in its continuation)."""
    execution = Execution(execution_id, job.id, job.connection)
    with job.connection.pipeline() as pipe:
        record_job_failure(job, reason, pipe)
        job.started_job_registry.remove_execution(execution, pipeline=pipe)
        pipe.execute()


def register(queues: list[Queue], connection: redis.Redis, name: str) -> Worker:
    """An RQ worker entry for rq-dashboard (`Worker.register_birth`); the caller beats and unregisters."""
    worker = Worker(queues, connection=connection, name=name, serializer=JSONSerializer)
    worker.register_birth()
    return worker
