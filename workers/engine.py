"""The engine: where all MLX work runs (model loads and generation), one request at a time.

It runs each request on the thread that asks for it: the worker's main thread, where RQ's
SimpleWorker runs every job, so MLX is only ever touched by that one thread. A text job reads its
request as batches of results and publishes each batch before asking for the next; while it does,
MLX is already computing the next token (mlx-lm evaluates one token ahead, asynchronously), so the
Redis round trip overlaps generation. An earlier version ran MLX on a thread of its own and handed
every request and result across; those two thread hand-offs cost 0.3 ms per call back to back and
0.6-0.9 ms on an idle machine, which is what a synchronous 1-token call is (docs/performance.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from jobs.settings import Settings
from jobs.store import ModelInfo
from workers import text
from workers.platform import PlatformInfo, detect
from workers.registry import ModelRegistry, Resident, memory_budget_bytes

T = TypeVar("T")


class Canceled(Exception):
    """The job was canceled by its client (or its reader went away) while it ran (HTTP 499)."""


class Stream:
    """One request's results, produced on the reader's thread as it iterates them."""

    def __init__(self, work: Callable[[], Iterable], owner: "Engine"):
        self._work = work
        self._owner = owner
        self._items: Iterator | None = None
        self._closed = False
        self._produced = 0

    @property
    def closed(self) -> bool:
        """Whether the reader stopped listening; the work is then abandoned."""
        return self._closed

    def close(self) -> None:
        """Stop listening: the work stops where it is (its generator is closed) and is never resumed."""
        self._closed = True
        if self._items is not None:
            self._items.close()

    def batches(self, interval: float = 0.0) -> Iterator[list]:
        """Yield lists of results until the work ends; raise its error, or Canceled once closed.

        The first list comes as soon as a result does; after that, results gather until `interval`
        seconds have passed since the last list, except that a result whose `final` is true ends
        the list at once. Results gathered before an error are yielded before it is raised.
        """
        self._owner.check_thread()
        if self._closed:
            raise Canceled("the job stopped listening before it started")
        self._items = iter(self._work())
        pending: list = []
        last_yield = -math.inf
        while True:
            if self._closed:
                raise Canceled(f"canceled after {self._produced} results")
            try:
                item = next(self._items)
            except StopIteration:
                break
            except BaseException:
                if pending:  # hand over what came before the error first
                    yield pending
                raise
            self._produced += 1
            pending.append(item)
            if getattr(item, "final", False) or time.monotonic() - last_yield >= interval:
                last_yield = time.monotonic()
                batch, pending = pending, []
                yield batch
        if pending:
            yield pending


class Engine:
    """Runs MLX work in order on its owner thread (the thread that created it)."""

    def __init__(self):
        self._owner = threading.get_ident()

    def check_thread(self) -> None:
        """Refuse MLX work from any thread but the owner: MLX state is not shared across threads here."""
        if threading.get_ident() != self._owner:
            raise RuntimeError("MLX work must run on the thread that created the engine (the worker's main thread)")

    def submit(self, work: Callable[[], Iterable]) -> Stream:
        """A Stream that runs `work()` as it is read; every item the work yields is a result."""
        return Stream(work, self)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` now and return its result (or raise its exception)."""
        self.check_thread()
        return fn()


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
        """Build the registry within the memory budget, with an engine owned by the calling thread."""
        platform = platform or detect()
        budget = memory_budget_bytes(settings.memory_budget_mb, platform.backend)
        registry = ModelRegistry(budget, platform, loaders or default_loaders())
        return cls(settings, platform, registry, Engine())

    def warm(self, info: ModelInfo) -> Resident:
        """Load a model (or touch it in the LRU)."""
        return self.engine.call(lambda: self.registry.get(info))

    def unload(self, info: ModelInfo) -> bool:
        """Drop a resident model; True if it was loaded."""
        return self.engine.call(lambda: self.registry.unload(info.path))

    def generate_text(self, info: ModelInfo, prompt: str | list[dict], sampling: text.Sampling) -> Stream:
        """Generation for a chat (list of messages) or a plain prompt, as a Stream of Pieces.

        Closing the stream cancels the generation where it is.
        """
        return self.engine.submit(lambda: self._text_work(info, prompt, sampling))

    def _text_work(self, info: ModelInfo, prompt: str | list[dict], sampling: text.Sampling) -> Iterator[text.Piece]:
        """The work behind generate_text: load, tokenize, generate."""
        resident = self.registry.get(info)
        tokenizer = resident.processor
        is_chat = isinstance(prompt, list)
        ids = text.chat_prompt(tokenizer, prompt) if is_chat else text.text_prompt(tokenizer, prompt)
        for piece in text.generate(resident.model, tokenizer, ids, sampling, info.context_length):
            if piece.text or piece.finish_reason:
                yield piece
