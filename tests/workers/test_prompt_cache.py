"""The worker's prompt cache on the demo model: hits share the kept entry's buffers, never write them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from workers.backends.prompt_cache import PromptCache


@pytest.fixture(scope="module")
def model(demo_text_model):
    """The demo model in float32 (the one the worker holds: tests/workers/conftest.py)."""
    return demo_text_model[0]


def processed(model, ids: list[int]) -> list:
    cache = make_prompt_cache(model)
    model(mx.array(ids)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def next_logits(model, cache, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array(ids)[None], cache=cache)[0, -1])


def test_a_hit_resumes_as_a_fresh_prefill_would_and_leaves_the_entry_as_it_was(model):
    kept = list(range(1000, 1064))  # its buffer (256 tokens) has room: a hit that wrote into it would show
    cache = PromptCache(max_size=4)
    cache.insert_cache("m", kept, processed(model, kept))
    entry = [np.array(c.keys[..., :64, :]) for c in cache._trie.get("m", kept).prompt_cache]
    new = list(range(7000, 7008))
    # One entry, hit three ways in turn (each hit must leave it as it was for the next).
    for case, ids, expected in [("longer", kept[:20] + new, 20),  # only the start of a longer entry matches
                                ("shorter", kept + new, 64),  # the entry is a prefix of the new prompt
                                ("exact", kept, 64)]:
        got, rest = cache.fetch_nearest_cache("m", ids)
        reused = len(ids) - len(rest)
        assert reused == expected, case
        if not rest:  # the whole prompt was cached: its last token is fed again (as the batch does)
            trim_prompt_cache(got, 1)
            rest, reused = ids[-1:], reused - 1
        fresh = processed(model, ids[:reused])
        np.testing.assert_allclose(next_logits(model, got, rest), next_logits(model, fresh, rest), atol=1e-4,
                                   err_msg=case)
        # Feeding the request's tokens made buffers of its own: the kept entry is untouched.
        for before, layer in zip(entry, cache._trie.get("m", kept).prompt_cache, strict=True):
            np.testing.assert_array_equal(before, np.array(layer.keys[..., :64, :]), err_msg=case)


def kept_entry(seed: int):
    """A kept entry's plain cache of 12 random tokens (2 heads of 4)."""
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.keys = mx.random.normal((1, 2, 12, 4), key=mx.random.key(seed))
    cache.values = mx.random.normal((1, 2, 12, 4), key=mx.random.key(seed + 1))
    cache.offset = 12
    return cache


def test_prompts_resuming_from_one_entry_merge_as_mlx_lm_merges_them_row_by_row(monkeypatch):
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from workers.backends.prefill import Prompt, merge_rows, prefix_source
    from workers.backends.prompt_cache import _prefix

    a, b = kept_entry(1), kept_entry(3)
    trimmed = _prefix(a, 7)
    trim_prompt_cache([trimmed], 1)  # a whole prompt cached: its last token is fed again (textbatch's _prompt)
    # Runs of one entry to one length, an empty cache, one trimmed view, another entry, and a cache written since.
    written = _prefix(a, 5)
    written.update_and_fetch(mx.ones((1, 2, 1, 4)), mx.ones((1, 2, 1, 4)))
    rows = [_prefix(a, 9), _prefix(a, 9), _prefix(a, 9), KVCache(), KVCache(), trimmed, _prefix(b, 9), written,
            _prefix(a, 4), _prefix(a, 4)]
    # As feed_together finds them (workers/backends/prefill.py's prefix_source: the entry viewed, untouched).
    sources = [prefix_source(Prompt(None, [], [row], [], [1], 0)) for row in rows]
    assert sources.count(id(a.keys)) == 6 and sources[7] is None
    expected = BatchKVCache.merge(rows)
    got = merge_rows(rows, sources)
    for name in ("keys", "values", "offset", "left_padding"):
        np.testing.assert_array_equal(np.array(getattr(got, name)), np.array(getattr(expected, name)), err_msg=name)
    assert got._idx == expected._idx
    # One entry for every row: copied as one, never row by row.
    monkeypatch.setattr(BatchKVCache, "merge", lambda *a: pytest.fail("merged row by row"))
    same = merge_rows([_prefix(b, 9) for _ in range(5)], [id(b.keys)] * 5)
    np.testing.assert_array_equal(np.array(same.keys), np.broadcast_to(np.array(b.keys[..., :9, :]), (5, 2, 9, 4)))


def test_only_prompts_of_one_namespace_resume_from_one_entry(monkeypatch):

    from workers.backends import prefill
    from workers.backends.prefill import Prompt, prefix_source, share_prefixes
    from workers.backends.prompt_cache import _prefix

    monkeypatch.setitem(prefill.SHARE_TAIL, "cpu", 32)
    text_a, text_b, image_a, image_b = kept_entry(1), kept_entry(3), kept_entry(5), kept_entry(7)
    fed = list(range(100, 108))  # the same ids: beside other images they are other keys and values
    prompts = [Prompt(None, [], [_prefix(e, n)], fed[:n], [1, 2], i, namespace=ns)
               for i, (e, n, ns) in enumerate([(text_a, 8, "m"), (text_b, 6, "m"), (image_a, 8, ("m", "cat.png")),
                                               (image_b, 8, ("m", "dog.png"))])]
    share_prefixes(prompts)
    texts, images = prompts[:2], prompts[2:]
    # The two text prompts now resume from the first's entry, to the 6 tokens they share (the rest processed again).
    assert {prefix_source(p) for p in texts} == {id(text_a.keys)} and [len(p.fed) for p in texts] == [6, 6]
    assert texts[0].rest == fed[6:8] + [1, 2]
    # Each image chat keeps its own entry and everything it had cached.
    assert [prefix_source(p) for p in images] == [id(image_a.keys), id(image_b.keys)]
    assert [len(p.fed) for p in images] == [8, 8] and images[0].rest == [1, 2]
