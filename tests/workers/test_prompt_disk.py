"""The prompt cache's disk tier: keys, the index, the byte budget, and files that must never be served."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from workers.backends import prompt_disk
from workers.backends.prompt_cache import PromptCache
from workers.backends.prompt_disk import BLOCK, DISK_MIN_TOKENS, Entry, Index, Namespace, entry_name
from workers.backends.quantized_kv import QuantizedCache

NS = Namespace("/models/m", "fp1", layers=2)
LENGTH = DISK_MIN_TOKENS + 40


def tokens(n: int = LENGTH, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def kv_cache(n: int, layers: int = 2, seed: int = 0, dims: int = 8) -> list[KVCache]:
    """A cache of `n` tokens of made-up keys and values (2 heads of `dims`), its buffers longer than it (as kept)."""
    mx.random.seed(seed)
    cache = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, n, dims)), mx.random.normal((1, 2, n, dims)))
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def open_tier(path, mb: int = 64):
    return prompt_disk.open_tier(SimpleNamespace(prompt_cache_dir=str(path), prompt_cache_disk_mb=mb))


def saved(tier, ns: Namespace, ids: list[int], cache: list) -> None:
    """Save an entry and wait until the writer has it on disk."""
    assert tier.save(ns, ids, cache)
    tier.flush(PromptCache())


def entry(name: str, ids: list[int], nbytes: int = 100, ns: bytes = NS.digest) -> Entry:
    return Entry(name, ns, len(ids), nbytes, prompt_disk.prefix_digests(ns, ids))


# --- keys and the index (no files) ---------------------------------------------------------------


def test_every_part_of_the_namespace_changes_the_key():
    ids = tokens()
    variants = [NS, Namespace("/models/other", "fp1", layers=2), Namespace("/models/m", "fp2", layers=2),
                Namespace("/models/m", "fp1", adapter="fr", adapter_fingerprint="a", layers=2),
                Namespace("/models/m", "fp1", adapter="fr", adapter_fingerprint="b", layers=2),
                Namespace("/models/m", "fp1", kv="8/64", layers=2), Namespace("/models/m", "fp1", kv="4/64", layers=2),
                Namespace("/models/m", "fp1", float32=True, layers=2)]
    assert len({entry_name(ns.digest, ids) for ns in variants}) == len(variants)
    assert entry_name(NS.digest, ids) != entry_name(NS.digest, ids[:-1])
    assert prompt_disk.prefix_digests(NS.digest, ids)[0] == prompt_disk.prefix_digests(NS.digest, ids[:BLOCK])[0]


def test_the_index_finds_the_longest_block_aligned_prefix_in_its_namespace_only():
    index = Index()
    short, long = tokens(300), tokens(1000)
    index.add(entry("short", short))
    index.add(entry("long", long))
    prompt = long[:700] + [1, 2, 3]
    found, matched = index.best(NS.digest, prompt)
    assert found.name == "long" and matched == 700 // BLOCK * BLOCK
    # Both hold the prompt's first 256 tokens: the most recently used serves.
    assert index.best(NS.digest, short[:280] + [5] * 100) == (index.entries["long"], 256)
    index.touch("short")
    assert index.best(NS.digest, short[:280] + [5] * 100) == (index.entries["short"], 256)
    assert index.best(Namespace("/models/other", "fp1").digest, prompt) is None
    assert index.best(NS.digest, [7] * 500) is None


def test_an_entry_that_extends_another_lists_it_as_its_prefix():
    index = Index()
    first, other = tokens(300), tokens(300, 7)
    for ids in (first, other):
        index.add(entry(entry_name(NS.digest, ids), ids))
    assert [e.length for e in index.prefixes_of(NS.digest, first + tokens(100, 5))] == [300]
    assert index.prefixes_of(NS.digest, first) == []  # itself is not a strict prefix
    assert index.prefixes_of(Namespace("/models/other", "fp1").digest, first + [1]) == []


def test_the_budget_drops_the_least_recently_used_first():
    index = Index()
    for i in range(4):
        index.add(entry(f"e{i}", tokens(300, 1000 * i), nbytes=100))
    index.touch("e0")  # used again: now the most recent
    assert index.nbytes == 400
    assert [e.name for e in index.over(250)] == ["e1", "e2"]
    assert [e.name for e in index.over(50, keep="e3")] == ["e1", "e2", "e0"]
    index.remove("e1")
    assert index.nbytes == 300 and "e1" not in index
    assert index.best(NS.digest, tokens(300, 1000)) is None


# --- files ----------------------------------------------------------------------------------------


def test_an_entry_survives_a_new_tier_on_its_directory_and_resumes_exactly(tmp_path):
    ids, cache = tokens(), kv_cache(LENGTH)
    tier = open_tier(tmp_path)
    saved(tier, NS, ids, cache)
    tier.close()
    tier = open_tier(tmp_path)  # as a restarted worker: the index comes from the files
    assert len(tier.index) == 1
    prompt = ids + [5, 6, 7]
    loaded = tier.load(NS, prompt)
    assert loaded.tokens == ids
    for got, want in zip(loaded.cache, cache, strict=True):
        assert got.offset == LENGTH
        np.testing.assert_array_equal(np.array(got.keys), np.array(want.keys_and_values()[0]))
        np.testing.assert_array_equal(np.array(got.values), np.array(want.keys_and_values()[1]))
    assert tier.load(NS, prompt, have=len(ids)) is None  # the memory tier holds as much: nothing read
    assert tier.load(NS, ids[:DISK_MIN_TOKENS - 1] + [1] * 50) is None  # too short a prefix to be worth a read
    tier.close()


def test_an_entry_loaded_on_another_thread_is_usable_on_this_one(tmp_path):
    """MLX streams belong to their thread: the tier evaluates what it loads (the preparing threads load)."""
    ids, cache = tokens(), kv_cache(LENGTH)
    tier = open_tier(tmp_path)
    saved(tier, NS, ids, cache)
    out = []
    thread = threading.Thread(target=lambda: out.append(tier.load(NS, ids + [1])))
    thread.start()
    thread.join(30)
    keys, _ = out[0].cache[0].update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert keys.shape == (1, 2, LENGTH + 1, 8) and float(mx.abs(keys[..., :LENGTH, :] - cache[0].keys_and_values()[0]).max()) == 0
    tier.close()


def test_quantized_entries_round_trip(tmp_path):
    ns = Namespace("/models/m", "fp1", kv="8/32", layers=2)
    cache = []
    for layer in kv_cache(LENGTH, dims=64):
        q = QuantizedCache(group_size=32, bits=8)
        q.update_and_fetch(*layer.keys_and_values())
        cache.append(q)
    mx.eval([c.state for c in cache])
    tier = open_tier(tmp_path)
    saved(tier, ns, tokens(), cache)
    loaded = tier.load(ns, tokens() + [3])
    assert all(type(c) is QuantizedCache and c.bits == 8 and c.group_size == 32 for c in loaded.cache)
    for got, want in zip(loaded.cache, cache, strict=True):
        for a, b in zip(got.keys_and_values()[0], want.keys_and_values()[0], strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
    assert tier.load(NS, tokens() + [3]) is None  # the unquantized namespace never gets it
    tier.close()


def test_a_mismatched_model_adapter_or_kv_setting_is_never_served(tmp_path):
    ids = tokens()
    tier = open_tier(tmp_path)
    saved(tier, NS, ids, kv_cache(LENGTH))
    for other in (Namespace("/models/m", "fp-new-weights", layers=2),
                  Namespace("/models/m", "fp1", adapter="fr", adapter_fingerprint="x", layers=2),
                  Namespace("/models/m", "fp1", kv="8/64", layers=2)):
        assert tier.load(other, ids + [1]) is None
    # A file that claims another namespace's name (copied, or tampered with) is dropped when read.
    other = Namespace("/models/m", "fp1", adapter="fr", adapter_fingerprint="x", layers=2)
    os.link(tmp_path / entry_name(NS.digest, ids), tmp_path / entry_name(other.digest, ids))
    tier.close()
    tier = open_tier(tmp_path)  # its header's namespace is not its name's: dropped at the rebuild
    assert not (tmp_path / entry_name(other.digest, ids)).exists() and len(tier.index) == 1
    tier.close()


def test_a_truncated_or_corrupt_file_is_dropped_never_served(tmp_path):
    ids, other = tokens(), tokens(start=50_000)
    tier = open_tier(tmp_path)
    saved(tier, NS, ids, kv_cache(LENGTH))
    saved(tier, NS, other, kv_cache(LENGTH, seed=1))
    cut, garbled = tmp_path / entry_name(NS.digest, ids), tmp_path / entry_name(NS.digest, other)
    # Damaged behind the live tier's back: found at the next read, deleted, and the prompt is processed.
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    assert tier.load(NS, ids + [1]) is None and not cut.exists()
    data = bytearray(garbled.read_bytes())
    data[8:40] = b"x" * 32  # its header no longer parses
    garbled.write_bytes(bytes(data))
    assert tier.load(NS, other + [1]) is None and not garbled.exists()
    assert len(tier.index) == 0
    tier.close()


def test_at_start_damaged_files_and_half_written_ones_are_removed(tmp_path):
    ids = tokens()
    tier = open_tier(tmp_path)
    saved(tier, NS, ids, kv_cache(LENGTH))
    tier.close()
    path = tmp_path / entry_name(NS.digest, ids)
    path.write_bytes(path.read_bytes()[:-10])
    (tmp_path / ".tmp-0123.safetensors").write_bytes(b"half")  # a write a kill -9 interrupted
    (tmp_path / "notes.txt").write_text("not ours")
    tier = open_tier(tmp_path)
    assert len(tier.index) == 0 and not path.exists() and not (tmp_path / ".tmp-0123.safetensors").exists()
    assert (tmp_path / "notes.txt").exists()  # what is not an entry is left alone
    tier.close()


def test_the_byte_budget_evicts_by_last_use_and_an_extension_replaces_its_prefix(tmp_path):
    size = sum(a.nbytes for c in kv_cache(LENGTH) for a in c.keys_and_values())
    tier = open_tier(tmp_path, mb=1)
    tier.budget = int(2.5 * size)  # room for two entries
    a, b, c = tokens(start=0), tokens(start=10_000), tokens(start=20_000)
    saved(tier, NS, a, kv_cache(LENGTH))
    saved(tier, NS, b, kv_cache(LENGTH))
    assert tier.load(NS, a + [1]) is not None  # a used: b is now the least recently used
    saved(tier, NS, c, kv_cache(LENGTH))
    names = {p.name for p in tmp_path.glob("*.safetensors")}
    assert names == {entry_name(NS.digest, a), entry_name(NS.digest, c)}
    longer = a + tokens(BLOCK, 90_000)
    saved(tier, NS, longer, kv_cache(len(longer)))
    names = {p.name for p in tmp_path.glob("*.safetensors")}
    assert entry_name(NS.digest, a) not in names and entry_name(NS.digest, longer) in names
    assert tier.load(NS, a + [1]).tokens == longer  # the longer entry serves the shorter prompt
    assert tier.index.nbytes <= tier.budget
    tier.close()


def test_short_entries_and_duplicates_are_not_written(tmp_path):
    tier = open_tier(tmp_path)
    assert not tier.save(NS, tokens(DISK_MIN_TOKENS - 1), kv_cache(DISK_MIN_TOKENS - 1))
    saved(tier, NS, tokens(), kv_cache(LENGTH))
    assert not tier.save(NS, tokens(), kv_cache(LENGTH))
    tier.close()


def test_a_warm_stop_writes_what_the_memory_tier_holds(tmp_path):
    tier = open_tier(tmp_path)
    memory = PromptCache()
    memory.insert_cache("key", tokens(), kv_cache(LENGTH))
    memory.insert_cache("unregistered", tokens(start=5), kv_cache(LENGTH))
    tier.register("key", NS)
    tier.flush(memory)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [entry_name(NS.digest, tokens())]
    tier.close()


def test_one_directory_serves_one_worker(tmp_path):
    first = open_tier(tmp_path)
    assert open_tier(tmp_path) is None  # in use: the second goes without a disk tier
    first.close()
    second = open_tier(tmp_path)
    assert second is not None
    second.close()
    assert prompt_disk.open_tier(SimpleNamespace(prompt_cache_dir="", prompt_cache_disk_mb=64)) is None


def test_the_memory_tiers_reach_is_read_without_changing_it():
    memory = PromptCache()
    kept = tokens(300)
    memory.insert_cache("key", kept, kv_cache(300))
    assert prompt_disk.in_memory(memory, "key", kept + [1, 2]) == 300  # the entry is a prefix of the prompt
    assert prompt_disk.in_memory(memory, "key", kept) == 300  # the whole prompt
    assert prompt_disk.in_memory(memory, "key", kept[:100] + [1]) == 100  # the start of a longer entry
    assert prompt_disk.in_memory(memory, "key", kept[:100]) == 99  # its last token is always processed
    assert prompt_disk.in_memory(memory, "other", kept) == 0
    assert prompt_disk.in_memory(memory, "key", [5] + kept) == 0


@pytest.mark.parametrize("layers", [1, 3])
def test_an_entry_of_another_layer_count_is_dropped(tmp_path, layers):
    ids = tokens()
    tier = open_tier(tmp_path)
    saved(tier, NS, ids, kv_cache(LENGTH))
    liar = Namespace("/models/m", "fp1", layers=layers)  # as if the file said 2 layers for a model of `layers`
    path = tmp_path / entry_name(NS.digest, ids)
    with pytest.raises(prompt_disk.BadEntry):
        prompt_disk._cache_of(mx.load(str(path)), liar, len(ids))
    tier.close()
