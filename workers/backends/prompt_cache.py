"""The worker's prompt cache: mlx-lm's LRU of finished sequences' KV caches, reused without copying.

mlx-lm's `fetch_nearest_cache` deep-copies the entry it resumes from, and when only the start of a
longer entry matches (a new conversation that shares a chat template's system prompt with a long
one), it copies all of that entry to keep a few dozen tokens: 38 ms on this CPU for 30 tokens of a
4,000-token entry of the demo model, on the MLX thread, while everyone waits. Here an entry of plain
KV caches is handed out as views of its first tokens: the first new token written makes the
request's own buffer (KVCache grows by concatenation), so the entry is never written and only the
part reused is ever copied. Quantized KV caches (workers/backends/quantized_kv.py) grow the same way,
each of their packed integers, scales and biases a view of the entry's; other cache kinds go through
mlx-lm's own path.

Finding the entry is a walk down mlx-lm's token trie, as long as the prompt: mlx-lm's own search
looks for the shortest longer entry with a copy of the path at every node (11 ms here for one kept
4,000-token entry; on the H100 the worker's log showed steps of 0.1-0.2 s wherever a new long
prompt that shared a system prompt with kept long ones joined, gone with this walk). Any longer
entry holds the shared start, so the first one found serves.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, LRUPromptCache

from workers.backends.quantized_kv import QuantizedCache


class PromptCache(LRUPromptCache):
    """An LRU prompt cache whose hits share the entry's buffers up to the reused length."""

    def fetch_nearest_cache(self, model, tokens: list[int]):
        """The cache of the longest reusable prefix of `tokens` and the tokens left to process."""
        node = self._trie._trie.get(model)
        if node is None or not tokens:
            return None, tokens
        matched = shorter = 0  # tokens walked; the longest kept entry that is a prefix of the prompt
        while matched < len(tokens) and tokens[matched] in node:
            node = node[tokens[matched]]
            matched += 1
            if "__value__" in node:
                shorter = matched
        if shorter == len(tokens):  # the whole prompt is kept
            path, length = tokens, shorter
        elif matched > shorter:  # the start of a longer entry: the first one below serves
            path, length = list(tokens[:matched]), min(len(tokens) - 1, matched)
            while "__value__" not in node:
                token = next(iter(node))
                path.append(token)
                node = node[token]
        elif shorter:
            path, length = tokens[:shorter], shorter
        else:
            return None, tokens
        entry = self._trie.get(model, path).prompt_cache
        if not all(type(c) in (KVCache, QuantizedCache) for c in entry):
            return super().fetch_nearest_cache(model, tokens)
        return [_prefix(c, length) for c in entry], tokens[length:]


def _prefix(cache: KVCache | QuantizedCache, length: int) -> KVCache | QuantizedCache:
    """A cache holding the first `length` tokens of `cache`, sharing its buffers."""
    if type(cache) is not QuantizedCache:
        return entry_view(cache.keys, cache.values, length)
    view = QuantizedCache(group_size=cache.group_size, bits=cache.bits)
    view.keys, view.values = tree_map(lambda x: x[..., :length, :], (tuple(cache.keys), tuple(cache.values)))
    view.offset = length
    return view


def entry_view(keys: mx.array, values: mx.array, length: int) -> KVCache:
    """A plain cache holding the first `length` tokens of an entry's keys and values, sharing their buffers. It
    says which entry it views (`shares`): the prompts of one pass that resume from one entry to one length (a
    burst of chats sharing a system prompt) are merged as one (workers/backends/prefill.py's `merge_rows`)."""
    view = KVCache()
    view.keys, view.values = keys[..., :length, :], values[..., :length, :]
    view.offset = length
    view.shares = (keys, values, view.keys)
    return view
