"""The GPU worker's RQ class: RQ's SimpleWorker with fewer Redis round trips around each job.

Between a synchronous call's enqueue and its answer, every Redis round trip the worker makes is
latency the client sees. RQ 3 (pinned in pyproject.toml: this class leans on its internals) sends
a bare worker heartbeat, three commands in three round trips, before and after every dequeue and
after every job, and prepares each job in two pipelines, one after the other. Here a bare
heartbeat is one pipelined round trip, skipped when one went out less than BARE_HEARTBEAT_GAP_S
ago (the worker key lives for minutes, and workers.main's Heartbeat thread beats during jobs), and
the two preparation pipelines go out as one, together with a read of the job's cancel flag (the
job function would otherwise ask for it in a round trip of its own before generating). What is
written to Redis is unchanged.
"""

from __future__ import annotations

import math
import time

from rq import SimpleWorker
from rq.executions import Execution
from rq.job import Job
from rq.utils import now
from rq.worker import WorkerStatus

from jobs import keys

BARE_HEARTBEAT_GAP_S = 1.0
"""RQ's own bare worker heartbeats closer together than this are skipped."""


class Worker(SimpleWorker):
    """SimpleWorker (no fork: models stay resident) with batched heartbeats and job preparation."""

    log_result_lifespan = False  # "result is kept for N seconds" on every job says nothing new

    _last_bare_heartbeat = -math.inf
    _prepared_job_id: str | None = None

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

    def prepare_execution(self, job: Job) -> Execution:
        """RQ's execution record, the job's started state and its cancel flag, in one pipeline."""
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
            pipeline.exists(keys.cancel_flag(job.id))
            canceled = pipeline.execute()[-1]
        job.cancel_flag_at_start = bool(canceled)  # read by workers.tasks before it generates
        self._prepared_job_id = job.id
        return execution

    def prepare_job_execution(self, job: Job, remove_from_intermediate_queue: bool = False) -> None:
        """Skip RQ's second preparation pipeline when prepare_execution already sent it."""
        if self._prepared_job_id == job.id and not remove_from_intermediate_queue:
            self._prepared_job_id = None
            return
        super().prepare_job_execution(job, remove_from_intermediate_queue)
