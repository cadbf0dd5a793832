"""The text backend (mlx-lm): chats and completions, streamed as deltas, one choice per input.

Deltas go out at most one per settings.stream_interval_ms, each carrying every token generated
meanwhile (the first token and the last never wait): fewer Redis round trips between tokens. Each
publish reports a requested cancel (and publishes nothing of a canceled job but its end), so a
cancel stops generation at the next delta; a job canceled while it waited stops at its first.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx

from jobs.contract import Choice, TextRequest, TextResult
from jobs.events import DELTA, REASONING
from workers.backends import fused, quantized_kv, reasoning, textgen, toolcalls
from workers.backends.base import Outcome
from workers.backends.reasoning import Thoughts
from workers.backends.toolcalls import ToolCalls

log = logging.getLogger(__name__)


class TextBackend:
    """mlx-lm text generation behind the backend interface (workers/backends/base.py)."""

    model_kind = "text"
    resumable = False

    def load(self, path: Path, float32: bool):
        """Load an mlx-lm model and its tokenizer; on an NVIDIA GPU, with its layers' projections joined (fused.py)."""
        model, tokenizer = textgen.load(path, float32)
        if mx.default_device() == mx.gpu and mx.cuda.is_available():
            joined = fused.fuse_projections(model)
            log.info("%s: %d groups of projections joined", path.name, joined)
        return model, tokenizer

    def run(self, request: TextRequest, job, models) -> Iterator[Outcome | None]:
        """Generate one choice per input, publishing deltas; end with the usage-counted answer."""
        resident = models.get(request.model, adapter=request.adapter)
        tokenizer = resident.processor
        vocab = textgen.output_size(resident.model, tokenizer)
        kv = quantized_kv.for_model(resident.model, request.model.path, job.settings)
        thinking: dict[int, reasoning.Plan | None] = {}  # per choice: its reasoning plan

        def generate(prompt, index: int) -> Iterator[textgen.Piece]:
            ids = textgen.prompt_ids(tokenizer, prompt, request.tools, request.model.context_length,
                                     reasoning.template_kwargs(request, tokenizer))
            plan = thinking[index] = reasoning.plan(request, tokenizer, ids)
            return textgen.generate(resident.model, tokenizer, ids, request.sampling, request.model.context_length,
                                    gate=lambda grammar: reasoning.gate(plan, tokenizer, vocab, grammar,
                                                                        request.sampling.max_tokens), kv=kv)

        return run_choices(request, job, generate, lambda: toolcalls.for_request(request, tokenizer),
                           lambda index: reasoning.thoughts(thinking.get(index)))


def run_choices(request, job, generate: Callable[[object, int], Iterator[textgen.Piece]],
                splitter: Callable[[], ToolCalls | None] = lambda: None,
                thoughts: Callable[[int], Thoughts | None] = lambda index: None) -> Iterator[Outcome | None]:
    """Generate each choice of a request in turn (`generate(input, index)` gives choice `index`'s Pieces),
    publishing deltas (a reasoning model's thinking cut out by `thoughts(index)`, tool calls by a fresh
    `splitter()` per choice); end with the usage-counted answer. A backend's `run` for text-like requests."""
    interval = job.settings.stream_interval_ms / 1000
    choices, prompt_tokens, completion_tokens, held = [], 0, 0, []
    inputs = [prompt for prompt in request.inputs for _ in range(request.n)]  # choice i*n + k
    for index, prompt in enumerate(inputs):
        if held:  # the previous choice's last delta goes out now; its reply reports a cancel
            job.publish(held)
        elif index:
            job.check_cancel()
        pieces = generate(prompt, index)
        out = Output(splitter(), thoughts(index))
        try:
            final = yield from _stream(pieces, job, index, interval, out)
        except BaseException:
            pieces.close()  # leaving early (a cancel, a timeout, shutdown): generation stops here
            raise
        wanted = request.sampling.logprobs is not None
        finish = "tool_calls" if out.calls and final.finish_reason == "stop" else final.finish_reason
        choices.append(Choice(index, "".join(out.parts), finish, out.entries if wanted else None, out.calls or None,
                              final.stop_sequence, "".join(out.reasoning) or None,
                              out.thoughts.tokens if out.thoughts else 0))
        prompt_tokens += final.prompt_tokens
        completion_tokens += final.tokens
        held = out.events(index)
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


def choice_events(index: int, thought: str, text: str, logprobs: list, tool_calls: list) -> list[tuple[str, dict]]:
    """The events of a choice's output since its last ones: its thinking (a reasoning event) before its answer
    (a delta, when there is any)."""
    events = [(REASONING, {"index": index, "text": thought})] if thought else []
    if text or logprobs or tool_calls:
        events.append(delta(index, text, logprobs, tool_calls))
    return events


class Output:
    """What one choice has generated on the one-at-a-time path: its answer, thinking, calls and logprobs
    entries, and what of them has not been published yet."""

    def __init__(self, tools: ToolCalls | None, thoughts: Thoughts | None):
        self.tools, self.thoughts = tools, thoughts
        self.parts, self.reasoning, self.entries, self.calls = [], [], [], []
        self.pending, self.pending_reasoning, self.pending_entries, self.pending_calls = "", "", [], []

    def add(self, piece: textgen.Piece) -> None:
        """Take one piece's text apart (thinking, answer, calls) and keep it."""
        text = piece.text
        if self.thoughts is not None:
            thought, text = self.thoughts.split(text, piece.final)
            self.reasoning.append(thought)
            self.pending_reasoning += thought
        if self.tools is not None:
            text, new = self.tools.split(text, piece.final)
            self.calls += new
            self.pending_calls += new
        self.parts.append(text)
        self.pending += text
        if piece.logprob is not None:
            self.entries.append(piece.logprob)
            self.pending_entries.append(piece.logprob)

    def events(self, index: int) -> list[tuple[str, dict]]:
        """The events of what has not been published yet (and now counts as published)."""
        events = choice_events(index, self.pending_reasoning, self.pending, self.pending_entries, self.pending_calls)
        self.pending, self.pending_reasoning, self.pending_entries, self.pending_calls = "", "", [], []
        return events


def _stream(pieces: Iterator[textgen.Piece], job, index: int, interval: float, out: Output):
    """Publish a choice's events as it generates, yielding after each publish; return its final Piece (its
    last events stay unpublished in `out`: they go out with the next event in one round trip)."""
    last_sent = -math.inf
    for piece in pieces:
        out.add(piece)
        if piece.final:
            return piece
        if (out.pending or out.pending_reasoning or out.pending_calls) and time.monotonic() - last_sent >= interval:
            job.publish(out.events(index))
            last_sent = time.monotonic()
            yield
    raise RuntimeError("the generation ended without a finish reason")
