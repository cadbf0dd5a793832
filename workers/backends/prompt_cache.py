"""The worker's prompt cache: mlx-lm's LRU of finished sequences' KV caches, reused without copying.

mlx-lm's `fetch_nearest_cache` deep-copies the entry it resumes from, and when only the start of a
longer entry matches (a new conversation that shares a chat template's system prompt with a long
one), it copies all of that entry to keep a few dozen tokens: 38 ms on this CPU for 30 tokens of a
4,000-token entry of the demo model, on the MLX thread, while everyone waits. Here an entry of plain
KV caches is handed out as views of its first tokens: the first new token written makes the
request's own buffer (KVCache grows by concatenation), so the entry is never written and only the
part reused is ever copied. Other cache kinds go through mlx-lm's own path.
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, LRUPromptCache


class PromptCache(LRUPromptCache):
    """An LRU prompt cache whose hits share the entry's buffers up to the reused length."""

    def fetch_nearest_cache(self, model, tokens: list[int]):
        """The cache of the longest reusable prefix of `tokens` and the tokens left to process."""
        result = self._trie.search(model, tokens)
        shorter = len(result.shorter) if result.shorter is not None else 0
        if result.exact is not None:
            path, length = result.exact, len(result.exact)
        elif result.longer is not None and result.common_prefix > shorter:
            path, length = result.longer, min(len(tokens) - 1, result.common_prefix)
        elif shorter:
            path, length = result.shorter, shorter
        else:
            return None, tokens
        entry = self._trie.get(result.model, path).prompt_cache
        if not all(type(c) is KVCache for c in entry):
            return super().fetch_nearest_cache(model, tokens)
        return [_prefix(c, length) for c in entry], tokens[length:]


def _prefix(cache: KVCache, length: int) -> KVCache:
    """A cache holding the first `length` tokens of `cache`, sharing its buffers."""
    view = KVCache()
    view.keys = cache.keys[..., :length, :]
    view.values = cache.values[..., :length, :]
    view.offset = length
    return view
