"""Publishing a text batch's deltas beside its decode loop, on a thread of their own.

On a GPU the worker's one core is what limits many streams (bench/NOTES.md): at 64 streams on the H100 the main
thread spent 13.7 % of its time packing each step's deltas into a Redis pipeline, sending it and waiting for the
reply, between steps (2026-11-27). MLX lets go of Python's lock while it queues a step's pass (`mx.async_eval`,
about a third of the thread's time), so this thread's Python work, and its wait for Redis, overlap with it.

What stays as it was: one thread sends the steps in order, so a job's events keep their order; `flush` waits for
everything handed over, and a job's end is published only after it (the scheduler flushes before ending the jobs
of a step); at most two steps wait to be sent, so while Redis is slow or away the decode loop waits as it did. What
changes: a client's cancel is seen a step later (the reply that carries it comes back after the next step is
queued), and an error (Redis away past the connection's own retries) is raised at the caller's next call, where
the publish itself used to raise it; the deltas of the step that failed are lost either way.
"""

from __future__ import annotations

import queue
import threading

PENDING_STEPS = 2
"""Steps handed over and not yet sent, at most: beyond that the decode loop waits for Redis, as it always did."""


class BackgroundPublisher:
    """Sends each step's deltas (EventPublisher.publish_pipelined) from a thread; returns cancels a step later."""

    def __init__(self, publisher):
        self.publisher = publisher
        self._steps: queue.Queue = queue.Queue(maxsize=PENDING_STEPS)
        self._lock = threading.Lock()
        self._canceled: set[str] = set()  # jobs whose clients asked to cancel, from replies not yet collected
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlxq-publish", daemon=True)
        self._thread.start()

    def submit(self, batches: list[tuple[str, list]]) -> set[str]:
        """Hand over one step's deltas ((job id, events) per job); the jobs canceled according to earlier replies."""
        self._raise()
        self._steps.put(batches)
        return self._collect()

    def flush(self) -> set[str]:
        """Wait until everything handed over is sent; the jobs canceled according to the replies."""
        self._steps.join()
        self._raise()
        return self._collect()

    def collect(self) -> set[str]:
        """The jobs canceled according to the replies received since the last look (never waits)."""
        return self._collect()

    def close(self) -> None:
        """Send what is left, then stop the thread."""
        self._steps.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            batches = self._steps.get()
            try:
                if batches is None:
                    return
                if self._error is None:  # after a failure, drop what follows until the caller has seen it
                    flags = self.publisher.publish_pipelined(batches)
                    canceled = {job_id for (job_id, _), flag in zip(batches, flags, strict=True) if flag}
                    if canceled:
                        with self._lock:
                            self._canceled |= canceled
            except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
                self._error = exc
            finally:
                self._steps.task_done()

    def _raise(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _collect(self) -> set[str]:
        with self._lock:
            canceled, self._canceled = self._canceled, set()
        return canceled
