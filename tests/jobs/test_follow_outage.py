"""follow() through a Redis outage, against a real redis-server restarted from its append-only file:
a short one is ridden out (every event, in order, the terminal one included); a long one ends the
follow with the connection error after its bound, never a silent end."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import redis

from jobs.events import DELTA, DONE, EventPublisher
from jobs.subscriber import EventHub, follow
from tests.conftest import RedisServer, wait_until


@pytest.fixture()
def server():
    """A durable Redis of its own (a restart keeps the replay log)."""
    server = RedisServer(durable=True).start()
    yield server
    server.stop()


def _follow_in_thread(conn: redis.Redis, job_id: str, outage_s: float, idles: list | None = None) -> queue.Queue:
    """Follow on a thread; each event, then None (the end) or the exception that ended it, lands in the queue
    (the idle ones in `idles`, if given)."""
    out: queue.Queue = queue.Queue()

    def run():
        hub = EventHub(conn)
        try:
            for event in follow(hub, job_id, idle_s=0.1, outage_s=outage_s):
                if event["type"] != "idle":
                    out.put(event)
                elif idles is not None:
                    idles.append(time.monotonic())
            out.put(None)
        except Exception as exc:  # what ended it is the test's to judge
            out.put(exc)
        finally:
            hub.close()

    threading.Thread(target=run, daemon=True).start()
    return out


def test_a_follower_rides_out_a_restart_and_misses_nothing(server):
    conn = redis.Redis.from_url(server.url, socket_connect_timeout=1)
    publisher = EventPublisher(conn, ttl_s=60, log_max=100)
    publisher.publish("job", DELTA, {"text": "a"})
    idles: list[float] = []
    out = _follow_in_thread(conn, "job", outage_s=30, idles=idles)
    assert out.get(timeout=5)["data"] == {"text": "a"}
    server.halt()
    halted = time.monotonic()
    # The outage itself: the follower must keep going through it (two idle rounds with Redis away).
    wait_until(lambda: sum(t > halted for t in idles) >= 2, 10, interval=0.02, what="the follower to idle through the outage")
    server.start()
    publisher.publish_many("job", [(DELTA, {"text": "b"}), (DONE, {"text": "ab"})])
    assert [(e["id"], e["type"]) for e in (out.get(timeout=10), out.get(timeout=5))] == [(2, DELTA), (3, DONE)]
    assert out.get(timeout=5) is None


def test_a_follower_gives_up_with_the_error_once_redis_stays_away_past_the_bound(server):
    conn = redis.Redis.from_url(server.url, socket_connect_timeout=1)
    EventPublisher(conn, ttl_s=60, log_max=100).publish("job", DELTA, {"text": "a"})
    out = _follow_in_thread(conn, "job", outage_s=1.0)
    assert out.get(timeout=5)["type"] == DELTA
    server.halt()
    halted = time.monotonic()
    ended = wait_until(lambda: None if out.empty() else out.get(), 10, what="the follow to end")
    assert isinstance(ended, redis.ConnectionError), ended
    assert 1.0 <= time.monotonic() - halted < 5
