"""The interface every backend implements, and what a run of a request yields.

A backend serves one kind of request on one kind of model:

- `model_kind`, `load(path, float32)`: how the model manager loads its models;
- `run(request, job, models)`: a generator that runs one request in pieces. Each bare `yield` is a
  boundary where the scheduler may run other work first (interactive before batch), check the
  job's deadline, or stop it (by closing the generator, or throwing an error into it). Its last item
  is an `Outcome`; the scheduler ends the job with it, and only then closes the generator, so a
  backend may keep resources until the answer is out (mlx-lm's generator on an Apple GPU waits for
  the token it computes ahead when closed). Errors raised end the job with their jobs.errors meaning.

Text on a model that can batch does not run this way: its requests decode together in the model's
`textbatch.TextBatch`, one step for all; `TextBackend.run` serves the models that cannot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class Outcome:
    """How a run ended well: the `done` event's data, what an async job's record keeps (default:
    the same), events to publish just before `done`, in the same round trip, and what RQ keeps as the job's
    return value, which rq-dashboard shows (default: `done`)."""

    done: dict
    result: dict | None = None
    before: list = field(default_factory=list)
    kept: dict | None = None


class Backend(Protocol):
    """What the scheduler and the model manager need from a backend."""

    model_kind: str
    """The catalog kind of the models it runs ("text", "speech")."""

    resumable: bool
    """Whether a run interrupted between pieces can go on in another process from its checkpoint (which
    it hands to its job, `JobRun.checkpoint`, after each piece, and gets back from `JobRun.restore`)."""

    def load(self, path: Path, float32: bool) -> tuple[Any, Any]:
        """Load a model directory: (model, tokenizer or processor)."""

    def run(self, request, job, models) -> Iterator[Outcome | None]:
        """Run `request` in pieces (see the module docstring); `job` is its jobs.lifecycle.JobRun."""
