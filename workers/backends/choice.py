"""What one request holds while it decodes in a batch: its choices' text, stop strings and counts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from workers.backends import textgen
from workers.backends.reasoning import Thoughts
from workers.backends.toolcalls import ToolCalls


@dataclass
class Sequence:
    """One choice being generated."""

    task: object
    index: int
    prompt_tokens: int
    cached_tokens: int
    detokenizer: object
    stops: textgen.StopBuffer
    parts: list[str] = field(default_factory=list)
    pending: str = ""  # generated since its last delta went out
    tokens: int = 0
    finish_reason: str | None = None
    tokenizer: object = None  # to name the tokens of logprobs entries
    logprobs: list = field(default_factory=list)  # entries of every token, when the request asks for them
    pending_logprobs: list = field(default_factory=list)  # entries since its last delta went out
    tools: ToolCalls | None = None  # cuts tool calls out of the text, when the request has tools
    tool_calls: list = field(default_factory=list)  # every call it made
    pending_calls: list = field(default_factory=list)  # calls completed since its last delta went out
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    grammar: object = None  # its GrammarProcessor, whose `error` says if the grammar failed mid-answer
    thoughts: Thoughts | None = None  # cuts a reasoning model's thinking out of the answer
    reasoning: list[str] = field(default_factory=list)  # its thinking, piece by piece
    pending_reasoning: str = ""  # thought since its last delta went out
    cache_key: str | None = None  # where its cache is kept when it ends (None: the batch's own key)

    def advance(self, token: int, finish_reason: str | None, logprobs=None) -> bool:
        """Feed one generated token (and the log-probabilities it was sampled from); True when the
        sequence has finished.

        mlx-lm's finish reasons: "stop" for an end-of-sequence token, "length" for the budget.
        """
        self.tokens += 1  # an end-of-sequence token was generated too: it counts
        found = textgen.logprob_of(self.task.request.sampling, self.tokenizer, token, logprobs, finish_reason)
        if found is not None:
            self.logprobs.append(found)
            self.pending_logprobs.append(found)
        if finish_reason == "stop":  # end of sequence: not part of the text
            self.detokenizer.finalize()
        else:
            self.detokenizer.add_token(token)
            if finish_reason:
                self.detokenizer.finalize()
        text, matched = self.stops.feed(self.detokenizer.last_segment)
        if matched:
            finish_reason, self.stop_sequence = "stop", self.stops.matched
        elif finish_reason:
            text += self.stops.flush()
        if self.thoughts is not None:
            thought, text = self.thoughts.split(text, finish_reason is not None)
            self.reasoning.append(thought)
            self.pending_reasoning += thought
        if self.tools is not None:
            text, finish_reason = self._split_calls(text, finish_reason)
        self.parts.append(text)
        self.pending += text
        self.finish_reason = finish_reason
        return finish_reason is not None

    @property
    def pending_any(self) -> bool:
        """Whether it has output its client has not been sent yet."""
        return bool(self.pending or self.pending_reasoning or self.pending_calls)

    @property
    def reasoning_text(self) -> str | None:
        """Its whole thinking (None when it did not think)."""
        return "".join(self.reasoning) or None

    def _split_calls(self, text: str, finish_reason: str | None) -> tuple[str, str | None]:
        """Cut completed tool calls out of the text; a choice that ends after calls finishes "tool_calls"."""
        text, calls = self.tools.split(text, finish_reason is not None)
        self.tool_calls += calls
        self.pending_calls += calls
        return text, "tool_calls" if finish_reason == "stop" and self.tool_calls else finish_reason


@dataclass
class Member:
    """A request in the batch: its sequences and when its deltas last went out."""

    task: object
    sequences: list[Sequence]
    last_sent: float = -math.inf

    @property
    def done(self) -> bool:
        """Whether every one of its sequences has finished."""
        return all(s.finish_reason for s in self.sequences)
