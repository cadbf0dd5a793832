"""The GPU worker's RQ class on a real Redis: batching its round trips changes nothing RQ records."""

from __future__ import annotations

import pytest
import redis
from rq import get_current_job
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer

from jobs import keys
from jobs.queues import BATCH, INTERACTIVE, enqueue, get_queue, new_job_id
from workers.rqworker import SentTransaction, Worker

SNAPSHOT = "tests.workers.test_rqworker.snapshot"


def snapshot(payload: dict) -> dict:
    """Job function: what Redis says about this job and its worker while the job runs."""
    job = get_current_job()
    conn = job.connection
    stored = Job.fetch(job.id, connection=conn, serializer=JSONSerializer)
    started = StartedJobRegistry(job.origin, connection=conn, serializer=JSONSerializer)
    return {"status": stored.get_status(), "worker_name": stored.worker_name,
            "started_at_set": stored.started_at is not None,
            "in_started_registry": job.id in started.get_job_ids(),
            "worker_state": conn.hget(payload["worker_key"], "state").decode(),
            "job_key_ttl": conn.ttl(job.key), "echo": payload["n"],
            "cancel_flag_when_fetched": getattr(job, "cancel_flag_when_fetched", None)}


def test_jobs_run_with_rq_state_as_plain_rq_records_it(redis_conn, settings):
    worker = Worker([get_queue(q, redis_conn) for q in (INTERACTIVE, BATCH)], connection=redis_conn,
                    serializer=JSONSerializer, name=f"test-{new_job_id('w')}")
    ids = []
    for n in range(3):
        job_id = new_job_id("snap")
        enqueue(redis_conn, settings, INTERACTIVE, SNAPSHOT, {"n": n, "worker_key": worker.key}, job_id)
        ids.append(job_id)
    redis_conn.set(keys.cancel_flag(ids[1]), 1)  # a client gave up on the second while it was queued

    assert worker.work(burst=True)

    for n, job_id in enumerate(ids):
        job = Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)
        seen = job.return_value()
        # While it ran: started, owned by this worker, in the started registry, the worker busy,
        # the job key persisted (RQ removes its TTL for the run).
        # The cancel flag was read with the job, in the same round trip, for the job function to use.
        assert seen == {"status": JobStatus.STARTED, "worker_name": worker.name, "started_at_set": True,
                        "in_started_registry": True, "worker_state": "busy", "job_key_ttl": -1, "echo": n,
                        "cancel_flag_when_fetched": n == 1}
        # Afterwards: finished, out of the started registry, with its result kept.
        assert job.get_status() == JobStatus.FINISHED
        assert job_id not in StartedJobRegistry(INTERACTIVE, connection=redis_conn).get_job_ids()
    assert worker._prepared_job_id is None, "every skipped second preparation was consumed"
    assert worker._preparation is None, "every preparation's reply was read"


def test_bare_heartbeats_are_pipelined_and_spaced(redis_conn, monkeypatch):
    monkeypatch.setattr("workers.rqworker.BARE_HEARTBEAT_GAP_S", 3600.0)  # a slow machine can't make it pass
    worker = Worker([get_queue(INTERACTIVE, redis_conn)], connection=redis_conn, serializer=JSONSerializer)
    worker.register_birth()
    redis_conn.hdel(worker.key, "last_heartbeat")
    worker.heartbeat()
    first = redis_conn.hget(worker.key, "last_heartbeat")
    assert first is not None and redis_conn.ttl(worker.key) > 0
    redis_conn.hdel(worker.key, "last_heartbeat")
    worker.heartbeat()  # within BARE_HEARTBEAT_GAP_S of the last one: skipped
    assert redis_conn.hget(worker.key, "last_heartbeat") is None
    worker.heartbeat(timeout=120)  # an explicit timeout always goes out
    assert redis_conn.hget(worker.key, "last_heartbeat") is not None
    assert 0 < redis_conn.ttl(worker.key) <= 120


def failing(payload: dict) -> None:
    """Job function that raises at once, before anything else touches Redis."""
    raise RuntimeError("no")


def run_one_job(redis_conn, settings, func: str, worker_class: type[Worker] = Worker) -> tuple[Worker, Job]:
    """Enqueue `func({})` on the interactive queue, run a burst worker of `worker_class` on the GPU
    worker's two queues, and return the worker and the job as Redis holds it afterwards.

    Two queues, as workers.main runs it: on a single queue RQ prepares the job a second time itself.
    """
    worker = worker_class([get_queue(q, redis_conn) for q in (INTERACTIVE, BATCH)], connection=redis_conn,
                          serializer=JSONSerializer, name=f"test-{new_job_id('w')}")
    job_id = new_job_id("one")
    enqueue(redis_conn, settings, INTERACTIVE, func, {}, job_id)
    worker.work(burst=True)
    return worker, Job.fetch(job_id, connection=redis_conn, serializer=JSONSerializer)


def test_a_failing_job_is_recorded_failed_after_its_unconfirmed_start(redis_conn, settings):
    worker, job = run_one_job(redis_conn, settings, "tests.workers.test_rqworker.failing")
    job_id = job.id

    assert job.get_status() == JobStatus.FAILED
    assert job.worker_name == worker.name
    # The start, sent unconfirmed, reached Redis before the end: else it would still be registered.
    assert job_id not in StartedJobRegistry(INTERACTIVE, connection=redis_conn).get_job_ids()
    assert worker._preparation is None


def test_a_sent_transaction_applies_its_commands_and_returns_its_connection(redis_conn):
    key = f"test:{new_job_id('tx')}"
    pipeline = redis_conn.pipeline()
    pipeline.hset(key, mapping={"a": "1", "b": "2"})
    pipeline.expire(key, 60)
    sent = SentTransaction(pipeline)
    assert sent.pending
    assert redis_conn.hgetall(key) == {b"a": b"1", b"b": b"2"}, "applied before anyone read the reply"
    sent.confirm()
    sent.confirm()  # a second confirm reads nothing
    assert not sent.pending
    assert redis_conn.connection_pool._in_use_connections == set(), "its connection went back to the pool"


def test_a_sent_transaction_raises_the_error_redis_gave_and_leaves_the_pool_usable(redis_conn):
    key = f"test:{new_job_id('tx')}"
    redis_conn.set(key, "a string")
    pipeline = redis_conn.pipeline()
    pipeline.hset(key, "field", "value")  # WRONGTYPE, reported inside EXEC's reply
    sent = SentTransaction(pipeline)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        sent.confirm()
    pipeline = redis_conn.pipeline()
    pipeline.execute_command("HSET", key)  # wrong arity: refused when queued, EXEC aborts
    sent = SentTransaction(pipeline)
    with pytest.raises(redis.ResponseError):
        sent.confirm()
    assert redis_conn.get(key) == b"a string"
    assert redis_conn.connection_pool._in_use_connections == set()
    assert redis_conn.ping()


def answer(payload: dict) -> str:
    """Job function that answers at once."""
    return "answered"


class LosingWorker(Worker):
    """The worker, except that its connection drops before the preparation's reply is read."""

    def perform_job(self, job, queue, execution):
        """Drop the connection that holds the unread reply, then run the job as usual."""
        self._preparation._connection.disconnect()
        return super().perform_job(job, queue, execution)


def test_a_job_whose_preparation_reply_was_lost_still_records_its_outcome(redis_conn, settings):
    worker, job = run_one_job(redis_conn, settings, "tests.workers.test_rqworker.answer", LosingWorker)
    job_id = job.id

    assert job.get_status() == JobStatus.FINISHED, "a lost reply to the start does not fail a job that answered"
    assert job.return_value() == "answered"
    assert job_id not in StartedJobRegistry(INTERACTIVE, connection=redis_conn).get_job_ids()
    assert worker._preparation is None
    assert redis_conn.connection_pool._in_use_connections == set()
