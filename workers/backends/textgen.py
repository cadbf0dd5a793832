"""Text generation on mlx-lm: load a model, build prompts, generate with stop strings and real usage."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.utils import dequantize_model

from jobs.contract import Sampling
from jobs.errors import ContextLengthExceeded
from workers.backends.logprobs import entry
from workers.backends.quantized_kv import make_cache
from workers.backends.sampling import logits_processors, make_sampler


@dataclass(frozen=True)
class Piece:
    """What one generated token released: new text (often "", held back or mid-character)."""

    text: str
    tokens: int  # completion tokens generated so far
    prompt_tokens: int
    finish_reason: str | None = None  # "stop" | "length" on the last piece
    logprob: dict | None = None  # this token's logprobs entry, when the request asks for them
    stop_sequence: str | None = None  # the stop string that ended it, if one did

    @property
    def final(self) -> bool:
        """Whether this is the last piece of its generation."""
        return self.finish_reason is not None


def load(path: Path, float32: bool = False):
    """Load an mlx-lm model and its tokenizer; dequantize/upcast to float32 when asked (CPU policy)."""
    # Lazy load, so upcasting never holds the stored and the float32 weights fully at once.
    model, tokenizer = mlx_lm.load(str(path), lazy=True)
    return materialize(model, float32), tokenizer


def materialize(model, float32: bool):
    """Evaluate a lazily loaded model's weights, dequantized and upcast to float32 first when asked."""
    if float32:
        dequantize_model(model)
        model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def chat_prompt(tokenizer, messages: Sequence[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a chat, rendered with the model's chat template (with its tools, if any, and the
    request's template variables) and the assistant turn opened."""
    if getattr(tokenizer, "chat_template", None) is None:
        # A base model has no template: a plain transcript is the honest fallback.
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return text_prompt(tokenizer, "\n".join(lines) + "\nassistant:")
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **extra)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def prompt_ids(tokenizer, prompt: str | Sequence[dict], tools: list[dict] | None = None,
               context_length: int | None = None, template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a request's input: a chat (a list of messages, with tools and template variables) or a
    plain completion prompt; one that cannot fit `context_length` is refused from its length before it is
    tokenized."""
    if context_length:
        check_length(tokenizer, prompt, context_length)
    if isinstance(prompt, list):
        return chat_prompt(tokenizer, prompt, tools, template_kwargs)
    return text_prompt(tokenizer, prompt)


def check_length(tokenizer, prompt, context_length: int) -> None:
    """Refuse a prompt whose text is too long to be `context_length` tokens, without tokenizing it.

    A token stands for at most `longest_token` characters, so text longer than the context times
    that is more tokens than the context holds, whatever the template adds. Tokenizing a 60 MB body
    took 81 s on the worker's one MLX thread, and every other request waited for it.
    """
    chars = text_length(prompt)  # the messages' text only: a template may leave the tools out
    most = context_length * longest_token(tokenizer)
    if chars > most:
        raise ContextLengthExceeded(f"the prompt is {chars} characters long, more than the model's context "
                                    f"length of {context_length} tokens can hold (at most {most} characters)")


def text_length(value) -> int:
    """Characters in every string a prompt (its messages, their content parts) holds."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_length(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(text_length(v) for v in value)
    return 0


def longest_token(tokenizer) -> int:
    """The most characters of text one token can stand for (kept on the tokenizer: about 30 ms to find).

    A vocabulary entry is the token's text (a byte-level BPE's, one character per byte: at least as
    many as the text's characters). A normalizer may fold several characters of input into one
    (Unicode composition), so with one the bound is taken four times wider.
    """
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's TokenizerWrapper holds the HF tokenizer
    found = getattr(hf, "_mlxq_longest_token", None)
    if found is None:
        longest = max((len(token) for token in hf.get_vocab()), default=1)
        backend = getattr(hf, "backend_tokenizer", None)
        found = longest * (4 if backend is None or backend.normalizer is not None else 1)
        hf._mlxq_longest_token = found
    return found


def text_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a plain completion prompt (with the tokenizer's own special tokens)."""
    return list(tokenizer.encode(prompt))


class StopBuffer:
    """Finds stop strings in streamed text, holding back any tail that could begin one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched: str | None = None  # the stop string found, once one is

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to release, whether a stop string matched)."""
        self.pending += text
        hits = [(i, s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            released, self.pending = self.pending[:at], ""
            return released, True
        keep = held_tail(self.pending, self.stops)
        cut = len(self.pending) - keep
        released, self.pending = self.pending[:cut], self.pending[cut:]
        return released, False

    def flush(self) -> str:
        """Release whatever is held (generation ended without a stop string)."""
        released, self.pending = self.pending, ""
        return released


def held_tail(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`: what must be
    held back from a stream until the next text shows whether a marker begins there."""
    longest = max((len(m) for m in markers), default=0)
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(m.startswith(tail) for m in markers):
            return size
    return 0


def token_budget(prompt_tokens: int, max_tokens: int, context_length: int | None) -> int:
    """Tokens that may be generated: max_tokens, capped by what is left of the context window."""
    limit = context_length or math.inf
    if prompt_tokens >= limit:
        raise ContextLengthExceeded(f"the prompt is {prompt_tokens} tokens but the model's context length "
                                    f"is {context_length} tokens")
    return int(min(max_tokens, limit - prompt_tokens))


def _generation_kwargs(sampling: Sampling, vocab_size: int, tokenizer=None, gate=None) -> dict:
    """stream_generate's sampler and logits processors for these settings (`gate`: wraps the grammar, for a
    reasoning model's thinking: workers/backends/reasoning.py)."""
    sampler = make_sampler(sampling, vocab_size)
    return {"sampler": sampler, "logits_processors": logits_processors(sampling, tokenizer, vocab_size, gate=gate)}


@dataclass(frozen=True)
class Step:
    """One token of a library's stream (mlx-lm's or mlx-vlm's), in the terms `pieces` needs."""

    text: str
    tokens: int  # completion tokens generated so far
    prompt_tokens: int
    finish_reason: str | None = None
    logprob: dict | None = None


def logprob_of(sampling: Sampling, tokenizer, token: int | None, logprobs, finish_reason: str | None):
    """A token's logprobs entry when the request asks for them (none for the end-of-sequence token)."""
    if sampling.logprobs is None or token is None or logprobs is None or finish_reason == "stop":
        return None
    return entry(tokenizer, token, logprobs, sampling.logprobs)


def generate(model, tokenizer, prompt: list[int], sampling: Sampling,
             context_length: int | None = None, gate=None, kv=None) -> Iterator[Piece]:
    """Generate from token ids: one Piece per token; the last one carries the finish reason. `gate(grammar)`
    gives the sequence's token-level constraint around its grammar (a reasoning model's thinking budget);
    `kv` (a jobs.kv_quant.KVQuant) quantizes its KV cache."""
    budget = token_budget(len(prompt), sampling.max_tokens, context_length)
    kwargs = _generation_kwargs(sampling, output_size(model, tokenizer), tokenizer, gate)
    if kv is not None:
        # The batch's own quantized cache, from the first token (mlx-lm's kv_bits would quantize after the
        # first chunk of the prompt, and fail on a sliding-window layer instead of leaving it as it is).
        kwargs["prompt_cache"] = make_cache(model, kv)
    steps = (Step(step.text, step.generation_tokens, len(prompt), step.finish_reason,
                  logprob_of(sampling, tokenizer, step.token, step.logprobs, step.finish_reason))
             for step in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=budget, **kwargs))
    return pieces(steps, StopBuffer(sampling.stop))


def pieces(steps: Iterator[Step], stops: StopBuffer) -> Iterator[Piece]:
    """Turn a token stream into Pieces, ending at a stop string or the stream's own finish.

    Stop strings are matched on the text and never released; completion token counts include the
    token that completed a stop string and the end-of-sequence token (it was generated).
    """
    try:
        for step in steps:
            text, matched = stops.feed(step.text)
            if matched:
                yield Piece(text, step.tokens, step.prompt_tokens, "stop", step.logprob, stops.matched)
                return
            if step.finish_reason:
                yield Piece(text + stops.flush(), step.tokens, step.prompt_tokens, step.finish_reason, step.logprob)
                return
            yield Piece(text, step.tokens, step.prompt_tokens, logprob=step.logprob)
    finally:
        steps.close()  # the library's generator stops now, not whenever it is collected


def output_size(model, tokenizer) -> int:
    """How many tokens the model's output layer scores (its config's vocabulary, else the tokenizer's)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None) or getattr(tokenizer, "vocab_size", None)
    return int(size) if size else 2**31 - 1
