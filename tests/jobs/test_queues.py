"""Enqueueing on a real Redis: the queue limit is checked in the enqueue's own transaction."""

from __future__ import annotations

import pytest

from jobs import queues


def test_a_job_over_the_limit_is_taken_back_whole(redis_conn, settings):
    limited = settings.with_overrides(max_queued=2)
    kept = [queues.new_job_id("t") for _ in range(2)]
    for job_id in kept:
        queues.enqueue(redis_conn, limited, "limit-test", "tests.jobs.nothing", {}, job_id)
    refused = queues.new_job_id("t")
    with pytest.raises(queues.QueueFull, match="holds 2 jobs"):
        queues.enqueue(redis_conn, limited, "limit-test", "tests.jobs.nothing", {}, refused, at_front=True)
    assert redis_conn.lrange("rq:queue:limit-test", 0, -1) == [j.encode() for j in kept]
    assert not redis_conn.exists(f"rq:job:{refused}")


def test_a_job_a_worker_already_took_is_not_taken_back(redis_conn, settings):
    # The race the take-back allows for: between the enqueue and the take-back, a worker popped it.
    job = queues.enqueue(redis_conn, settings, "race-test", "tests.jobs.nothing", {}, queues.new_job_id("t"))
    assert redis_conn.lpop("rq:queue:race-test") == job.id.encode()
    assert queues._take_back(redis_conn, queues.get_queue("race-test", redis_conn), job) is False
    assert redis_conn.exists(job.key), "the running job's hash must stay"
