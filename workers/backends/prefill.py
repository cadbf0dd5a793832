"""Prompt processing for a text batch: in chunks, on each prompt's own cache, fairly among requests.

mlx-lm's BatchGenerator processes every prompt it holds in each `next()`, beside its decode step,
and holds sequences beyond its batch size back in arrival order. A short chat then got one token
per chunk of two long prompts, and waited behind the last of another request's 64 choices. So a
batch processes prompts before the generator sees them (workers/backends/textbatch.py): a turn is
at most PREFILL_CHUNK tokens, given to the request with the least output under way (a new one
first), the prompt that a single turn finishes before a longer one, then in arrival order. The
choices of one prompt (`n`) share its processing; each starts from its own copy of the cache.
Prompts that a turn finishes are processed in one forward pass, padded as mlx-lm's own batch
prefill does (caches aligned on the left, new tokens padded on the right, the padding rolled to
the front after): 32 short prompts cost about one pass, not 32, and those that resume from a
cached prefix (a shared system prompt) join it too. The pass that finishes a prompt gives the logits
of its last position, from which its choices draw their first tokens (workers/backends/textbatch.py):
a request's first token comes from its prompt's own pass, not from a decode step after it.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from workers.backends.prompt_cache import entry_view
from workers.backends.quantized_kv import BatchQuantizedKVCache, QuantizedCache


@dataclass(eq=False)
class Start:
    """One choice of a prompt: what it decodes with, and, once the prompt is processed, its cache."""

    seq: object  # its workers.backends.choice.Sequence
    budget: int  # tokens it may generate
    row: object  # its sampling settings (workers/backends/sampling.py's Row)
    order: int  # its prompt's arrival in the batch
    cache: list | None = None
    fed: list[int] = field(default_factory=list)  # the tokens in `cache`: the whole prompt, once processed
    first: int | None = None  # its first token (handed out), which the decoder feeds first
    in_pass: tuple[Together, int] | None = None  # (pass, row): its cache is still that row of the pass's

    @property
    def task(self):
        """The request it belongs to."""
        return self.seq.task

    def own_cache(self) -> list:
        """Its cache as one of its own (cut out of its pass's batch cache, lazily, if still in it)."""
        if self.in_pass is not None:
            together, row = self.in_pass
            self.cache, self.in_pass = together.row(row), None
        return self.cache


@dataclass(eq=False)
class Together:
    """The batch cache of prompts processed in one pass (`feed_together`), kept whole: when every one of
    them starts decoding at once (one choice each, the usual burst of chats), the decode batch takes it in
    one piece. Cut into rows and merged again, each row's keys and values were copied twice, two small
    copies per row and layer (4,000 for 63 short prompts on a 16-layer model; a 63-prompt turn took
    90-140 ms on an H100 where its forward pass takes ~5)."""

    cache: list  # per layer, a BatchKVCache; row i is prompts' i
    starts: list[int]  # where each row's keys and values begin (its padding before them)
    end: int

    @property
    def rows(self) -> int:
        return len(self.starts)

    def row(self, i: int) -> list:
        """Row i as plain caches of its own (lazy copies)."""
        return [row_cache(layer, i, self.starts[i], self.end) for layer in self.cache]


@dataclass(eq=False)
class Prompt:
    """One input of a request, being processed; its choices start from it once it all is."""

    task: object
    starts: list[Start]
    held: list  # its cache, unless it is a row of a pass's (`together`)
    fed: list[int]  # the tokens whose keys and values are in the cache
    rest: list[int]  # the tokens still to process
    order: int
    turns: int = 0  # prompt-processing turns it has had
    together: tuple[Together, int] | None = None  # (pass, row) once processed with others, in a batch cache
    embed: object = None  # an image chat's: its whole prompt's input embeddings, or the function that computes them
    namespace: object = None  # the prompt cache's namespace it resumed in (an image chat's names its images)

    @property
    def cache(self) -> list:
        """Its cache (a row of its pass's batch cache is cut out as a copy of its own on first use)."""
        if self.together is not None:
            together, row = self.together
            self.held, self.together = together.row(row), None
        return self.held

    @cache.setter
    def cache(self, value: list) -> None:
        self.held, self.together = value, None

    @property
    def left(self) -> int:
        """Prompt tokens still to process before it can decode."""
        return len(self.rest)

    def feed(self, model, n: int) -> mx.array | None:
        """Process its next `n` tokens into its cache; once that finishes the prompt, the logits (V,) at
        its last token (what its first token is drawn from)."""
        part, self.rest = self.rest[:n], self.rest[n:]
        extra = {}
        if self.embed is not None:  # an image chat: its embeddings in place of the ids (vision_batch.py)
            if not isinstance(self.embed, mx.array):
                self.embed = self.embed()  # the vision tower runs at the turn that first needs it
            extra["input_embeddings"] = self.embed[:, len(self.fed):len(self.fed) + len(part)]
        if self.rest:  # more to come: only the cache is computed
            model(mx.array(part)[None], cache=self.cache, **extra)
            logits = None
        else:
            logits = last_logits(model, mx.array(part)[None], self.cache, [len(part) - 1], **extra)[0]
            self.embed = None
        mx.eval([c.state for c in self.cache], *([logits] if logits is not None else []))
        self.fed.extend(part)
        return logits

    @property
    def plain(self) -> bool:
        """Whether its cache is plain KV caches, quantized or not (which `feed_together` can pad and merge)."""
        return all(type(c) in (KVCache, QuantizedCache) for c in self.cache)

    def ready(self) -> list[Start]:
        """Its choices, each with a cache of its own, once prefill is over (a single choice of a prompt
        processed with others keeps its row in their batch cache, for the decode batch to take whole)."""
        if self.together is not None and len(self.starts) == 1:
            start = self.starts[0]
            start.cache, start.in_pass, start.fed = None, self.together, list(self.fed)
            self.together = None  # handed on: the decode batch may take the pass's cache as its own
            return self.starts
        if self.together is not None:  # its row cut out now and computed: the choices' copies keep no pass alive
            mx.eval([c.state for c in self.cache])
        for i, start in enumerate(self.starts):
            start.cache = self.cache if i == len(self.starts) - 1 else copy.deepcopy(self.cache)
            start.fed = list(self.fed)
        return self.starts


class _AtPositions(nn.Module):
    """A model's backbone that hands on one position per row of its hidden states, so the output layer
    after it runs on those only (whatever the model does there: tied embeddings, soft-capping, scaling)."""

    def __init__(self, backbone: nn.Module, positions: list[int]):
        super().__init__()
        self.backbone = backbone
        self.rows, self.positions = mx.arange(len(positions)), mx.array(positions)

    def __call__(self, *args, **kwargs):
        hidden = self.backbone(*args, **kwargs)
        if isinstance(hidden, mx.array) and hidden.ndim == 3:
            return hidden[self.rows, self.positions][:, None]
        return hidden

    def __getattr__(self, key: str):
        value = self.get(key, None)
        if value is None and "backbone" in self:  # the backbone's own parts (embed_tokens for a tied head)
            return getattr(self["backbone"], key)
        return super().__getattr__(key)


def last_logits(model, inputs: mx.array, cache: list, positions: list[int], **extra) -> mx.array:
    """Run `inputs` (B, L) through the model into `cache` (`extra`: input_embeddings in their place); the logits
    (B, V) at one position per row.

    The output layer runs on those positions only where the backbone is `model.model` (mlx-lm's models,
    mostly): a chunk's full logits are its length times the vocabulary, and only one row of them is needed.
    Elsewhere every position's logits are computed and those picked (right, only slower)."""
    backbone = model.get("model") if isinstance(model, nn.Module) else None
    if isinstance(backbone, nn.Module) and inputs.shape[1] > 1:
        model.model = _AtPositions(backbone, positions)
        try:
            logits = model(inputs, cache=cache, **extra)
        finally:
            model.model = backbone
        if logits.shape[1] == 1:
            return logits[:, 0]
    else:
        logits = model(inputs, cache=cache, **extra)
    return logits[mx.arange(len(positions)), mx.array(positions)]


def feed_together(model, prompts: list[Prompt]) -> mx.array:
    """Process what is left of several prompts (plain caches) in one forward pass; each keeps its own cache.
    Returns the logits (B, V) at each one's last token.

    Their caches are merged, aligned at their ends (left padding); the new tokens are padded on the
    right to one length, and the batch cache rolls that padding to the front afterwards. The mask
    hides all padding and per-row offsets keep every row's positions as they would be alone.
    """
    parts = [prompt.rest for prompt in prompts]
    width = max(len(part) for part in parts)
    padding = [width - len(part) for part in parts]
    sources = [prefix_source(prompt) for prompt in prompts]
    cache = [merge_rows(list(layer), sources) for layer in zip(*(prompt.cache for prompt in prompts), strict=True)]
    if any(padding):
        for layer in cache:
            layer.prepare(lengths=[len(part) for part in parts], right_padding=padding)
    inputs = mx.array([part + [0] * pad for pad, part in zip(padding, parts, strict=True)])
    extra = _embeddings(model, prompts, parts, padding) if any(p.embed is not None for p in prompts) else {}
    logits = last_logits(model, inputs, cache, [len(part) - 1 for part in parts], **extra)
    if any(padding):
        for layer in cache:
            layer.finalize()
    # Each row's keys and values start after its padding: the cached prefixes were aligned on the
    # longest, the right padding rolled to the front. Computed here, once: BatchKVCache.extract reads
    # the padding back from the device for every row and layer (512 waits for 32 prompts, 0.2-0.3 s
    # of a turn on the H100).
    longest = max(len(prompt.fed) for prompt in prompts)
    together = Together(cache, [longest - len(prompt.fed) + pad for prompt, pad in zip(prompts, padding, strict=True)],
                        cache[0].size())
    whole = all(type(layer) is BatchKVCache for layer in cache)  # what DecodeBatch can take as it is
    for row, (prompt, part) in enumerate(zip(prompts, parts, strict=True)):
        if whole:
            prompt.together = (together, row)
        else:
            prompt.cache = together.row(row)
        prompt.fed.extend(part)
        prompt.rest = prompt.rest[len(part):]
    # Evaluated here: a row cut out later is a copy of computed keys and values, and none keeps the
    # padded batch alive once its prompts are done with it.
    mx.eval(logits, [[layer.keys, layer.values, layer.offset, layer.left_padding] for layer in cache] if whole
            else [c.state for prompt in prompts for c in prompt.cache])
    return logits


SHARE_TAIL = {"gpu": 32, "cpu": 0}
"""Cached tokens a prompt may process again, past what the prompts of its pass all share, to resume from the same
prompt-cache entry as the others (`share_prefixes`), by device: on a CPU the pass's arithmetic is the cost, not the
copies, so only prompts that share all of their cached tokens are pointed at one entry there."""


def _shares(prompt: Prompt) -> tuple | None:
    """(keys, values) per layer of the prompt-cache entry whose first tokens the prompt's cache only views (nothing
    processed into it yet: workers/backends/prompt_cache.py's `entry_view`); else None."""
    if prompt.turns or not prompt.cache:
        return None
    shares = [getattr(c, "shares", None) for c in prompt.cache]
    if any(s is None or type(c) is not KVCache or c.keys is not s[2] for c, s in zip(prompt.cache, shares, strict=True)):
        return None
    return tuple((s[0], s[1]) for s in shares)


def prefix_source(prompt: Prompt) -> int | None:
    """The prompt-cache entry a prompt resumes from, while its cache only views that entry's first tokens, as an id;
    else None. Prompts passed together are ordered by it, so that those resuming from one entry sit side by side
    for `merge_rows`."""
    shares = _shares(prompt)
    return None if shares is None else id(shares[0][0])


def share_prefixes(prompts: list[Prompt]) -> None:
    """Prompts to be processed in one pass that resume from different prompt-cache entries, each the one with the most
    tokens in common with it, resume from one entry to the tokens they all share (a chat template's system prompt),
    each processing its few cached tokens past those again (at most SHARE_TAIL; those with more keep their own):
    `merge_rows` then copies the shared part once per layer, not once per row. On a host-bound GPU a copy per row
    and layer (2,016 for 63 prompts of a 16-layer model) costs more than a few more tokens in a batched pass. Only
    prompts of one namespace share: the same ids are other keys and values beside other images."""
    groups: dict[object, list[tuple[Prompt, tuple]]] = {}
    for prompt in prompts:
        shares = _shares(prompt)
        if shares is not None:
            groups.setdefault(prompt.namespace, []).append((prompt, shares))
    limit = SHARE_TAIL["gpu" if mx.default_device() == mx.gpu else "cpu"]
    for viewing in groups.values():
        first, source = viewing[0][0].fed, viewing[0][1]
        shared = min(len(prompt.fed) for prompt, _ in viewing)
        for prompt, _ in viewing[1:]:
            shared = next((i for i in range(shared) if prompt.fed[i] != first[i]), shared)
        for prompt, _ in viewing if shared and len(viewing) > 1 else []:
            tail = len(prompt.fed) - shared
            if tail > limit:
                continue
            prompt.cache = [entry_view(keys, values, shared) for keys, values in source]
            prompt.rest = prompt.fed[shared:] + prompt.rest
            del prompt.fed[shared:]
            for start in prompt.starts:
                start.seq.cached_tokens -= tail


def merge_rows(layers: list, sources: list[int | None]) -> BatchKVCache | BatchQuantizedKVCache:
    """One layer of a pass's prompts as a batch cache, aligned at their ends (mlx-lm's `merge`), with consecutive
    rows that resume from the same prompt-cache entry (`sources`, from `prefix_source`) to the same length copied in
    one operation: merged row by row, a burst of 63 chats sharing a system prompt queued 2,016 small copies on a
    16-layer model, each a kernel launch on a host-bound GPU."""
    if not all(type(c) is KVCache for c in layers):
        return type(layers[0]).merge(layers)
    lengths = [c.size() for c in layers]
    longest = max(lengths)
    runs: list[list[int]] = []  # consecutive rows of one source: an entry to a length, or nothing cached
    previous = None
    for i, source in enumerate(sources):
        source = "empty" if not lengths[i] else (source, lengths[i]) if source is not None else ("own", i)
        if runs and source == previous:
            runs[-1].append(i)
        else:
            runs.append([i])
        previous = source
    if longest == 0 or len(runs) == len(layers):  # nothing to share: mlx-lm's merge does the same work
        return BatchKVCache.merge(layers)
    some = next(c for c in layers if c.keys is not None)
    _, heads, _, key_dim = some.keys.shape
    value_dim, dtype = some.values.shape[3], some.keys.dtype
    keys, values = [], []
    for run in runs:
        c, n, length = layers[run[0]], len(run), lengths[run[0]]
        if not length:
            keys.append(mx.zeros((n, heads, longest, key_dim), dtype))
            values.append(mx.zeros((n, heads, longest, value_dim), dtype))
            continue
        k, v = c.keys[..., :length, :], c.values[..., :length, :]
        if n > 1:
            k, v = mx.broadcast_to(k, (n, *k.shape[1:])), mx.broadcast_to(v, (n, *v.shape[1:]))
        if length < longest:
            k = mx.pad(k, [(0, 0), (0, 0), (longest - length, 0), (0, 0)])
            v = mx.pad(v, [(0, 0), (0, 0), (longest - length, 0), (0, 0)])
        keys.append(k)
        values.append(v)
    merged = BatchKVCache([longest - length for length in lengths])
    if len(runs) == 1:  # one source for all: its rows as an array of their own (a broadcast view is not)
        merged.keys, merged.values = mx.contiguous(keys[0]), mx.contiguous(values[0])
    else:
        merged.keys, merged.values = mx.concatenate(keys), mx.concatenate(values)
    merged.offset += longest
    merged._idx = longest
    return merged


def _embeddings(model, prompts: list[Prompt], parts: list[list[int]], padding: list[int]) -> dict:
    """The pass's input embeddings (B, L, D), when image chats are in it: theirs (the vision tower runs now, once for
    all of them where their embeddings offer `many`), the token embeddings of the others, each padded on the right
    like its ids."""
    pending = [prompt for prompt in prompts if prompt.embed is not None and not isinstance(prompt.embed, mx.array)]
    if len(pending) > 1 and hasattr(pending[0].embed, "many"):  # one call of the vision tower for all their images
        for prompt, embed in zip(pending, pending[0].embed.many([p.embed for p in pending]), strict=True):
            prompt.embed = embed
    rows = []
    for prompt, part, pad in zip(prompts, parts, padding, strict=True):
        if prompt.embed is not None:
            if not isinstance(prompt.embed, mx.array):
                prompt.embed = prompt.embed()
            row = prompt.embed[0, len(prompt.fed):len(prompt.fed) + len(part)]
            prompt.embed = None  # the pass finishes it
        else:
            row = model.model.embed_tokens(mx.array(part))
        rows.append(mx.pad(row, [(0, pad), (0, 0)]) if pad else row)
    dtype = rows[0].dtype
    return {"input_embeddings": mx.stack([row.astype(dtype) for row in rows])}


def row_cache(layer: BatchKVCache | BatchQuantizedKVCache, row: int, start: int, end: int) -> KVCache | QuantizedCache:
    """One row of a batch cache, from `start` to `end`, as a plain cache of its own (a lazy copy)."""
    if type(layer) is BatchQuantizedKVCache:
        return layer.row(row, start, end)
    cache = KVCache()
    cache.keys = mx.contiguous(layer.keys[row:row + 1, :, start:end])
    cache.values = mx.contiguous(layer.values[row:row + 1, :, start:end])
    cache.offset = end - start
    return cache


def plan(prompts: list[Prompt], started: Counter, chunk: int, burst: int = 0) -> list[tuple[Prompt, int]]:
    """The next turn: (prompt, tokens to process) pairs, at most `chunk` tokens in all, or `burst` when every
    prompt in it is new and whole.

    `started` counts each request's choices that decode or are ready to. The first prompt in the
    order gets a chunk (or what it has left). Whole prompts that fit in what remains of the turn
    follow, from requests as far along as its own: many short prompts take one turn, a long one is
    cut where it would be alone, and a new request's turn is not lengthened by an older one's.
    New whole prompts share a turn of up to `burst` tokens: the batch processes them in turns back to back
    anyway (a new prompt that one turn finishes goes at once), and each turn costs a host-bound device its
    fixed ~10 ms (H100, 1B shape: 64 prompts of ~53 tokens in one pass 23–38 ms, in seven 512-token turns ~80).
    """
    ordered = sorted(prompts, key=lambda p: (started[p.task] > 0, p.left > chunk, p.order))
    if not ordered:
        return []
    first = ordered[0]
    turn = [(first, min(chunk, first.left))]
    fresh = first.left <= chunk and not first.turns
    room = max(chunk, burst if fresh else 0) - turn[0][1]
    for prompt in ordered[1:]:
        if fresh and (prompt.turns or prompt.left > chunk):  # a burst's turn is of new short prompts only
            continue
        if 0 < prompt.left <= room and (started[prompt.task] > 0) == (started[first.task] > 0):
            turn.append((prompt, prompt.left))
            room -= prompt.left
    return turn
