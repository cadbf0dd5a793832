"""The worker's heartbeat through a Redis outage: it retries quickly once a beat fails, so its liveness key
is back as soon as Redis is (a web process following a job meanwhile would take the worker for dead).

A real Redis that goes down and comes back, and the real Heartbeat thread; the scheduler it reports on is
a stand-in holding no work (what a heartbeat reads of it is its name, queues and an empty list of jobs).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import redis

from jobs import keys
from jobs.queues import get_queue, worker_queue_names
from jobs.settings import load_settings
from tests.conftest import RedisServer, wait_until
from workers.main import BEAT_RETRY_S, Heartbeat

BEAT_S = 2.0
"""The heartbeat's own pace in this test: at it, five beats would take eight seconds."""


@pytest.fixture()
def outage_redis():
    """A Redis of this test's own (it is stopped and started again)."""
    server = RedisServer().start()
    yield server
    server.stop()


def test_failed_beats_are_retried_quickly_and_the_key_is_back_once_redis_is(outage_redis, models_dir, tmp_path, caplog):
    settings = load_settings({"redis_url": outage_redis.url, "models_dir": models_dir, "spool_dir": tmp_path,
                              "worker_heartbeat_s": BEAT_S, "worker_dead_after_s": 3 * BEAT_S})
    conn = redis.Redis.from_url(outage_redis.url, socket_connect_timeout=1, socket_timeout=1)
    scheduler = SimpleNamespace(
        conn=conn, name="mlxq-heartbeat-test", serves=["text"],
        queues={name: get_queue(name, conn) for name in worker_queue_names(["text"])},
        models=SimpleNamespace(budget_bytes=0, cache_bytes=0, snapshot=[]), active=lambda: [])
    caplog.set_level(logging.DEBUG, logger="workers.main")
    heartbeat = Heartbeat(scheduler, settings).start()
    try:
        assert conn.exists(keys.worker_alive(scheduler.name))
        outage_redis.halt()
        # The next beat (within BEAT_S) fails; the retries come every BEAT_RETRY_S, not every BEAT_S.
        failures = lambda: sum(r.levelno == logging.DEBUG and r.message.startswith("heartbeat failed")  # noqa: E731
                               for r in caplog.records)
        wait_until(lambda: failures() >= 5, BEAT_S + 2.5, what="five heartbeat tries within a pace and a bit")
        outage_redis.start()  # the same port; nothing persisted: the liveness key is gone
        wait_until(lambda: conn.exists(keys.worker_alive(scheduler.name)), BEAT_S * 0.75,
                   what="the liveness key, back sooner than the next beat at the heartbeat's own pace")
    finally:
        heartbeat.stop()
    assert BEAT_RETRY_S < BEAT_S / 10
