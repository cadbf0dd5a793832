"""Publishing without waiting: a delta sent now, its reply (last id, cancel flag) read later, on a real Redis."""

from __future__ import annotations

import pytest
import redis

from jobs import keys
from jobs.events import DELTA, DONE, EventPublisher, read_log
from tests.conftest import wait_until


@pytest.fixture()
def publisher(redis_conn):
    """A publisher on the test Redis."""
    return EventPublisher(redis_conn, ttl_s=60, log_max=100)


def test_a_sent_publish_takes_effect_before_its_reply_is_read(redis_conn, publisher):
    sent = publisher.send_many("job-sent", [(DELTA, {"text": "Par"})])
    assert sent.pending
    logged = wait_until(lambda: read_log(redis_conn, "job-sent"), 5, what="the sent delta in the log")
    assert [(e["id"], e["type"], e["data"]) for e in logged] == [(1, DELTA, {"text": "Par"})]
    assert sent.pending, "the sender must not have waited for the reply"
    assert sent.result() == (1, False) and not sent.pending
    assert sent.result() == (1, False)  # idempotent
    assert publisher.publish_many("job-sent", [(DONE, {"text": "Paris"})]) == (2, False)


def test_the_reply_reports_a_cancel(redis_conn, publisher):
    redis_conn.set(keys.cancel_flag("job-canceled"), 1)
    assert publisher.send_many("job-canceled", [(DELTA, {"text": "x"})]).result() == (1, True)


def test_replies_read_or_discarded_give_their_connection_back(redis_conn, publisher):
    publisher.publish("warm-up", DELTA, {})  # the pool's first connection exists
    before = len(redis_conn.client_list())
    for n in range(20):
        sent = publisher.send_many(f"job-many-{n}", [(DELTA, {"text": str(n)})])
        if n % 2:
            sent.discard()  # leaving on an error: no reply read, the connection dropped
        else:
            assert sent.result() == (1, False)
    assert len(redis_conn.client_list()) <= before + 1
    wait_until(lambda: all(read_log(redis_conn, f"job-many-{n}") for n in range(20)), 5,
               what="every delta in its log")


def test_a_lost_reply_raises_instead_of_hanging(redis_conn, publisher):
    sent = publisher.send_many("job-lost", [(DELTA, {"text": "x"})])
    sent.discard()
    with pytest.raises(redis.ConnectionError, match="lost"):
        sent.result()
