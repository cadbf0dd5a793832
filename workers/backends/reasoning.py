"""Reasoning models: their thinking cut out of the answer, and a thinking budget kept while decoding.

A reasoning model writes its thinking between markers before it answers (`<think>` ... `</think>` for
Qwen3, DeepSeek-R1 and most others; jobs.model_files.THINK_MARKERS lists the families mlx-lm knows).
Its chat template either opens the block in the prompt (the answer starts inside it), closes an empty
one there (thinking switched off: `enable_thinking: false`), or leaves the model to open it.

`Thoughts` splits one choice's released text into reasoning and answer, as it streams: the markers
and the whitespace around them go to neither, and text that may begin a marker is held back until it
is clearly not one. `ThinkingGate` keeps a budget at the token level: it counts the tokens of the
block, and once the budget would be spent it writes the end marker itself (one allowed token per
step, through the batch's masks: workers/backends/sampling.py), so the model goes on to answer. A
request whose answer must follow a grammar (json_schema, a forced tool call) gets the grammar only
after the block: the gate holds it until then.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jobs.model_files import think_markers_of
from workers.backends.textgen import held_tail

MAYBE, THINKING, AFTER, ANSWER = "maybe", "thinking", "after", "answer"
"""Where a choice's text is: before it shows whether it thinks, inside the block, in the whitespace after
the block, in the answer."""


PROMPT_TAIL_TOKENS = 32
"""Tokens at the end of a rendered prompt read back as text to see whether the template opened or closed a block."""


@dataclass(frozen=True)
class Plan:
    """How one prompt of a reasoning model's request thinks: its markers, where generation starts, its budget."""

    start: str
    end: str
    state: str  # MAYBE, THINKING or ANSWER (opening_state)
    budget: int | None  # the most reasoning tokens (markers included), None: as many as max_tokens allows


def markers(tokenizer) -> tuple[str, str] | None:
    """The think markers of a model, from its chat template (None: it does not reason)."""
    return think_markers_of(getattr(tokenizer, "chat_template", None))


def knows_switch(tokenizer) -> bool:
    """Whether the model's chat template reads `enable_thinking` (can be told not to think)."""
    return "enable_thinking" in (getattr(tokenizer, "chat_template", None) or "")


def template_kwargs(request, tokenizer) -> dict:
    """The template variables of a chat: the request's own (chat_template_kwargs), and `enable_thinking` for a
    reasoning model (on unless the request turns it off: mlx-lm would pass it off for a model whose markers
    are not single tokens)."""
    kwargs = dict(getattr(request, "template_kwargs", None) or {})
    enabled = getattr(request, "enable_thinking", None)
    if markers(tokenizer) is not None:
        kwargs["enable_thinking"] = kwargs.get("enable_thinking", True) if enabled is None else enabled
    elif enabled is not None:
        kwargs["enable_thinking"] = enabled
    return kwargs


def plan(request, tokenizer, ids: list[int]) -> Plan | None:
    """How a chat's prompt (rendered as `ids`) thinks; None for a model that does not reason or a completion.

    A request that turns thinking off, on a template that cannot be told so, gets a budget of 0: the block the
    model opens is closed at once."""
    found = markers(tokenizer)
    if found is None or getattr(request, "messages", None) is None:
        return None
    start, end = found
    state = opening_state(tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]), start, end)
    budget = getattr(request, "thinking_budget", None)
    if template_kwargs(request, tokenizer).get("enable_thinking") is False and state != ANSWER:
        budget = 0
    return Plan(start, end, state, budget)


def thoughts(plan: Plan | None) -> Thoughts | None:
    """The splitter of one choice that follows `plan` (None: nothing to split)."""
    return None if plan is None else Thoughts(plan.start, plan.end, plan.state)


def gate(plan: Plan | None, tokenizer, vocab_size: int, grammar=None, room: int | None = None):
    """What a choice's row decodes under: its grammar, behind a ThinkingGate when it reasons with a budget or
    must think before its grammar applies. `room`: the tokens the choice may generate; a grammar's answer gets
    half of them at least (a block left open would leave none: the model may never close it itself)."""
    if plan is None or plan.state == ANSWER or (plan.budget is None and grammar is None):
        return grammar
    budget = plan.budget
    if grammar is not None and room is not None:
        budget = min(budget if budget is not None else room, room // 2)
    return ThinkingGate(tokenizer, vocab_size, plan.start, plan.end, plan.state, budget, grammar)


def opening_state(prompt_text: str, start: str, end: str) -> str:
    """Where generation starts: THINKING when the prompt's last turn opens a block it does not close (the
    template opened it), ANSWER when it closed one (thinking switched off), else MAYBE."""
    opened, closed = prompt_text.rfind(start), prompt_text.rfind(end)
    if opened < 0 and closed < 0:
        return MAYBE
    tail = prompt_text[max(opened, closed):]
    if opened > closed and not tail[len(start):].strip():
        return THINKING
    if closed > opened and not tail[len(end):].strip():
        return ANSWER
    return MAYBE  # markers earlier in the conversation: the model opens its own block, or not


class Thoughts:
    """One choice's splitter: feed it released text, get back (reasoning, answer) to release."""

    def __init__(self, start: str, end: str, state: str = MAYBE):
        self.start, self.end, self.state = start, end, state
        self.buffer = ""
        self.fed = 0  # tokens fed so far (one `feed` per token)
        self.tokens = 0  # tokens the reasoning took, markers included: known once the block ends
        self.began = False  # whether reasoning text went out (the blanks before it never do)

    @property
    def thinking(self) -> bool:
        """Whether the choice is (or may yet be) inside its reasoning."""
        return self.state in (MAYBE, THINKING)

    def feed(self, text: str) -> tuple[str, str]:
        """Add one token's released text; return (reasoning, answer) safe to release."""
        self.fed += 1
        self.buffer += text
        reasoning = answer = ""
        if self.state == MAYBE:
            stripped = self.buffer.lstrip()
            if stripped.startswith(self.start):
                self.state, self.buffer = THINKING, stripped[len(self.start):]
            elif self.start.startswith(stripped):
                return "", ""  # may still be the start marker
            else:
                self.state = ANSWER
        if self.state == THINKING:
            found = self.buffer.find(self.end)
            if found < 0:
                return self._reasoning(len(self.buffer) - held_tail(self.buffer, [self.end])), ""
            reasoning = self._reasoning(found, last=True)
            self.buffer = self.buffer[len(self.end):]
            self.state, self.tokens = AFTER, self.fed
        if self.state == AFTER:
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return reasoning, ""
            self.state = ANSWER
        # A marker in the answer is dropped (never content): a model whose block was closed for it (a budget) may
        # go on reasoning and close the block again itself.
        self.buffer = self.buffer.replace(self.start, "").replace(self.end, "")
        keep = held_tail(self.buffer, [self.start, self.end])
        answer, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        return reasoning, answer

    def _reasoning(self, upto: int, last: bool = False) -> str:
        """Release buffer[:upto] as reasoning: blanks before its first character are dropped, blanks at its end
        held (they go out if more reasoning follows, never before the end marker: `last`)."""
        text, self.buffer = self.buffer[:upto], self.buffer[upto:]
        if not self.began:
            text = text.lstrip()
            self.began = bool(text)
        kept = text.rstrip()
        if not last:
            self.buffer = text[len(kept):] + self.buffer
        return kept

    def finish(self) -> tuple[str, str]:
        """Generation ended: what is held goes out (a block never closed is all reasoning)."""
        rest, self.buffer = self.buffer, ""
        if self.state == THINKING:
            self.tokens = self.fed
            return (rest if self.began else rest.lstrip()).rstrip(), ""
        if self.state == MAYBE:
            return "", rest
        return "", (rest.lstrip() if self.state == AFTER else rest).replace(self.start, "").replace(self.end, "")

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """`feed`, then `finish` when this is the generation's last text."""
        reasoning, answer = self.feed(text)
        if final:
            more, rest = self.finish()
            reasoning, answer = reasoning + more, answer + rest
        return reasoning, answer


class ThinkingGate:
    """One sequence's thinking at the token level: with a budget, the end marker written for the model once
    the budget would be spent; with a grammar (`inner`), the grammar held back until the block ends.

    Its `mask_words(last)` is a GrammarProcessor's (workers/backends/grammar.py): None when any token may
    follow, else the packed mask of the allowed ones."""

    def __init__(self, tokenizer, vocab_size: int, start: str, end: str, state: str, budget: int | None,
                 inner=None):
        self.tokenizer, self.vocab = tokenizer, vocab_size
        self.start_text, self.end_text = start, end
        self.end_ids = list(tokenizer.encode(end, add_special_tokens=False))
        self.start_ids = list(tokenizer.encode(start, add_special_tokens=False))
        self.budget, self.inner = budget, inner
        self.state = state
        self.forcing: list[int] = []  # tokens still to write for the model, in order
        if state == MAYBE and inner is not None:
            # A grammar must see the answer from its first token: the block is opened for the model (a reasoning
            # model asked to think does so), so where the answer begins is known.
            self.state, self.forcing = THINKING, list(self.start_ids)
        self.text = ""  # the text of the block so far (to find the end marker in)
        self.count = 0  # tokens generated while thinking, markers included
        self.inner_started = False
        self.no_end: np.ndarray | None = None  # the mask without end-of-sequence, made when first needed

    @property
    def error(self) -> str | None:
        """The inner grammar's failure, if it failed."""
        return getattr(self.inner, "error", None)

    def mask_words(self, last: int | None) -> np.ndarray | None:
        """Feed the last sampled token (None at the first step); return the mask of the next token's allowed
        tokens, or None when the gate allows any."""
        if last is not None and self.state in (MAYBE, THINKING):
            self._see(int(last))
        if self.state == ANSWER:
            if self.inner is None:
                return None
            first = not self.inner_started
            self.inner_started = True
            return self.inner.mask_words(None if first else last)
        if not self.forcing and self.state == THINKING and self.budget is not None \
                and self.count + len(self.end_ids) >= self.budget and self.end_text not in self.text:
            self.forcing = list(self.end_ids)
        if self.forcing:
            return one_token(self.forcing[0], self.vocab)
        if self.inner is not None:  # the answer under the grammar is still to come: the block must not end the answer
            if self.no_end is None:
                eos = getattr(self.tokenizer, "eos_token_ids", None) or {self.tokenizer.eos_token_id}
                self.no_end = all_but(sorted(eos), self.vocab)
            return self.no_end
        return None

    def _see(self, token: int) -> None:
        """Account for one generated token."""
        self.count += 1
        if self.forcing and token == self.forcing[0]:
            self.forcing.pop(0)
        self.text += piece(self.tokenizer, token)
        if self.state == MAYBE:
            stripped = self.text.lstrip()
            if stripped.startswith(self.start_text):
                self.state, self.text = THINKING, stripped[len(self.start_text):]
            elif not self.start_text.startswith(stripped):
                self.state = ANSWER  # no thinking: no budget to keep, and no grammar waits (none is set in MAYBE)
            return
        if self.end_text in self.text and not self.forcing:
            self.state = ANSWER
        else:
            self.text = self.text[-4 * len(self.end_text):]  # only the end marker is looked for


def piece(tokenizer, token: int) -> str:
    """A token's text on its own, decoded once per tokenizer and token (a gate looks at every token of its row:
    decoding each again cost ~10 us a row a step)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
    pieces = getattr(hf, "_mlxq_pieces", None)
    if pieces is None:
        pieces = hf._mlxq_pieces = {}
    text = pieces.get(token)
    if text is None:
        text = pieces[token] = tokenizer.decode([token])
    return text


def all_but(tokens: list[int], vocab_size: int) -> np.ndarray:
    """A packed mask (32 tokens a word) allowing every token but these."""
    words = np.full((vocab_size + 31) // 32, 0xFFFFFFFF, np.uint32)
    for token in tokens:
        words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
    return words


def one_token(token: int, vocab_size: int) -> np.ndarray:
    """A packed mask (32 tokens a word) allowing one token."""
    words = np.zeros((vocab_size + 31) // 32, np.uint32)
    words[token // 32] = np.uint32(1 << (token % 32))
    return words
