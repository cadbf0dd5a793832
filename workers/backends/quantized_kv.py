"""Quantized KV caches for the text batch: one sequence's (`QuantizedCache`) and a batch's
(`BatchQuantizedKVCache`), and a model's caches made quantized as a `jobs.kv_quant.KVQuant` says.

mlx-lm 0.32 quantizes one sequence's cache (QuantizedKVCache) but has no batch cache of quantized keys and
values. `BatchQuantizedKVCache` is its BatchKVCache (rows aligned on the right by left padding, per-row
offsets; merge, extend, filter, extract, prepare / finalize for right-padded prompts) holding each of keys and
values as MLX's quantized triple (packed integers, scales, biases: `mx.quantize`). A model's attention reads
`bits` and `group_size` off the cache and takes mlx-lm's quantized path (models/base.py), with the batch's mask
hiding each row's padding. Keys and values are quantized as they are written, so a cache is that size from
its first token (what that saves, and what it costs in quality: docs/performance.md).
"""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_map, tree_reduce
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, _BaseCache, dynamic_roll, make_prompt_cache

from jobs.errors import JobError
from jobs.kv_quant import KVQuant


class QuantizedCache(QuantizedKVCache):
    """One sequence's quantized KV cache (mlx-lm's) that merges into a batch cache as a plain one does."""

    def size(self) -> int:
        """Tokens it holds."""
        return self.offset

    @classmethod
    def merge(cls, caches: list[QuantizedCache]) -> BatchQuantizedKVCache:
        """These sequences' caches as one batch cache."""
        return BatchQuantizedKVCache.merge(caches)


def _packed(shape: tuple, dim: int, dtype, kv: KVQuant) -> tuple:
    """Zeroed quantized storage of `shape` (B, H, L) for vectors of `dim` elements."""
    per_int = 32 // kv.bits
    return (mx.zeros((*shape, dim // per_int), mx.uint32), mx.zeros((*shape, dim // kv.group_size), dtype),
            mx.zeros((*shape, dim // kv.group_size), dtype))


def _dims(packed: tuple, kv: KVQuant) -> int:
    """The vectors' length that quantized storage holds."""
    return packed[1].shape[-1] * kv.group_size


class BatchQuantizedKVCache(_BaseCache):
    """mlx-lm's BatchKVCache with its keys and values stored quantized (see the module's docstring)."""

    step = 256

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        self.keys = self.values = None  # each a (packed, scales, biases) triple of (B, H, L, ...) arrays
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-pad for pad in left_padding])
        self._idx = 0
        self._right_padding = None
        self.group_size, self.bits = group_size, bits

    @property
    def kv(self) -> KVQuant:
        """Its quantization."""
        return KVQuant(self.bits, self.group_size)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Quantize and store new keys and values (B, H, N, D); every row's stored ones so far."""
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            shape = (keys.shape[0], keys.shape[1], (self.step + n - 1) // self.step * self.step)
            new_k = _packed(shape, keys.shape[3], keys.dtype, self.kv)
            new_v = _packed(shape, values.shape[3], values.dtype, self.kv)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                if prev % self.step:
                    self.keys, self.values = tree_map(lambda x: x[..., :prev, :], (self.keys, self.values))
                self.keys, self.values = tree_map(lambda x, y: mx.concatenate([x, y], axis=2),
                                                  (self.keys, self.values), (new_k, new_v))
        self.offset = self.offset + n
        self._idx += n
        for stored, new in ((self.keys, keys), (self.values, values)):
            for part, quantized in zip(stored, mx.quantize(new, group_size=self.group_size, bits=self.bits),
                                       strict=True):
                part[..., prev:self._idx, :] = quantized
        return self.keys_and_values()

    def keys_and_values(self):
        """The stored keys and values, as quantized triples."""
        return tree_map(lambda x: x[..., :self._idx, :], (self.keys, self.values))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a pass of right-padded inputs (as BatchKVCache.prepare)."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty batch cache")
            left_padding = mx.array(left_padding)
            self.left_padding += left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """After that pass: the right padding rolled to the front, where the mask hides it."""
        if self._right_padding is None:
            return
        padding = self._right_padding
        self.keys, self.values = tree_map(lambda x: dynamic_roll(x, padding[:, None], axis=2),
                                          (self.keys, self.values))
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = None

    @property
    def state(self):
        """What evaluating the cache evaluates (and what saving it saves)."""
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        """It can drop its last tokens."""
        return True

    def trim(self, n: int) -> int:
        """Drop the last `n` tokens of every row; how many were dropped."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """The attention mask of `N` new tokens: causal, each row's padding hidden."""
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices) -> None:
        """Keep these rows only (in place), dropping the padding that every one of them has."""
        if self.keys is not None:
            self.keys, self.values = tree_map(lambda x: x[batch_indices], (self.keys, self.values))
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys, self.values = tree_map(lambda x: x[..., shift:, :], (self.keys, self.values))
            self._idx -= shift
            self.left_padding -= shift

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Add another batch cache's rows after these (in place), both aligned on the right."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        longest = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)
        model = self if self.keys is not None else other

        def aligned(c: BatchQuantizedKVCache):
            keys, values = c.keys, c.values
            if keys is None:  # rows with nothing stored yet: empty storage of the same shapes
                rows = c.offset.shape[0]
                keys, values = tree_map(lambda x: mx.zeros((rows, x.shape[1], 0, x.shape[3]), x.dtype),
                                        (model.keys, model.values))
            left = longest - c._idx
            right = size - keys[0].shape[2] - left
            if right < 0:
                keys, values = tree_map(lambda x: x[..., :right, :], (keys, values))
                right = 0
            if left or right:
                keys, values = tree_map(lambda x: mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)]), (keys, values))
            return keys, values, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset, self.left_padding = mx.concatenate([o1, o2]), mx.concatenate([p1, p2])
        self._idx = longest

    def extract(self, idx: int) -> QuantizedCache:
        """Row `idx` as one sequence's cache of its own."""
        return self.row(idx, self.left_padding.tolist()[idx], self._idx)

    def row(self, idx: int, start: int, end: int) -> QuantizedCache:
        """Row `idx`, from `start` to `end`, as one sequence's cache of its own (a lazy copy)."""
        cache = QuantizedCache(group_size=self.group_size, bits=self.bits)
        cache.keys, cache.values = tree_map(lambda x: mx.contiguous(x[idx:idx + 1, :, start:end]),
                                            (self.keys, self.values))
        cache.offset = end - start
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedCache]) -> BatchQuantizedKVCache:
        """One batch cache of these sequences' caches, aligned on the right (left padding)."""
        kv = KVQuant(caches[0].bits, caches[0].group_size)
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        batch = cls(padding, kv.group_size, kv.bits)
        filled = [c for c in caches if c.keys is not None and c.offset]
        if not filled:
            return batch
        first = filled[0]
        shape = (len(caches), first.keys[0].shape[1], longest)
        keys = _packed(shape, _dims(first.keys, kv), first.keys[1].dtype, kv)
        values = _packed(shape, _dims(first.values, kv), first.values[1].dtype, kv)
        for i, (pad, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None or not c.offset:
                continue
            for stored, theirs in ((keys, c.keys), (values, c.values)):
                for part, their in zip(stored, theirs, strict=True):
                    part[i:i + 1, :, pad:pad + c.offset] = their[..., :c.offset, :]
        batch.keys, batch.values = keys, values
        batch.offset += longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        """Positions stored (the longest row's tokens and the padding of the others)."""
        return self._idx

    def empty(self) -> bool:
        """Whether nothing is stored yet."""
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of its quantized storage."""
        if self.keys is None:
            return 0
        return tree_reduce(lambda total, x: total + x.nbytes, (self.keys, self.values), 0)


def make_cache(model, kv: KVQuant | None) -> list:
    """A fresh cache for `model`: its own kinds, with each plain KV layer quantized when `kv` says so
    (sliding-window and recurrent layers stay as they are)."""
    cache = make_prompt_cache(model)
    if kv is None:
        return cache
    return [QuantizedCache(group_size=kv.group_size, bits=kv.bits) if type(c) is KVCache else c for c in cache]


def head_dims(model) -> int | None:
    """The model's attention head size, from its config (None where it does not say)."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 0) or 0
    return getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else None)


def for_model(model, model_dir, settings) -> KVQuant | None:
    """The KV quantization a resident model's caches get (jobs.kv_quant.for_model), checked against its head
    size: a JobError naming the setting when it is bad, never a silent fallback to unquantized caches."""
    from jobs import kv_quant

    try:
        kv = kv_quant.for_model(model_dir, settings)
    except ValueError as exc:
        raise JobError(f"bad KV quantization setting: {exc}", code="invalid_model_settings") from None
    dims = head_dims(model)
    if kv is not None and dims and dims % kv.group_size:
        raise JobError(f"bad KV quantization setting: the model's attention heads have {dims} elements, which "
                       f"groups of {kv.group_size} do not divide (MLXQ_KV_GROUP_SIZE or its mlxq.json's "
                       "kv_group_size)", code="invalid_model_settings")
    return kv
