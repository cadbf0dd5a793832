"""Reading a job's events: one pub/sub connection per process fans out to every local listener.

A reader registers its listener first, then replays the log from its last seen id, then forwards
live events, dropping duplicates; so late joiners and reconnecting clients miss nothing. The same
replay carries a reader through a short Redis outage: it keeps its last id, and once Redis answers
again the log gives it what was published meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import redis

from jobs import keys
from jobs.events import TERMINAL, decode, has_ended, read_log

log = logging.getLogger(__name__)

IDLE = {"id": 0, "type": "idle", "data": {}}
"""Yielded by `follow` when nothing arrived for `idle_s` (lets SSE writers send keep-alives)."""

OUTAGE_S = 30.0
"""How long `follow` waits for an unreachable Redis before it gives up (raises the connection error)."""

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)  # BusyLoadingError (a restart reading its AOF) is one


class EventHub:
    """A single pattern subscription on every job's events (`keys.EVENT_PATTERN`) dispatching events to
    per-job local queues."""

    def __init__(self, connection: redis.Redis):
        self.connection = connection
        self._listeners: dict[str, set[queue.Queue]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._prefix = keys.event_channel("")
        self._subscribed = threading.Event()
        self._closed = threading.Event()
        self._pubsub = None

    @contextmanager
    def listen(self, job_id: str):
        """Register a local queue receiving the job's live events for the duration of the block."""
        self._ensure_running()
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._listeners.setdefault(job_id, set()).add(q)
        try:
            yield q
        finally:
            with self._lock:
                listeners = self._listeners.get(job_id, set())
                listeners.discard(q)
                if not listeners:
                    self._listeners.pop(job_id, None)

    def start(self, wait_s: float = 0.0) -> bool:
        """Start the pump now rather than at the first listener, waiting up to `wait_s` for its subscription;
        whether it is subscribed. A web worker calls it as it boots, so that its first call meets a hub already
        subscribed and a warm connection (cold, that call took ~20 ms more, measured through gunicorn)."""
        self._ensure_running()
        return self._subscribed.wait(wait_s)

    def close(self) -> None:
        """Stop the pump (for processes that end their hub before exiting, such as tests). It does not wait:
        the pump thread ends, silently, when its read returns or fails."""
        self._closed.set()
        pubsub = self._pubsub
        if pubsub is not None:
            try:
                # Unsubscribing ends listen() in the pump thread once Redis confirms; the pump closes its pubsub
                # itself (closed from here, its connection went back to the pool while the pump still read it).
                pubsub.punsubscribe()
            except (redis.RedisError, OSError, AttributeError):  # AttributeError: its connection already gone
                pass

    def _ensure_running(self):
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the event hub is closed")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="mlxq-event-hub", daemon=True)
                self._thread.start()

    def _run(self):
        """Pump pub/sub messages until closed, reconnecting with backoff when Redis goes away."""
        backoff = 0.2
        while not self._closed.is_set():
            self._pubsub = pubsub = self.connection.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.psubscribe(keys.EVENT_PATTERN)
                self._subscribed.set()
                backoff = 0.2
                # listen() waits on the socket itself: under gevent, each event wakes this greenlet
                # once, where get_message(timeout=...) set up a timed select per call (~0.3 ms more
                # per event on the 2-core machine, on every synchronous call's answer).
                for message in pubsub.listen():
                    if message["type"] == "pmessage":
                        self._dispatch(message["channel"], message["data"])
                raise redis.ConnectionError("the pub/sub subscription ended")
            except Exception as exc:
                self._subscribed.clear()
                if self._closed.is_set():
                    return  # close() pulled the connection from under listen(): whatever that raised, done
                if not isinstance(exc, (redis.RedisError, OSError, ValueError)):  # OSError/ValueError: socket closed
                    raise
                # Missed events are recovered from the replay log by `follow`'s catch-up.
                log.warning("event hub lost Redis (%s); reconnecting in %.1fs", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                pubsub.close()

    def _dispatch(self, channel: bytes, data: bytes):
        job_id = channel.decode()[len(self._prefix):]
        with self._lock:
            listeners = list(self._listeners.get(job_id, ()))
        if listeners:
            event = decode(data)
            for q in listeners:
                q.put(event)


def follow(
    hub: EventHub,
    job_id: str,
    after_id: int = 0,
    idle_s: float = 1.0,
    on_idle: Callable[[], None] | None = None,
    outage_s: float = OUTAGE_S,
) -> Iterator[dict]:
    """Yield the job's events with id > after_id, in order, ending after the terminal event.

    Every `idle_s` without an event it re-reads the log (to recover anything pub/sub missed),
    calls `on_idle` (which may publish an error event, or raise), and yields IDLE. While Redis is
    unreachable it yields IDLE and retries; past `outage_s` of it the connection error is raised.
    """
    connection = hub.connection
    outage = _Outage(outage_s)
    with hub.listen(job_id) as live:
        last = after_id
        pending = outage.attempt(read_log, connection, job_id, last) or []
        while True:
            for event in pending:
                if event["id"] <= last:
                    continue
                last = event["id"]
                yield event
                if event["type"] in TERMINAL:
                    return
            pending = _next_batch(live, outage, connection, job_id, last, idle_s)
            if pending is not None and not outage.since:
                continue  # something came: new events, or only ones already yielded (not a quiet spell)
            if not pending:
                if on_idle is not None:
                    outage.attempt(on_idle)
                # Whether it has ended is read before the log: a terminal event appended between the two
                # reads would otherwise count as ended without ever being yielded.
                ended = outage.attempt(has_ended, connection, job_id)
                pending = outage.attempt(read_log, connection, job_id, last) or []
                if not pending:
                    if ended:
                        return  # the reader had already seen the terminal event: nothing more will come
                    yield IDLE


class _Outage:
    """Runs a reader's Redis calls; one that finds Redis unreachable returns None, until `bound_s` of that
    (counted from the first call that failed to the last, reset by any call that got through)."""

    def __init__(self, bound_s: float):
        self.bound_s = bound_s
        self.since: float | None = None

    def attempt(self, call: Callable, *args):
        """`call(*args)`, or None while Redis is unreachable (re-raised once it has been for bound_s)."""
        try:
            value = call(*args)
        except REDIS_DOWN:
            now = time.monotonic()
            self.since = self.since or now
            if now - self.since > self.bound_s:
                raise
            log.info("Redis unreachable for %.1fs while following a job; retrying", now - self.since)
            return None
        self.since = None
        return value


def _next_batch(live: queue.Queue, outage: _Outage, connection, job_id: str, last: int,
                idle_s: float) -> list[dict] | None:
    """Wait for live events; fall back to the log when an id was skipped (a gap). None: nothing came for idle_s
    (or the log could not be read for a gap); [] when only events already yielded came."""
    try:
        event = live.get(timeout=idle_s)
    except queue.Empty:
        return None
    batch = [event]
    while True:
        try:
            batch.append(live.get_nowait())
        except queue.Empty:
            break
    fresh = [e for e in batch if e["id"] > last]
    if fresh and fresh[0]["id"] != last + 1:
        return outage.attempt(read_log, connection, job_id, last)
    return fresh
