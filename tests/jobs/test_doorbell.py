"""The GPU worker's doorbell on a real Redis: a job rings it, and one reply carries the claimed job."""

from __future__ import annotations

import threading

import pytest
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.serializers import JSONSerializer

from jobs import keys, queues

FUNC = "tests.jobs.nothing"


def worker_queues(conn):
    """The GPU worker's queues, in its order."""
    return [queues.get_queue(name, conn) for name in queues.WORKER_QUEUES]


def dequeue(conn, timeout):
    """What the worker's RQ loop calls: DoorbellQueue.dequeue_any over its queues."""
    return queues.DoorbellQueue.dequeue_any(worker_queues(conn), timeout, connection=conn,
                                            serializer=JSONSerializer)


def test_an_enqueued_job_rings_once_and_is_claimed_whole_with_its_cancel_flag(redis_conn, settings):
    job_id = queues.new_job_id("t")
    queues.enqueue(redis_conn, settings, queues.INTERACTIVE, FUNC, {"n": 7}, job_id, description="seven")
    assert redis_conn.lrange(keys.WORKER_DOORBELL, 0, -1) == [b"1"]
    redis_conn.set(keys.cancel_flag(job_id), 1)

    job, queue = dequeue(redis_conn, timeout=5)

    assert (job.id, queue.name, job.description, job.args) == (job_id, queues.INTERACTIVE, "seven", [{"n": 7}])
    assert job.cancel_flag_when_fetched is True
    assert queue.count == 0 and not redis_conn.exists(keys.WORKER_DOORBELL)


def test_webhook_deliveries_ring_nothing(redis_conn, settings):
    queues.enqueue(redis_conn, settings, queues.WEBHOOKS, FUNC, {}, queues.new_job_id("t"))
    assert not redis_conn.exists(keys.WORKER_DOORBELL)


def test_interactive_jobs_are_claimed_before_batch_ones_whatever_the_order_they_came_in(redis_conn, settings):
    batch = queues.enqueue(redis_conn, settings, queues.BATCH, FUNC, {}, queues.new_job_id("b"))
    chat = queues.enqueue(redis_conn, settings, queues.INTERACTIVE, FUNC, {}, queues.new_job_id("c"))
    claimed = [dequeue(redis_conn, timeout=5)[0].id for _ in range(2)]
    assert claimed == [chat.id, batch.id]
    assert dequeue(redis_conn, timeout=None) is None


def test_a_blocked_worker_is_woken_by_the_doorbell_not_by_its_poll(redis_conn, settings, monkeypatch):
    monkeypatch.setattr(queues, "DOORBELL_POLL_S", 60)  # only a ring can end the wait within the join
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(dequeue(redis_conn.__class__(
        connection_pool=redis_conn.connection_pool), timeout=60)), daemon=True)
    waiter.start()
    job_id = queues.new_job_id("t")
    queues.enqueue(redis_conn, settings, queues.INTERACTIVE, FUNC, {}, job_id)
    waiter.join(timeout=20)
    assert not waiter.is_alive(), "the enqueue's token did not wake the blocked dequeue"
    assert got and got[0][0].id == job_id


def test_jobs_that_rang_nothing_are_found_by_the_poll_and_then_without_waiting(redis_conn):
    # Jobs pushed by another RQ client (rq-dashboard's requeue) carry no token.
    plain = Queue(queues.INTERACTIVE, connection=redis_conn, serializer=JSONSerializer)
    ids = [plain.enqueue(FUNC, {}, job_id=queues.new_job_id("p")).id for _ in range(3)]
    assert not redis_conn.exists(keys.WORKER_DOORBELL)

    first, _ = dequeue(redis_conn, timeout=5)  # after one poll (DOORBELL_POLL_S)
    # Jobs are left, so the claim left a token: the next waits see it at once.
    assert redis_conn.llen(keys.WORKER_DOORBELL) == 1
    rest = [dequeue(redis_conn, timeout=5)[0].id for _ in range(2)]
    assert [first.id, *rest] == ids


def test_stale_tokens_are_cleared_and_an_empty_wait_times_out(redis_conn):
    redis_conn.rpush(keys.WORKER_DOORBELL, 1, 1, 1)  # e.g. jobs taken back over the queue limit
    with pytest.raises(DequeueTimeout):
        dequeue(redis_conn, timeout=5)
    assert not redis_conn.exists(keys.WORKER_DOORBELL)


def test_ids_whose_job_is_gone_are_dropped_as_rq_drops_them(redis_conn, settings):
    gone = queues.enqueue(redis_conn, settings, queues.INTERACTIVE, FUNC, {}, queues.new_job_id("g"))
    kept = queues.enqueue(redis_conn, settings, queues.INTERACTIVE, FUNC, {}, queues.new_job_id("k"))
    redis_conn.delete(gone.key)
    job, _ = dequeue(redis_conn, timeout=5)
    assert job.id == kept.id
    assert job.cancel_flag_when_fetched is False
    assert queues.get_queue(queues.INTERACTIVE, redis_conn).count == 0
