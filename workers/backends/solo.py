"""One sequence decoding alone: the single-stream loop of mlx-lm's `generate_step`, at its speed.

mlx-lm's batched generator costs a single stream about 40 % of its speed (on the H100: 0.60 of
direct mlx-lm, docs/performance.md), and most of the time one user is all there is. So a batch's
only sequence decodes here, on a plain KV cache, computing each next token while the current one is
handed out; when a second sequence starts decoding, the batched generator takes it over, cache and
all. Its prompt was processed before (workers/backends/prefill.py): only its last token is left.
"""

from __future__ import annotations

import mlx.core as mx


class SoloDecoder:
    """Decode one token per step, from a processed prompt."""

    def __init__(self, model, tokens: list[int], last: list[int], cache, sampler, processors: list,
                 max_tokens: int, eos: set[int]):
        self.model, self.sampler, self.processors, self.eos = model, sampler, processors, eos
        self.cache = cache
        self.fed = list(tokens)  # the tokens whose keys and values are in the cache, as ints
        self.rest = list(last)  # the prompt's last token, until decoding starts
        self.left = max_tokens  # tokens it may still hand out
        self.pending: mx.array | None = None  # the next token, being computed
        self._history = mx.array(self.fed + self.rest[:-1], mx.uint32) if processors else None
        self._pending_logprobs = None  # the log-probabilities `pending` is sampled from
        self.last_logprobs = None  # those of the token last handed out

    @property
    def decoding(self) -> bool:
        """Whether its prompt is processed and a token is being computed."""
        return self.pending is not None

    def step(self) -> tuple[int, str | None]:
        """Hand out the next token: (token, finish reason or None)."""
        if self.pending is None:  # the prompt's last token starts decoding
            last = self.rest.pop()
            self.pending = self._forward(mx.array([last]))
            self.fed.append(last)
        current, self.last_logprobs = self.pending, self._pending_logprobs
        self.left -= 1
        if self.left > 0:  # the next token is computed while this one is handed out
            self.pending = self._forward(current)
        token = current.item()
        if self.left > 0:
            self.fed.append(token)
        return token, "stop" if token in self.eos else ("length" if self.left <= 0 else None)

    def take_pending(self) -> tuple[int, str | None]:
        """Hand out the token being computed without computing another (before a handover)."""
        token, self.last_logprobs = self.pending.item(), self._pending_logprobs
        self.pending = None
        self.left -= 1
        return token, "stop" if token in self.eos else ("length" if self.left <= 0 else None)

    def _forward(self, token: mx.array) -> mx.array:
        """Feed one token and start computing the next."""
        logits = self.model(token[None], cache=self.cache)[:, -1, :]
        if self.processors:
            self._history = mx.concatenate([self._history, token.astype(mx.uint32)])
            for processor in self.processors:
                logits = processor(self._history, logits)
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        sampled = self.sampler(logprobs)
        mx.async_eval(sampled)
        self._pending_logprobs = logprobs  # what `sampled` was drawn from (for logprobs entries)
        return sampled
