"""Run an iterator in a thread, ahead of the code that consumes it."""

from __future__ import annotations

import queue
import threading
from typing import Iterable


class Ahead:
    """An iterator run by a thread up to `size` items ahead of its consumer (the voice activity detector
    reads and judges the file on a CPU core while the worker decodes the pieces it already found)."""

    _END = object()

    def __init__(self, items: Iterable, size: int = 64):
        self._queue: queue.Queue = queue.Queue(size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(items,), name="vad-ahead", daemon=True)
        self._thread.start()

    def _run(self, items: Iterable) -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                if not self._put(item):
                    return
            self._put(self._END)
        except BaseException as exc:  # handed to the consumer, raised where it asks for the next item
            self._put(exc)
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()  # here, in the thread that ran it (a generator cannot be closed from another)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> "Ahead":
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is self._END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def close(self) -> None:
        """Stop the thread (it ends at its next item) and wait for it."""
        self._stop.set()
        self._thread.join(timeout=10)
