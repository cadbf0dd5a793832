"""The scheduler: the worker's main loop, the one thread that touches MLX.

It takes jobs from the queues (RQ's API, workers/rqjobs.py), parses each one's request once
(jobs.contract) and runs it through its backend in pieces (workers/backends/base.py). Two lanes,
one task each: `interactive` (synchronous calls) and `batch` (async jobs). The interactive task
always advances first; the batch task advances only while no interactive work waits, so a long
transcription yields to a chat at its next window (interactive work waits at most one piece) and
picks up where it was. Jobs of one lane run in queue order.

Between two pieces of a task the scheduler also checks its deadline (the RQ job's timeout, counted
while it runs). Nothing interrupts a piece from outside, so a model load or a window is never cut
in the middle.

Stopping: a warm stop (SIGTERM) takes no new jobs, lets the interactive task finish, and hands a
resumable batch task back to the queue at its next piece (it continues from its checkpoint on the
next worker); a cold stop (a second SIGTERM) ends every task with `worker_shutdown`. A Redis outage
longer than the connection's own retries (about a minute) never ends the worker: it waits for Redis,
then hands back what can resume and fails the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis
from rq.job import Job

from jobs import contract, records
from jobs.errors import JobError, JobTimeout, WorkerShutdown
from jobs.lifecycle import JobRun
from jobs.queues import BATCH, INTERACTIVE, WORKER_QUEUES, get_queue
from jobs.settings import Settings
from workers import rqjobs
from workers.backends.base import Outcome
from workers.recovery import enqueue_continuation

log = logging.getLogger(__name__)

POLL_S = 1
"""Longest wait for a job while the worker has nothing to do (then it looks again)."""

DEFAULT_TIMEOUT_S = 3600
"""A job's time limit when its RQ job names none."""

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


@dataclass
class Task:
    """A job being run: its RQ job, its request, its lifecycle handle and its backend's run."""

    job: Job
    execution: object
    request: contract.Request
    run: JobRun
    backend: object
    timeout_s: float
    gen: object = None
    used_s: float = 0.0  # time spent running its pieces (pauses for interactive work don't count)


class Scheduler:
    """Runs the worker's jobs through the backends, interactive before batch, until stopped."""

    def __init__(self, conn: redis.Redis, settings: Settings, models, backends: dict, name: str,
                 burst: bool = False):
        self.conn, self.settings, self.models, self.backends = conn, settings, models, backends
        self.name, self.burst = name, burst
        self.queues = {queue: get_queue(queue, conn) for queue in WORKER_QUEUES}
        self.lanes: dict[str, Task | None] = {INTERACTIVE: None, BATCH: None}
        self.stopping = self.cold = False
        self._lock = threading.Lock()

    def active(self) -> list[Task]:
        """The tasks in progress (read by the heartbeat thread)."""
        with self._lock:
            return [task for task in self.lanes.values() if task is not None]

    def stop(self, cold: bool = False) -> None:
        """Ask the loop to stop: warm (finish what runs, hand back batch work) or cold (end it all now)."""
        self.stopping = True
        self.cold = self.cold or cold

    def run(self) -> None:
        """Take and run jobs until stopped (or, in burst mode, until there is nothing left)."""
        while True:
            try:
                if self.cold:
                    return self._end_all(WorkerShutdown("the worker shut down while running this job"))
                if not self.step() and (self.stopping or self.burst):
                    return
            except REDIS_DOWN as exc:
                self._ride_out_redis(exc)

    def step(self) -> bool:
        """Take a job if a lane is free, then run one piece of the most urgent task; False if there was none."""
        took = self._admit()
        task = self.lanes[INTERACTIVE] or self.lanes[BATCH]
        if task is None:
            return took
        self._advance(task)
        return True

    def _admit(self) -> bool:
        """Take the next job a free lane can run; wait for one only when there is nothing to do."""
        if self.stopping or self.lanes[INTERACTIVE] is not None:
            return False
        idle = self.lanes[BATCH] is None
        names = [INTERACTIVE, BATCH] if idle else [INTERACTIVE]
        taken = rqjobs.take([self.queues[n] for n in names], self.conn, POLL_S if idle and not self.burst else None)
        if taken is not None:
            self._begin(*taken)
        return taken is not None

    def _begin(self, job: Job, queue) -> None:
        """Record the job started and make it its lane's task (or fail it if its request is unreadable)."""
        execution = rqjobs.start(job, self.name)
        payload = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
        run = JobRun(self.conn, self.settings, str(payload.get("id") or job.id), rq_job_id=job.id,
                     has_record=bool(payload.get("is_async", True)))
        try:
            request = contract.parse(payload)
            backend = self.backends[request.kind]
        except (JobError, KeyError) as exc:
            data = run.fail(exc if isinstance(exc, JobError) else JobError(f"no backend for {exc}"))
            return rqjobs.fail(job, execution, f"{data['code']}: {data['message']}")
        run.start(attempts=getattr(request, "attempts", 1))
        task = Task(job, execution, request, run, backend, float(job.timeout or DEFAULT_TIMEOUT_S))
        with self._lock:
            self.lanes[queue.name] = task
        log.info("%s: started %s (%s)", queue.name, job.id, job.description)

    def _advance(self, task: Task) -> None:
        """Run one piece of a task; end it when it is done, fails, is canceled or runs out of time."""
        started = time.monotonic()
        try:
            if task.used_s > task.timeout_s:
                raise JobTimeout(f"the job ran past its time limit of {task.timeout_s:g}s")
            if self.stopping and self._resumable(task) and task.gen is not None:
                return self._hand_back(task)
            if task.gen is None:  # a job canceled while it waited ends at its first publish
                task.gen = task.backend.run(task.request, task.run, self.models)
            item = next(task.gen)
        except StopIteration:
            return self._fail(task, RuntimeError("the backend ended without an answer"))
        except REDIS_DOWN:
            raise
        except Exception as exc:  # a client-facing error (jobs.errors) or an unexpected one: the job ends
            return self._fail(task, exc)
        finally:
            task.used_s += time.monotonic() - started
        if isinstance(item, Outcome):
            self._finish(task, item)

    def _finish(self, task: Task, outcome: Outcome) -> None:
        """End a task with its answer, then close its run (the answer is out first)."""
        task.run.finish(outcome.done, outcome.result, outcome.before)
        rqjobs.succeed(task.job, task.execution, outcome.done)
        self._close(task)
        log.info("finished %s in %.2fs", task.job.id, task.used_s)

    def _fail(self, task: Task, exc: BaseException) -> None:
        """End a task with the error `exc` means to a client."""
        data = task.run.fail(exc)
        rqjobs.fail(task.job, task.execution, f"{data['code']}: {data['message']}")
        self._close(task)
        log.info("failed %s: %s %s", task.job.id, data["status"], data["code"])

    def _hand_back(self, task: Task) -> None:
        """Stop a resumable task between pieces; a continuation from its checkpoint goes first in `batch`."""
        continuation = enqueue_continuation(self.conn, self.settings, task.job, task.request)
        records.update(self.conn, task.run.job_id, rq_job_id=continuation.id)
        rqjobs.succeed(task.job, task.execution, {"handed_back_to": continuation.id})
        self._close(task)
        log.info("handed %s back to the queue as %s", task.run.job_id, continuation.id)

    def _close(self, task: Task) -> None:
        """Close the task's run (its backend's cleanup) and free its lane."""
        try:
            if task.gen is not None:
                task.gen.close()
        except Exception:  # closing never decides the job's outcome, which is already recorded
            log.exception("closing the run of %s failed", task.job.id)
        with self._lock:
            for lane, current in self.lanes.items():
                if current is task:
                    self.lanes[lane] = None

    def _resumable(self, task: Task) -> bool:
        return task.backend.resumable and task.request.is_async

    def _end_all(self, reason: JobError) -> None:
        """Cold stop: end every task in progress with `reason`."""
        for task in self.active():
            self._fail(task, reason)

    def _ride_out_redis(self, exc: Exception) -> None:
        """Redis stayed away past the connection's retries: wait for it, then settle the tasks in progress."""
        log.error("Redis unreachable (%s); waiting for it to come back", exc)
        delay = 0.5
        while not self.cold:
            try:
                self.conn.ping()
                break
            except REDIS_DOWN:
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        log.warning("Redis is back")
        for task in self.active():
            try:
                if self._resumable(task) and task.gen is not None:
                    self._hand_back(task)  # nothing is lost: it resumes from its last checkpoint
                else:
                    self._fail(task, JobError("the queue (Redis) was unreachable while this job ran", status=503,
                                              code="queue_unavailable"))
            except REDIS_DOWN:
                return  # gone again: the next round of the loop waits again
