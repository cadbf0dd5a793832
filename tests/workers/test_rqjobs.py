"""What the scheduler records in RQ, as RQ and rq-dashboard read it back (fails if an RQ release changes it)."""

from __future__ import annotations

import time

from rq import Queue, Worker
from rq.job import JobStatus
from rq.serializers import JSONSerializer

from jobs import queues
from workers import rqjobs


def _queued(conn, settings, job_id: str, queue: str = queues.INTERACTIVE):
    return queues.enqueue(conn, settings, queue, queues.CHAT_COMPLETION, {"id": job_id}, job_id)


def test_take_serves_interactive_before_batch_and_returns_none_when_empty(redis_conn, settings):
    _queued(redis_conn, settings, "job-batch", queues.BATCH)
    _queued(redis_conn, settings, "job-now")
    both = [queues.get_queue(q, redis_conn) for q in queues.WORKER_QUEUES]
    assert [rqjobs.take(both, redis_conn)[0].id for _ in range(2)] == ["job-now", "job-batch"]
    assert rqjobs.take(both, redis_conn) is None
    assert rqjobs.take(both, redis_conn, wait_s=1) is None  # waited, then gave up


def test_a_job_is_started_heartbeaten_then_finished_with_its_return_value(redis_conn, settings):
    job = _queued(redis_conn, settings, "job-1")
    [(taken, _)] = [rqjobs.take([queues.get_queue(queues.INTERACTIVE, redis_conn)], redis_conn)]
    execution = rqjobs.start(taken, "worker-a")
    fetched = queues.fetch_job(redis_conn, job.id)
    assert fetched.get_status() == JobStatus.STARTED and fetched.worker_name == "worker-a"
    started = taken.started_job_registry
    assert started.get_job_ids(cleanup=False) == ["job-1"]
    # Heartbeats keep every running job in its registry, in one call: an entry about to expire is renewed.
    _queued(redis_conn, settings, "job-other")
    other, _ = rqjobs.take([queues.get_queue(queues.INTERACTIVE, redis_conn)], redis_conn)
    other_execution = rqjobs.start(other, "worker-a")
    entries = [f"job-1:{execution.id}", f"job-other:{other_execution.id}"]
    redis_conn.zadd(started.key, {entry: time.time() + 1 for entry in entries})
    rqjobs.heartbeat([(taken, execution), (other, other_execution)])
    assert all(redis_conn.zscore(started.key, entry) > time.time() + 10 for entry in entries)
    rqjobs.succeed(other, other_execution, None)
    rqjobs.succeed(taken, execution, {"answer": 42})
    fetched = queues.fetch_job(redis_conn, job.id)
    assert fetched.get_status() == JobStatus.FINISHED and fetched.return_value() == {"answer": 42}
    assert started.get_job_ids(cleanup=False) == []
    assert sorted(taken.finished_job_registry.get_job_ids()) == ["job-1", "job-other"]


def test_jobs_claimed_together_are_started_together_as_one_would_be(redis_conn, settings):
    for i in range(3):
        _queued(redis_conn, settings, f"job-burst-{i}")
    queue = queues.get_queue(queues.INTERACTIVE, redis_conn)
    jobs = rqjobs.claim_many(queue, [f"job-burst-{i}" for i in range(3)])
    executions = rqjobs.start_many(jobs, "worker-a")
    assert len({e.id for e in executions}) == 3
    for job, execution in zip(jobs, executions, strict=True):
        fetched = queues.fetch_job(redis_conn, job.id)
        assert fetched.get_status() == JobStatus.STARTED and fetched.worker_name == "worker-a"
        assert execution.job_id == job.id
    assert sorted(jobs[0].started_job_registry.get_job_ids(cleanup=False)) == [f"job-burst-{i}" for i in range(3)]
    for job, execution in zip(jobs, executions, strict=True):
        rqjobs.succeed(job, execution, None)
    assert jobs[0].started_job_registry.get_job_ids(cleanup=False) == []
    assert rqjobs.start_many([], "worker-a") == []


def test_a_failed_job_keeps_its_reason(redis_conn, settings):
    _queued(redis_conn, settings, "job-2")
    taken, _ = rqjobs.take([queues.get_queue(queues.INTERACTIVE, redis_conn)], redis_conn)
    execution = rqjobs.start(taken, "worker-a")
    rqjobs.fail(taken, execution, "canceled: the job was canceled")
    fetched = queues.fetch_job(redis_conn, "job-2")
    assert fetched.get_status() == JobStatus.FAILED
    assert "the job was canceled" in fetched.latest_result().exc_string
    assert taken.failed_job_registry.get_job_ids() == ["job-2"]
    assert taken.started_job_registry.get_job_ids(cleanup=False) == []


def test_claim_many_takes_exactly_the_jobs_still_queued_in_queue_order(redis_conn, settings):
    for job_id in ("job-a", "job-b", "job-c", "job-d"):
        _queued(redis_conn, settings, job_id)
    queue = queues.get_queue(queues.INTERACTIVE, redis_conn)
    assert rqjobs.claim(queue, "job-b").id == "job-b"  # another worker took this one first
    taken = rqjobs.claim_many(queue, ["job-a", "job-b", "job-d", "job-gone"])
    assert [job.id for job in taken] == ["job-a", "job-d"]
    assert queue.get_job_ids() == ["job-c"]
    assert rqjobs.claim_many(queue, ["job-a"]) == [] and rqjobs.claim_many(queue, []) == []


def test_the_worker_is_listed_as_rq_dashboard_lists_workers(redis_conn):
    worker = rqjobs.register([Queue(queues.INTERACTIVE, connection=redis_conn)], redis_conn, "mlxq-test")
    assert [w.name for w in Worker.all(connection=redis_conn, serializer=JSONSerializer)] == ["mlxq-test"]
    worker.register_death()
    assert Worker.all(connection=redis_conn) == []


def test_payload_and_logical_id_unwrap_the_request_a_job_carries(redis_conn, settings):
    continuation = queues.enqueue(redis_conn, settings, queues.BATCH, queues.TRANSCRIPTION, {"id": "job-3"}, "job-3_1")
    assert rqjobs.payload(continuation) == {"id": "job-3"} and rqjobs.logical_id(continuation) == "job-3"
    bare = queues.get_queue(queues.BATCH, redis_conn).enqueue(queues.TRANSCRIPTION, "not a dict", job_id="job-4")
    assert rqjobs.payload(bare) == {} and rqjobs.logical_id(bare) == "job-4"


def test_started_lists_running_jobs_and_drops_expired_ones_and_retire_fails_one(redis_conn, settings):
    for job_id in ("job-live", "job-gone"):
        _queued(redis_conn, settings, job_id, queues.BATCH)
    batch = queues.get_queue(queues.BATCH, redis_conn)
    executions = {}
    for _ in range(2):
        taken, _ = rqjobs.take([batch], redis_conn)
        executions[taken.id] = rqjobs.start(taken, "worker-dead")
    redis_conn.delete(queues.fetch_job(redis_conn, "job-gone").key)  # its hash expired
    [(job, execution_id)] = rqjobs.started(queues.BATCH, redis_conn)
    assert job.id == "job-live" and execution_id == executions["job-live"].id
    assert batch.started_job_registry.get_job_ids(cleanup=False) == ["job-live"]
    rqjobs.retire(job, execution_id, "the worker worker-dead died while running this job")
    assert batch.started_job_registry.get_job_ids(cleanup=False) == []
    fetched = queues.fetch_job(redis_conn, "job-live")
    assert fetched.get_status() == JobStatus.FAILED and "died" in fetched.latest_result().exc_string
    assert batch.failed_job_registry.get_job_ids() == ["job-live"]
