"""The GPU worker's RQ class: RQ's SimpleWorker with fewer Redis round trips around each job.

Between a synchronous call's enqueue and its answer, every Redis round trip the worker makes is
latency the client sees. RQ 3 (pinned in pyproject.toml: this class leans on its internals) sends
a bare worker heartbeat, three commands in three round trips, before and after every dequeue and
after every job, is woken by its BLPOP with a job's id only and fetches the job in a round trip of
its own, and prepares it in two pipelines, one after the other, waiting for each. Here:
- a bare heartbeat is one pipelined round trip, skipped when one went out less than
  BARE_HEARTBEAT_GAP_S ago (the worker key lives for minutes, and workers.main's Heartbeat thread
  beats during jobs);
- the worker waits on jobs.queues' doorbell, and the reply that wakes it carries the job and its
  cancel flag (jobs.queues.DoorbellQueue: the job function would otherwise also ask for the flag
  in a round trip of its own before generating);
- the two preparation pipelines go out as one transaction, and the job function starts without
  waiting for its reply: the replies are read before RQ records the job's end, so Redis still
  sees the job started before it sees it end (an error in them is raised; a connection lost
  before them is logged, and the end recorded anyway).
What is written to Redis is unchanged.
"""

from __future__ import annotations

import logging
import math
import time

import redis
from rq import SimpleWorker
from rq import job as rq_job
from rq.executions import Execution
from rq.queue import Queue
from rq.utils import now
from rq.worker import WorkerStatus

from jobs.connection import SentCommands
from jobs.queues import DoorbellQueue

log = logging.getLogger(__name__)

BARE_HEARTBEAT_GAP_S = 1.0
"""RQ's own bare worker heartbeats closer together than this are skipped."""


class SentTransaction(SentCommands):
    """A pipeline's commands, sent now as one MULTI/EXEC transaction, whose replies are read later."""

    def __init__(self, pipeline: redis.client.Pipeline):
        self._count = len(pipeline.command_stack)
        commands = [("MULTI",), *(args for args, _options in pipeline.command_stack), ("EXEC",)]
        super().__init__(pipeline.connection_pool, commands)

    def confirm(self) -> None:
        """Read the transaction's replies; raise the first error. Idempotent."""
        if not self.pending:
            return
        # +OK for MULTI, +QUEUED for each command, then EXEC's list of one result per command.
        results = self._read_replies(self._count + 2)[-1]
        errors = [r for r in results or () if isinstance(r, Exception)]
        if results is None or len(results) != self._count or errors:
            raise errors[0] if errors else redis.ResponseError(f"transaction answered {results!r}")


class Worker(SimpleWorker):
    """SimpleWorker (no fork: models stay resident) with batched heartbeats, dequeue and preparation."""

    log_result_lifespan = False  # "result is kept for N seconds" on every job says nothing new
    queue_class = DoorbellQueue

    _last_bare_heartbeat = -math.inf
    _prepared_job_id: str | None = None
    _preparation: SentTransaction | None = None

    def heartbeat(self, timeout: int | None = None, pipeline=None):
        """Refresh the worker key: pipelined, and at most once per BARE_HEARTBEAT_GAP_S when bare."""
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline)
        moment = time.monotonic()
        if timeout is None and moment - self._last_bare_heartbeat < BARE_HEARTBEAT_GAP_S:
            return None
        with self.connection.pipeline(transaction=False) as pipe:
            super().heartbeat(timeout, pipe)
            pipe.execute()
        self._last_bare_heartbeat = moment
        return None

    def prepare_execution(self, job: rq_job.Job) -> Execution:
        """Send RQ's execution record and the job's started state as one transaction, unconfirmed."""
        with self.connection.pipeline() as pipeline:
            heartbeat_ttl = self.get_heartbeat_ttl(job)
            execution = Execution.create(job, heartbeat_ttl, pipeline=pipeline, worker_name=self.name)
            self.executions[execution.id] = execution
            self.set_state(WorkerStatus.BUSY, pipeline=pipeline)
            # What RQ's prepare_job_execution queues, minus the intermediate-queue cleanup, which it
            # only does for a worker on a single queue (this one has two).
            self.heartbeat(heartbeat_ttl, pipeline=pipeline)
            job.heartbeat(now(), heartbeat_ttl, pipeline=pipeline)
            job.prepare_for_execution(self.name, pipeline=pipeline)
            pipeline.persist(job.key)
            self._preparation = SentTransaction(pipeline)
        self._prepared_job_id = job.id
        return execution

    def confirm_preparation(self) -> None:
        """Wait for the reply of the job's preparation (a no-op once read); raise its error."""
        if self._preparation is not None:
            preparation, self._preparation = self._preparation, None
            preparation.confirm()

    def handle_execution_ended(self, job: rq_job.Job, queue: Queue, heartbeat_ttl: int):
        """RQ's end of a job, once its start is confirmed: Redis must see the start first."""
        try:
            self.confirm_preparation()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # The connection went while the job ran: whether the start was applied is unknown, but
            # the job's outcome is known and is what RQ records next, over a fresh connection.
            log.warning("no reply to the preparation of job %s (%s); recording its end anyway", job.id, exc)
        super().handle_execution_ended(job, queue, heartbeat_ttl)

    def execute_job(self, job: rq_job.Job, queue: Queue):
        """Run the job (RQ's SimpleWorker); never leave a preparation's reply unread."""
        try:
            super().execute_job(job, queue)
        finally:
            if self._preparation is not None:  # only when RQ's own handling raised before the end
                try:
                    self.confirm_preparation()
                except redis.RedisError as exc:
                    log.warning("preparing job %s failed: %s", job.id, exc)

    def prepare_job_execution(self, job: rq_job.Job, remove_from_intermediate_queue: bool = False) -> None:
        """Skip RQ's second preparation pipeline when prepare_execution already sent it."""
        if self._prepared_job_id == job.id and not remove_from_intermediate_queue:
            self._prepared_job_id = None
            return
        super().prepare_job_execution(job, remove_from_intermediate_queue)
