"""Per-request sampling for requests that decode together: each has its own filters and random stream.

mlx-lm's `make_sampler` draws from MLX's one global generator, so in a batch a request's draws
would depend on who else is decoding. Here a seeded request owns its key: its tokens are the same
alone or in any batch. Greedy requests (temperature 0) take the argmax and need no key.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from jobs.contract import Sampling

Sampler = Callable[[mx.array], mx.array]


def make_sampler(sampling: Sampling, vocab_size: int, seed_offset: int = 0) -> Sampler:
    """A sampler for one sequence: the request's filters, then a draw from its own key.

    `seed_offset` gives the choices of one request (`n` > 1) distinct streams from one seed.
    """
    if sampling.temperature == 0:
        return greedy
    filters = []
    if 0 < sampling.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, sampling.top_p))
    if sampling.min_p:
        filters.append(lambda x: apply_min_p(x, sampling.min_p))
    if effective_top_k(sampling, vocab_size):
        filters.append(lambda x: apply_top_k(x, sampling.top_k))
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
    key = [mx.random.key((seed + seed_offset) % 2**64)]
    scale = 1.0 / sampling.temperature

    def sample(logprobs: mx.array) -> mx.array:
        for keep in filters:
            logprobs = keep(logprobs)
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * scale, key=draw)

    return sample


def effective_top_k(sampling: Sampling, vocab_size: int) -> int:
    """The request's top_k, or 0 (none) when it keeps the whole vocabulary: mlx-lm refuses a top_k that
    large, and its check raises inside a compiled function."""
    return sampling.top_k if 0 < sampling.top_k < vocab_size else 0


def greedy(logprobs: mx.array) -> mx.array:
    """The most likely token."""
    return mx.argmax(logprobs, axis=-1)


def logits_processors(sampling: Sampling, tokenizer=None, vocab_size: int = 0, grammar=None,
                      strict: bool = True) -> list:
    """One sequence's logits processors: a repetition penalty, if asked for, then the response_format's
    grammar (workers/backends/grammar.py: it needs the model's tokenizer and output size; `grammar` a
    matcher compiled beforehand, `strict` whether its failure raises)."""
    penalty = sampling.repetition_penalty
    processors = make_logits_processors(repetition_penalty=penalty) if penalty and penalty != 1.0 else []
    if sampling.grammar:
        from workers.backends.grammar import GrammarProcessor  # llguidance only for requests that use it

        processors.append(GrammarProcessor(grammar or sampling.grammar, tokenizer, vocab_size, strict))
    return processors
