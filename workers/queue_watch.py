"""What waits in a worker's queues, counted on a thread of its own while work runs.

The scheduler's thread is the one that launches the model's decode steps, so whatever else it does comes out of
every step: a look at the queues (workers/admission.py: a Redis round trip, then the jobs' descriptions) while a
batch runs took ~0.5 ms of a ~10 ms step at 64 streams on a GPU host (H200, 2026-11-28, bench_concurrency
--breakdown), and it came every step or two whether anything waited or not. This thread counts the queued jobs
(one pipeline of LLENs every WATCH_S) and writes the worker's load for its peers, so the scheduler's thread looks
only when something waits: a request arriving waits at most WATCH_S longer to be seen. The worker uses it on a GPU
only (workers/scheduler.py): on a CPU a step is ~100 ms and a look ~0.5 % of it.
"""

from __future__ import annotations

import threading
import time

import redis

from jobs.subscriber import REDIS_DOWN

WATCH_S = 0.005
"""How often the queues are counted while work runs."""

STALE_S = 0.1
"""A count older than this says nothing (the thread is late, or Redis is away): the scheduler looks as if
something waited."""

WANTED_S = 1.0
"""The thread counts while the scheduler asked for counts within this long (it stops polling Redis when the
worker idles, or is left without being stopped, as in a test)."""


def load_entry(load: int) -> str:
    """A worker's entry in its peers' loads: how many text requests it holds, and when it said so."""
    return f"{load}:{time.time():.3f}"


class QueueWatch:
    """Counts the jobs waiting in some queues, every WATCH_S while wanted (`want`), and writes a worker's load."""

    def __init__(self, conn: redis.Redis, queue_keys: list[str], loads_key: str | None = None,
                 name: str | None = None, every_s: float = WATCH_S):
        self.conn, self.queue_keys, self.every_s = conn, list(queue_keys), every_s
        self.loads_key, self.name = loads_key, name  # where the worker's load goes (no name: nowhere)
        self.load = 0  # the text requests the worker holds, set by the scheduler's thread
        self._waiting: int | None = None  # as last counted (None: not known)
        self._counted_at = 0.0
        self._wanted_until = 0.0
        self._wake = threading.Event()
        self.counted = threading.Event()  # set at each count (for whoever awaits a fresh one)
        self._stopped = False
        self._thread: threading.Thread | None = None

    def want(self) -> None:
        """Keep counting for WANTED_S more (the scheduler calls this at each step while work runs)."""
        self._wanted_until = time.monotonic() + WANTED_S
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxq-queue-watch", daemon=True)
            self._thread.start()
        if not self._wake.is_set():
            self._wake.set()

    def nothing_waits(self) -> bool:
        """Whether a recent count found every queue empty."""
        return self._waiting == 0 and time.monotonic() - self._counted_at < STALE_S

    def count(self) -> int:
        """Count the waiting jobs now (and write the load), in one round trip."""
        with self.conn.pipeline(transaction=False) as pipe:
            if self.name is not None and self.loads_key is not None:
                pipe.hset(self.loads_key, self.name, load_entry(self.load))
                pipe.expire(self.loads_key, 3600)
            for key in self.queue_keys:
                pipe.llen(key)
            found = pipe.execute()
        waiting = sum(found[-len(self.queue_keys):]) if self.queue_keys else 0
        self._waiting, self._counted_at = waiting, time.monotonic()
        self.counted.set()
        return waiting

    def stop(self) -> None:
        """Stop the thread (at the worker's end)."""
        self._stopped = True
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            if time.monotonic() > self._wanted_until:  # nobody asked lately: wait to be wanted again
                self._waiting = None
                self._wake.clear()
                self._wake.wait()
                continue
            try:
                self.count()
            except REDIS_DOWN:
                self._waiting = None  # the scheduler looks, and meets the outage itself
            time.sleep(self.every_s)
