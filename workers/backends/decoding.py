"""The decode loop of a text batch: one token for every decoding sequence per step, in one forward pass.

Sequences join with their prompts processed and their first tokens drawn and handed out
(workers/backends/prefill.py, textbatch.py): a cache holding the prompt, and the first token, which
the next step feeds. They leave when the batch says so, with their caches for the prompt cache.
Sampling is one computation for all rows (workers/backends/sampling.py). Each step queues the next
forward pass before reading back the tokens of the last one, so the device never waits for Python.

A sequence decoding alone keeps its plain cache, at the speed of a single stream (mlx-lm's batch
cache costs one stream a good part of its speed); a second one joining merges both into a batch
cache, and the last one left gets a plain cache again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from workers.backends import cpu_math
from workers.backends.prefill import row_cache
from workers.backends.quantized_kv import BatchQuantizedKVCache
from workers.backends.sampling import BatchSampler, Row

CLEAR_EVERY = 512
"""Steps between returns of MLX's freed buffers to the allocator (as mlx-lm's generator does)."""


@dataclass(eq=False)
class Slot:
    """One decoding sequence: who it is, its token budget, the tokens in its cache."""

    key: object  # the caller's handle for it (textbatch's Sequence)
    budget: int  # tokens it may hand out, its first included
    fed: list[int]  # the tokens whose keys and values are in the cache
    logprobs: bool  # whether its tokens' log-probabilities are wanted
    handed: int = 1  # tokens handed out so far (its first, before it joined)
    joined: bool = True  # whether its input at the coming step is its first token (handed out already)


@dataclass
class Joining:
    """A sequence about to join: `cache` holds `fed`, its prompt; `first`, its first token (drawn and
    handed out by the caller, its row's first draw), is what its first step feeds."""

    key: object
    cache: list
    fed: list[int]
    first: int
    budget: int
    row: Row
    logprobs: bool = False


@dataclass
class Token:
    """What a step hands out for one sequence."""

    key: object
    token: int
    finish_reason: str | None  # "stop" (end of sequence), "length" (budget), or None
    logprobs: mx.array | None = field(default=None, repr=False)  # (V,) it was drawn from, when wanted


def kept_rows(layers: list, rows: list[int]) -> list[list]:
    """Each of these rows' caches, cut from the batch's layers as caches of their own. A plain batch cache's
    padding (quantized or not) is read once for all the rows (mlx-lm's `extract` reads it back from the device
    for every row and layer: 1,024 waits for 64 rows of a 16-layer model); other kinds (sliding windows,
    recurrent states) cut themselves with their own `extract`."""
    padding = [layer.left_padding.tolist() if type(layer) in (BatchKVCache, BatchQuantizedKVCache) else None
               for layer in layers]
    return [[row_cache(layer, i, pad[i], layer.size()) if pad is not None else layer.extract(i)
             for layer, pad in zip(layers, padding, strict=True)] for i in rows]


class DecodeBatch:
    """The sequences decoding together on one model."""

    def __init__(self, model, vocab_size: int, eos: set[int], stream=None):
        self.model, self.eos = model, eos
        self.stream = stream or mx.default_stream(mx.default_device())
        self.slots: list[Slot] = []
        self.sampler = BatchSampler(vocab_size)
        self.cache: list = []  # per layer: a plain cache (one sequence) or a batch cache
        self.batched = False
        self.inputs: mx.array | None = None  # (B,) the tokens the next step feeds (being computed)
        self.input_logprobs: mx.array | None = None  # (B, V) what they were drawn from, when any slot wants them
        self.steps = 0
        self.waited_s = 0.0  # in `step`, waiting for the device's last tokens (the rest of a step is the host's)

    def __len__(self) -> int:
        return len(self.slots)

    def insert(self, key, cache: list, fed: list[int], first: int, budget: int, row: Row,
               logprobs: bool = False) -> None:
        """Add a sequence: `cache` holds `fed`, its prompt; `first`, its first token, the next step feeds."""
        self.insert_many([Joining(key, cache, fed, first, budget, row, logprobs)])

    def insert_many(self, joining: list[Joining], batch_cache: list | None = None) -> None:
        """Add several sequences at once: their caches merge into the batch's in one operation per layer
        (one by one, 64 sequences joining together queued ~10,000 small copies for the next step). With
        `batch_cache` (per layer, a batch cache whose row i is joining[i]'s), that is their caches,
        already merged: the rows of a prompt-processing pass (workers/backends/prefill.py's `Together`)."""
        if not joining:
            return
        with mx.stream(self.stream):
            caches = [j.cache for j in joining]
            if batch_cache is None and not self.slots and len(joining) == 1:
                self.cache, self.batched = caches[0], False
            else:
                new = batch_cache or [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]
                if not self.slots:
                    self.cache = new
                else:
                    if not self.batched:
                        self.cache = [type(c).merge([c]) for c in self.cache]
                    for mine, theirs in zip(self.cache, new, strict=True):
                        mine.extend(theirs)
                self.batched = True
            first = mx.array([j.first for j in joining], mx.uint32)
            self.inputs = first if self.inputs is None else mx.concatenate([self.inputs, first])
            if self.input_logprobs is not None:  # their first tokens went out with them: zeros
                self.input_logprobs = mx.concatenate([self.input_logprobs,
                                                      mx.zeros((len(joining), self.input_logprobs.shape[-1]),
                                                               self.input_logprobs.dtype)])
        self.slots += [Slot(j.key, j.budget, list(j.fed), j.logprobs) for j in joining]
        self.sampler.extend([j.row for j in joining], [j.fed for j in joining], drawn=1)  # their first: drawn

    def step(self) -> list[Token]:
        """Queue the next forward pass, then hand out each sequence's token from the last one (none for
        a sequence that just joined: its first token was handed out before)."""
        if not self.slots:
            return []
        with mx.stream(self.stream):
            current, current_logprobs = self.inputs, self.input_logprobs
            logits = self.model(current[:, None], cache=self.cache)[:, -1, :]
            if self.sampler.reads_inputs:
                # A grammar's mask needs the last tokens on the host: the forward pass is queued first, so the
                # device computes it while the host reads them and works out the masks (queued after them, the
                # device waited for the whole pass to be queued, a host-bound step's most of it).
                mx.async_eval(logits)
            logits = self.sampler.process(logits, current, [True] * len(self.slots))
            logprobs = logits - cpu_math.logsumexp(logits)[:, None]  # (MLX's own exp is slow on a CPU)
            self.inputs = self.sampler.sample(logprobs)
            wanted = any(slot.logprobs for slot in self.slots)
            self.input_logprobs = logprobs if wanted else None
            mx.async_eval(self.inputs, *([logprobs] if wanted else []))
            waiting = time.perf_counter()
            tokens = current.tolist()
            self.waited_s += time.perf_counter() - waiting
        self.steps += 1
        if self.steps % CLEAR_EVERY == 0:
            mx.clear_cache()
        out = []
        for i, (slot, token) in enumerate(zip(self.slots, tokens, strict=True)):
            slot.fed.append(token)
            if slot.joined:  # its first token: handed out when it joined
                slot.joined = False
            else:
                out.append(self._hand(slot, token, current_logprobs, i))
        return out

    def _hand(self, slot: Slot, token: int, logprobs: mx.array | None, row: int) -> Token:
        """Hand out one token of a sequence (row `row` of `logprobs` it was drawn from)."""
        slot.handed += 1
        finish = "stop" if token in self.eos else ("length" if slot.handed >= slot.budget else None)
        vector = logprobs[row] if slot.logprobs and logprobs is not None else None
        return Token(slot.key, token, finish, vector)

    def clear(self) -> tuple[list, bool, list[list[int]]]:
        """Take every sequence out: (the cache as it is, whether it is a batch cache, the tokens each row holds),
        for the caller to cut rows from when it likes (`kept_rows`: nothing touches these layers again)."""
        left = (self.cache, self.batched, [list(slot.fed) for slot in self.slots])
        self.slots = []
        self.sampler.keep([])
        self.cache, self.batched, self.inputs, self.input_logprobs = [], False, None, None
        return left

    def remove(self, keys: list, keep_caches: bool = False) -> list[tuple[list, list[int]]]:
        """Take sequences out; with `keep_caches`, return (cache, the tokens in it) of each."""
        gone = set(map(id, keys))
        drop = [i for i, slot in enumerate(self.slots) if id(slot.key) in gone]
        if not drop:
            return []
        kept = []
        with mx.stream(self.stream):
            if keep_caches:
                caches = kept_rows(self.cache, drop) if self.batched else [self.cache]
                for i, cache in zip(drop, caches, strict=True):
                    # The cache holds one more token than handed out: the last one fed (its keys and values
                    # are being computed now); `fed` lists exactly what it holds.
                    kept.append((cache, list(self.slots[i].fed)))
            keep = [i for i in range(len(self.slots)) if i not in set(drop)]
            self.slots = [self.slots[i] for i in keep]
            self.sampler.keep(keep)
            if not keep:
                self.cache, self.batched, self.inputs, self.input_logprobs = [], False, None, None
                return kept
            index = mx.array(keep, mx.int32)
            self.inputs = self.inputs[index]
            if self.input_logprobs is not None:
                self.input_logprobs = self.input_logprobs[index]
            if self.batched:
                for c in self.cache:
                    c.filter(keep)
                if len(keep) == 1:  # decoding alone again: a plain cache, at a single stream's speed
                    self.cache = [c.extract(0) for c in self.cache]
                    self.batched = False
        return kept
