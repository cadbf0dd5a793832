"""The engine thread: the one thread that touches MLX (model loads and generation).

The shape of mlx-lm's server: a job hands the engine a request with its own result queue and reads
from it until a sentinel or an exception arrives. The job thread therefore does Redis I/O while the
engine keeps generating, and it can publish whatever accumulated meanwhile as one event.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from jobs.settings import Settings
from jobs.store import ModelInfo
from workers import text
from workers.platform import PlatformInfo, detect
from workers.registry import ModelRegistry, Resident, memory_budget_bytes

log = logging.getLogger(__name__)
T = TypeVar("T")

_END = object()  # the sentinel closing a request's result queue


class Canceled(Exception):
    """The job was canceled by its client (or its reader went away) while it ran (HTTP 499)."""


class Stream:
    """The results of one engine request, read by the job thread."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._closed = threading.Event()

    def put(self, item: Any) -> None:
        """Hand one result (or the sentinel, or an exception) to the reader (engine side)."""
        self._queue.put(item)

    @property
    def closed(self) -> bool:
        """Whether the reader stopped listening; the engine then abandons the work."""
        return self._closed.is_set()

    def close(self) -> None:
        """Stop listening: the engine drops the request at its next check."""
        self._closed.set()

    def batches(self, timeout: float | None = None, interval: float = 0.0,
                idle: float | None = None) -> Iterator[list]:
        """Yield lists of results until the end; re-raise the engine's error.

        The first list comes as soon as a result does; later ones at most one per `interval`
        seconds, gathering what arrived meanwhile, except that the end (a result whose `final` is
        true, the sentinel or an error) is yielded at once. After `idle` seconds without a result
        an empty list is yielded (the reader's chance to do periodic work); without `idle`,
        `timeout` seconds without a result raise queue.Empty.
        """
        last_yield = -math.inf
        while True:
            try:
                items = [self._queue.get(timeout=timeout if idle is None else idle)]
            except queue.Empty:
                if idle is None:
                    raise
                yield []
                continue
            while not _ends(items[-1]):
                remaining = last_yield + interval - time.monotonic()
                if remaining <= 0:
                    items.extend(self._drain())
                    break
                try:
                    items.append(self._queue.get(timeout=remaining))
                except queue.Empty:
                    break
            results = [item for item in items if item is not _END and not isinstance(item, BaseException)]
            if results:
                last_yield = time.monotonic()
                yield results
            errors = [item for item in items if isinstance(item, BaseException)]
            if errors:
                raise errors[0]
            if any(item is _END for item in items):
                return

    def _drain(self) -> list:
        """Everything queued right now, without waiting."""
        items = []
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                return items


def _ends(item: Any) -> bool:
    """Whether nothing the reader needs comes after this item."""
    return item is _END or isinstance(item, BaseException) or bool(getattr(item, "final", False))


class Engine:
    """A thread that runs submitted work one request at a time, in submission order."""

    def __init__(self, name: str = "mlx-engine"):
        self._requests: queue.Queue = queue.Queue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Engine":
        """Start the thread."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 30) -> bool:
        """Finish the queued requests, then park the thread; True once it is parked."""
        self._requests.put(None)
        return self._stopped.wait(timeout)

    def submit(self, work: Callable[[Stream], Iterable]) -> Stream:
        """Queue `work(stream)`; every item it yields is streamed back to the returned Stream."""
        stream = Stream()
        self._requests.put((work, stream))
        return stream

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn()` on the engine thread and return its result (or raise its exception)."""
        results = [item for batch in self.submit(lambda _stream: [fn()]).batches(timeout) for item in batch]
        return results[0]

    def _run(self) -> None:
        """Serve requests until stop() queues the None sentinel, then park forever."""
        while (request := self._requests.get()) is not None:
            self._serve(*request)
        self._stopped.set()
        # Never return: MLX's thread-local destructors take the GIL, and a thread running them while
        # the interpreter finalizes aborts the process (std::terminate). A parked daemon thread
        # simply vanishes with the process.
        threading.Event().wait()

    @staticmethod
    def _serve(work: Callable[[Stream], Iterable], stream: Stream) -> None:
        """Run one request; its error goes to its reader, which reports it (the engine carries on)."""
        try:
            if stream.closed:
                raise Canceled("the job stopped listening before it started")
            for item in work(stream):
                stream.put(item)
            stream.put(_END)
        except Exception as exc:
            if stream.closed and not isinstance(exc, Canceled):
                # The reader already has its answer (it stops at the last piece); say what went wrong.
                log.warning("engine request failed after its reader left: %s: %s", type(exc).__name__, exc)
            stream.put(exc)


def default_loaders() -> dict:
    """The backend loader for each model kind this worker serves."""
    from workers import speech  # mlx-audio: imported only by workers that build a runtime

    return {"text": text.load, "speech": speech.load}


@dataclass
class Runtime:
    """Everything the worker process loads once: settings, platform policy, model registry, engine."""

    settings: Settings
    platform: PlatformInfo
    registry: ModelRegistry
    engine: Engine

    @classmethod
    def create(cls, settings: Settings, platform: PlatformInfo | None = None,
               loaders: dict | None = None) -> "Runtime":
        """Build the registry within the memory budget and start the engine thread."""
        platform = platform or detect()
        budget = memory_budget_bytes(settings.memory_budget_mb, platform.backend)
        registry = ModelRegistry(budget, platform, loaders or default_loaders())
        return cls(settings, platform, registry, Engine().start())

    def warm(self, info: ModelInfo) -> Resident:
        """Load a model (or touch it in the LRU) on the engine thread."""
        return self.engine.call(lambda: self.registry.get(info))

    def unload(self, info: ModelInfo) -> bool:
        """Drop a resident model; True if it was loaded."""
        return self.engine.call(lambda: self.registry.unload(info.path))

    def generate_text(self, info: ModelInfo, prompt: str | list[dict], sampling: text.Sampling) -> Stream:
        """Start generating for a chat (list of messages) or a plain prompt; read Pieces from the Stream.

        Closing the stream cancels the generation: the engine checks it at every token.
        """
        return self.engine.submit(lambda stream: self._text_work(stream, info, prompt, sampling))

    def _text_work(self, stream: Stream, info: ModelInfo, prompt: str | list[dict],
                   sampling: text.Sampling) -> Iterator[text.Piece]:
        """Engine side of generate_text: load, tokenize, generate, stop when the reader closed the stream."""
        resident = self.registry.get(info)
        tokenizer = resident.processor
        is_chat = isinstance(prompt, list)
        ids = text.chat_prompt(tokenizer, prompt) if is_chat else text.text_prompt(tokenizer, prompt)
        for piece in text.generate(resident.model, tokenizer, ids, sampling, info.context_length):
            if stream.closed:
                raise Canceled(f"canceled after {piece.tokens} generated tokens")
            if piece.text or piece.finish_reason:
                yield piece
