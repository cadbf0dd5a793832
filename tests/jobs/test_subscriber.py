"""The event hub against a real Redis: live delivery to followers, and surviving a lost connection."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import redis

from jobs.events import DELTA, DONE, EventPublisher
from jobs.subscriber import EventHub, follow
from tests.conftest import wait_until

NO_CATCH_UP_S = 60.0
"""follow()'s idle re-read of the log, set beyond each test's bounded waits: events must come live."""


def follow_in_thread(hub: EventHub, job_id: str) -> queue.Queue:
    """Follow a job's events on a thread; each event (and finally None) lands in the returned queue."""
    out: queue.Queue = queue.Queue()

    def run():
        for event in follow(hub, job_id, idle_s=NO_CATCH_UP_S):
            out.put(event)
        out.put(None)

    threading.Thread(target=run, daemon=True).start()
    return out


def received(out: queue.Queue, timeout: float = 5.0) -> list[dict]:
    """Events until the end of the follow, each awaited at most `timeout` seconds."""
    events = []
    while (event := out.get(timeout=timeout)) is not None:
        events.append(event)
    return events


@pytest.fixture()
def hub(redis_conn):
    """An event hub on the test Redis, its pattern subscription in place."""
    hub = EventHub(redis_conn)
    with hub.listen("warm-up"):
        wait_until(lambda: redis_conn.pubsub_numpat() == 1, 5, what="the hub's subscription")
    yield hub
    hub.close()  # its thread would otherwise outlive the test's Redis and complain about it


def publish_answer(redis_conn, job_id: str) -> None:
    """Two deltas and the terminal event, as a worker publishes them."""
    publisher = EventPublisher(redis_conn, ttl_s=60, log_max=100)
    publisher.publish(job_id, DELTA, {"text": "Par"})
    publisher.publish_many(job_id, [(DELTA, {"text": "is"}), (DONE, {"text": "Paris"})])


def wait_for_listener(hub: EventHub, job_id: str) -> None:
    """Until the follower registered its listener (events before it come from the log, not live)."""
    wait_until(lambda: job_id in hub._listeners, 5, what="the follower's listener")


def test_a_follower_gets_the_events_live_in_order_and_stops_at_the_terminal_one(redis_conn, hub):
    out = follow_in_thread(hub, "job-live")
    wait_for_listener(hub, "job-live")
    publish_answer(redis_conn, "job-live")
    events = received(out)
    assert [(e["id"], e["type"]) for e in events] == [(1, DELTA), (2, DELTA), (3, DONE)]
    assert "".join(e["data"]["text"] for e in events[:2]) == events[2]["data"]["text"]


def test_the_hub_subscribes_again_after_its_connection_is_killed(redis_conn, hub):
    publisher = EventPublisher(redis_conn, ttl_s=60, log_max=100)
    with hub.listen("probe") as probe:
        assert redis_conn.client_kill_filter(_type="pubsub") >= 1  # this hub's, and earlier tests' hubs

        def probe_arrives() -> bool:
            # Events published while the hub reconnects are lost live (follow() re-reads the log for
            # them), so probe until one comes through.
            publisher.publish("probe", DELTA, {"text": "ping"})
            try:
                return probe.get(timeout=0.2)["type"] == DELTA
            except queue.Empty:
                return False

        wait_until(probe_arrives, 10, interval=0, what="a live event after the kill")
    out = follow_in_thread(hub, "job-after-kill")
    wait_for_listener(hub, "job-after-kill")
    publish_answer(redis_conn, "job-after-kill")
    assert [e["type"] for e in received(out)] == [DELTA, DELTA, DONE]


def test_an_idle_hub_keeps_its_subscription_past_the_socket_timeout(redis_conn, redis_url):
    # The web tier's client has a socket timeout (jobs.connection); a blocking pub/sub read that
    # honoured it would drop and renew the subscription every time the service sat idle that long,
    # losing live events meanwhile (redis-py before 8.1's listen() did).
    client = redis.Redis.from_url(redis_url, socket_timeout=0.3)
    others = pattern_subscribers(redis_conn)  # earlier tests' hubs
    hub = EventHub(client)
    with hub.listen("idle"):
        ours = wait_until(lambda: pattern_subscribers(redis_conn) - others, 5, what="the hub's subscription")
        time.sleep(1.0)  # idle for three socket timeouts
        assert pattern_subscribers(redis_conn) - others == ours
    hub.close()


def test_a_hub_started_ahead_is_subscribed_before_its_first_listener_and_close_ends_it(redis_conn):
    # The web tier starts its hub as each gunicorn worker boots: the first call meets a live subscription.
    others = pattern_subscribers(redis_conn)
    hub = EventHub(redis_conn)
    assert hub.start(wait_s=5) is True
    ours = wait_until(lambda: pattern_subscribers(redis_conn) - others, 5, what="the hub's subscription")
    assert len(ours) == 1
    hub.close()
    wait_until(lambda: not pattern_subscribers(redis_conn) & ours, 5, what="the subscription to end")
    wait_until(lambda: not hub._thread.is_alive(), 5, what="the hub's thread to end")
    with pytest.raises(RuntimeError):
        hub.start()


def pattern_subscribers(redis_conn) -> set[str]:
    """Redis's ids of the connections subscribed to a pattern."""
    return {c["id"] for c in redis_conn.client_list(_type="pubsub") if int(c.get("psub", 0))}
