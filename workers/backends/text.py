"""The text backend (mlx-lm): chats and completions, streamed as deltas, one choice per input.

Deltas go out at most one per settings.stream_interval_ms, each carrying every token generated
meanwhile (the first token and the last never wait): fewer Redis round trips between tokens. Each
publish reports a requested cancel (and publishes nothing of a canceled job but its end), so a
cancel stops generation at the next delta; a job canceled while it waited stops at its first.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jobs.contract import Choice, TextRequest, TextResult
from jobs.events import DELTA
from workers.backends import textgen, toolcalls
from workers.backends.base import Outcome
from workers.backends.toolcalls import ToolCalls


class TextBackend:
    """mlx-lm text generation behind the backend interface (workers/backends/base.py)."""

    model_kind = "text"
    resumable = False

    def load(self, path: Path, float32: bool):
        """Load an mlx-lm model and its tokenizer."""
        return textgen.load(path, float32)

    def run(self, request: TextRequest, job, models) -> Iterator[Outcome | None]:
        """Generate one choice per input, publishing deltas; end with the usage-counted answer."""
        resident = models.get(request.model)

        def generate(prompt) -> Iterator[textgen.Piece]:
            ids = textgen.prompt_ids(resident.processor, prompt, request.tools)
            return textgen.generate(resident.model, resident.processor, ids, request.sampling,
                                    request.model.context_length)

        return run_choices(request, job, generate, lambda: toolcalls.for_request(request, resident.processor))


def run_choices(request, job, generate: Callable[[object], Iterator[textgen.Piece]],
                splitter: Callable[[], ToolCalls | None] = lambda: None) -> Iterator[Outcome | None]:
    """Generate each choice of a request in turn (`generate(input)` gives its Pieces), publishing deltas
    (tool calls cut out by a fresh `splitter()` per choice); end with the usage-counted answer. A
    backend's `run` for text-like requests."""
    interval = job.settings.stream_interval_ms / 1000
    choices, prompt_tokens, completion_tokens, held = [], 0, 0, []
    inputs = [prompt for prompt in request.inputs for _ in range(request.n)]  # choice i*n + k
    for index, prompt in enumerate(inputs):
        if held:  # the previous choice's last delta goes out now; its reply reports a cancel
            job.publish(held)
        elif index:
            job.check_cancel()
        pieces = generate(prompt)
        try:
            text, final, last_delta, logprobs, calls = yield from _stream(pieces, job, index, interval, splitter())
        except BaseException:
            pieces.close()  # leaving early (a cancel, a timeout, shutdown): generation stops here
            raise
        wanted = request.sampling.logprobs is not None
        finish = "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason
        choices.append(Choice(index, text, finish, logprobs if wanted else None, calls or None,
                              final.stop_sequence))
        prompt_tokens += final.prompt_tokens
        completion_tokens += final.tokens
        held = [delta(index, *last_delta)] if any(last_delta) else []
        if index < len(inputs) - 1:
            pieces.close()
    result = TextResult(request.model.id, choices, prompt_tokens, completion_tokens, int(time.time()))
    try:
        yield Outcome(result.as_dict(), before=held)  # the answer goes out, then generation is closed
    finally:
        pieces.close()


def delta(index: int, text: str, logprobs: list, tool_calls: list | None = None) -> tuple[str, dict]:
    """A delta event: new text of choice `index`, with its tokens' logprobs entries when asked for and
    the tool calls it completed."""
    return DELTA, {"index": index, "text": text, **({"logprobs": logprobs} if logprobs else {}),
                   **({"tool_calls": tool_calls} if tool_calls else {})}


def _stream(pieces: Iterator[textgen.Piece], job, index: int, interval: float, tools: ToolCalls | None):
    """Publish a choice's deltas as it generates, yielding after each; return (its text, its final
    Piece, its last delta unpublished (text, logprobs, calls): it goes out with the next event in one
    round trip, all its logprobs entries, all its tool calls)."""
    parts, pending, last_sent, entries, pending_entries = [], "", -math.inf, [], []
    calls, pending_calls = [], []
    for piece in pieces:
        text = piece.text
        if tools is not None:
            text, new = tools.split(text, piece.final)
            calls += new
            pending_calls += new
        parts.append(text)
        pending += text
        if piece.logprob is not None:
            entries.append(piece.logprob)
            pending_entries.append(piece.logprob)
        if piece.final:
            return "".join(parts), piece, (pending, pending_entries, pending_calls), entries, calls
        if (pending or pending_calls) and time.monotonic() - last_sent >= interval:
            job.publish([delta(index, pending, pending_entries, pending_calls)])
            pending, pending_entries, pending_calls, last_sent = "", [], [], time.monotonic()
            yield
    raise RuntimeError("the generation ended without a finish reason")
