"""The worker through Redis outages. Its client retries each command for about a minute, so a restart is
ridden out inside the command (end to end: tests/integration/test_redis_restart.py). Past that, the
scheduler, against a real redis-server restarted from its append-only file, waits Redis out, then hands
a transcription back from its checkpoint (jobs.lifecycle.continue_job), and the continuation ends it with
the uninterrupted text."""

from __future__ import annotations

import logging
import threading

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.job import JobStatus

from jobs import records
from jobs.connection import PATIENT_RETRIES, get_redis, reset_clients
from jobs.queues import fetch_job
from tests.conftest import RedisServer, wait_until
from tests.workers.test_speech import (  # noqa: F401  (fixtures)
    assert_succeeded,
    half_minute,
    half_minute_text,
    model,
    ref,
    scheduler,
    submit,
    worker_parts,
)


def test_the_workers_client_retries_a_command_for_about_a_minute(redis_url, monkeypatch):
    # The retry policy's waits, added up without being slept: a restart of Redis that takes many seconds (a
    # big append-only file to load) is ridden out, where redis-py's own default gives up within seconds.
    waits: list[float] = []
    monkeypatch.setattr("redis.retry.sleep", waits.append)

    def down():
        raise redis.ConnectionError("Redis is away")

    try:
        with pytest.raises(redis.ConnectionError):
            get_redis(redis_url, patient=True).get_retry().call_with_retry(down, lambda error: None)
    finally:
        reset_clients()
    assert len(waits) == PATIENT_RETRIES and 60 <= sum(waits) <= 120, sum(waits)


@pytest.fixture()
def server():
    """A durable Redis of its own (a restart keeps the queues, records and checkpoints)."""
    server = RedisServer(durable=True).start()
    yield server
    server.stop()


def test_a_long_outage_is_waited_out_then_a_transcription_resumes_from_its_checkpoint(
        server, settings, ref, worker_parts, half_minute, half_minute_text, caplog):  # noqa: F811
    # A client without retries (redis-py's own default retries for seconds): each command fails as soon as
    # Redis is gone, as the worker's do once an outage outlasts their minute of retries.
    conn = redis.Redis.from_url(server.url, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    settings = settings.with_overrides(redis_url=server.url)
    submit(conn, settings, ref, "job-outage", half_minute)
    run = scheduler(conn, settings, worker_parts)
    assert run.step()  # the first window: checkpointed and published
    server.halt()
    caplog.set_level(logging.ERROR, logger="workers.scheduler")
    worker = threading.Thread(target=run.run, daemon=True)
    worker.start()
    wait_until(lambda: "Redis unreachable" in caplog.text, 60, what="the scheduler to wait for Redis")
    server.start()
    worker.join(timeout=300)
    assert not worker.is_alive()
    assert fetch_job(conn, "job-outage").return_value() == {"handed_back_to": "job-outage_1"}
    assert fetch_job(conn, "job-outage_1").get_status() == JobStatus.FINISHED
    assert records.get(conn, "job-outage")["attempts"] == 1  # handed back: not a new start
    assert assert_succeeded(conn, "job-outage")["text"] == half_minute_text
