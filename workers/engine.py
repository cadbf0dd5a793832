"""The engine thread: the one thread that touches MLX (model loads and generation).

The shape of mlx-lm's server: a job hands the engine a request with its own result queue and reads
from it until a sentinel or an exception arrives. The job thread therefore does Redis I/O while the
engine keeps generating, and it can publish whatever accumulated meanwhile as one event.
"""

from __future__ import annotations

import logging
import queue
import threading
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

    def batches(self, timeout: float | None = None) -> Iterator[list]:
        """Yield lists of every result available at once, until the end; re-raise the engine's error."""
        while True:
            items = [self._queue.get(timeout=timeout)]
            items.extend(self._drain())
            results = [item for item in items if item is not _END and not isinstance(item, BaseException)]
            if results:
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

    def __iter__(self) -> Iterator:
        for batch in self.batches():
            yield from batch


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

    def generate_text(self, info: ModelInfo, prompt: str | list[dict], sampling: text.Sampling,
                      should_cancel: Callable[[], bool] = lambda: False) -> Stream:
        """Start generating for a chat (list of messages) or a plain prompt; read Pieces from the Stream."""
        return self.engine.submit(lambda stream: self._text_work(stream, info, prompt, sampling, should_cancel))

    def _text_work(self, stream: Stream, info: ModelInfo, prompt: str | list[dict], sampling: text.Sampling,
                   should_cancel: Callable[[], bool]) -> Iterator[text.Piece]:
        """Engine side of generate_text: load, tokenize, generate, check for cancellation."""
        resident = self.registry.get(info)
        tokenizer = resident.processor
        is_chat = isinstance(prompt, list)
        ids = text.chat_prompt(tokenizer, prompt) if is_chat else text.text_prompt(tokenizer, prompt)
        check = _cancel_check(stream, should_cancel, max(1, self.settings.cancel_check_every))
        check(0)
        for piece in text.generate(resident.model, tokenizer, ids, sampling, info.context_length):
            check(piece.tokens)
            if piece.text or piece.finish_reason:
                yield piece


def _cancel_check(stream: Stream, should_cancel: Callable[[], bool], every: int) -> Callable[[int], None]:
    """A per-token check that raises Canceled every `every` tokens once the job is canceled."""
    def check(tokens: int) -> None:
        if tokens % every == 0 and (stream.closed or should_cancel()):
            raise Canceled(f"canceled after {tokens} generated tokens")
    return check
