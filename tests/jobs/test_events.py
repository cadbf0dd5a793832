"""The publish script on a real Redis: ids in order, one terminal event, the cancel flag, safe resends."""

from __future__ import annotations

import pytest

from jobs import keys
from jobs.events import (
    _PUBLISH_ALL_LUA,
    _PUBLISH_LUA,
    DELTA,
    DONE,
    ERROR,
    EventPublisher,
    has_ended,
    read_log,
)


@pytest.fixture()
def publisher(redis_conn):
    """A publisher on the test Redis."""
    return EventPublisher(redis_conn, ttl_s=60, log_max=100)


def test_events_get_consecutive_ids_and_the_log_keeps_their_order(redis_conn, publisher):
    assert publisher.publish_many("job-a", [(DELTA, {"text": "Pa"}), (DELTA, {"text": "ris"})]) == (2, False)
    assert publisher.publish("job-a", DONE, {"text": "Paris"}) == 3
    assert [(e["id"], e["type"]) for e in read_log(redis_conn, "job-a")] == [(1, DELTA), (2, DELTA), (3, DONE)]
    assert has_ended(redis_conn, "job-a")


def test_nothing_follows_the_terminal_event(redis_conn, publisher):
    publisher.publish("job-b", ERROR, {"message": "gone", "code": "worker_died", "status": 500})
    assert publisher.publish("job-b", DONE, {}) == 0  # a late `done` is dropped
    assert [e["type"] for e in read_log(redis_conn, "job-b")] == [ERROR]


def test_after_a_cancel_only_the_terminal_event_goes_out_and_the_reply_says_so(redis_conn, publisher):
    assert publisher.publish_many("job-c", [(DELTA, {"text": "x"})]) == (1, False)
    redis_conn.set(keys.cancel_flag("job-c"), 1)
    assert publisher.publish_many("job-c", [(DELTA, {"text": "y"})]) == (0, True)
    assert publisher.publish_many("job-c", [(DELTA, {"text": "z"}), (ERROR, {"code": "canceled"})]) == (2, True)
    assert [(e["id"], e["type"]) for e in read_log(redis_conn, "job-c")] == [(1, DELTA), (2, ERROR)]


def test_a_resent_publish_is_applied_once(redis_conn, publisher):
    # What a worker's retried command does after the connection dropped with the reply in flight.
    args = [60, 100, "token-1", DELTA, '{"text":"x"}']
    job_keys = [keys.event_seq("job-d"), keys.event_log("job-d"), keys.event_channel("job-d"),
                keys.cancel_flag("job-d")]
    assert redis_conn.eval(_PUBLISH_LUA, 4, *job_keys, *args) == [1, 0]
    assert redis_conn.eval(_PUBLISH_LUA, 4, *job_keys, *args) == [1, 0]
    assert len(read_log(redis_conn, "job-d")) == 1
    assert publisher.publish("job-d", DELTA, {"text": "y"}) == 2  # a new publish goes on as usual


def test_a_resent_publish_of_several_jobs_is_applied_once_for_each(redis_conn, publisher):
    # One call for a decode step's jobs: two events for job-h, one for job-i, the same token if it is sent again.
    job_keys = [k for job in ("job-h", "job-i") for k in (keys.event_seq(job), keys.event_log(job),
                                                          keys.event_channel(job), keys.cancel_flag(job))]
    args = [60, 100, "token-2", 2, DELTA, '{"text":"a"}', DELTA, '{"text":"b"}', 1, DONE, "{}"]
    assert redis_conn.eval(_PUBLISH_ALL_LUA, 8, *job_keys, *args) == [2, 0, 1, 0]
    assert redis_conn.eval(_PUBLISH_ALL_LUA, 8, *job_keys, *args) == [2, 0, 1, 0]
    assert [e["data"].get("text") for e in read_log(redis_conn, "job-h")] == ["a", "b"]
    assert [e["type"] for e in read_log(redis_conn, "job-i")] == [DONE]
    # A later step goes on: job-h's next event, and job-i's none (it ended: 0, nothing published).
    assert publisher.publish_all([("job-h", [(DELTA, {"text": "c"})]), ("job-i", [(DELTA, {"text": "d"})])]) == [
        (3, False), (0, False)]
    assert len(read_log(redis_conn, "job-i")) == 1


def test_a_job_named_twice_in_one_call_gets_all_its_events_in_order(redis_conn, publisher):
    batches = [("job-j", [(DELTA, {"text": "a"})]), ("job-k", [(DELTA, {"text": "b"})]),
               ("job-j", [(DELTA, {"text": "c"})])]
    assert publisher.publish_all(batches) == [(2, False), (1, False), (2, False)]
    assert [e["data"]["text"] for e in read_log(redis_conn, "job-j")] == ["a", "c"]


def test_several_jobs_publish_in_one_round_trip_even_after_redis_lost_its_scripts(redis_conn, publisher):
    redis_conn.set(keys.cancel_flag("job-f"), 1)
    batches = [("job-e", [(DELTA, {"text": "a"})]), ("job-f", [(DELTA, {"text": "b"})])]
    assert publisher.publish_pipelined(batches) == [False, True]
    redis_conn.script_flush()  # what a restarted Redis has: no scripts
    assert publisher.publish_pipelined([("job-e", [(DELTA, {"text": "c"})]), ("job-g", [(DONE, {})])]) == [False, False]
    assert [e["data"]["text"] for e in read_log(redis_conn, "job-e")] == ["a", "c"]
    assert read_log(redis_conn, "job-f") == [] and [e["type"] for e in read_log(redis_conn, "job-g")] == [DONE]
