"""Fewer, wider matrix products in a text model's layers: q/k/v in one, gate/up in one.

On a GPU a decode step is host-bound: the host queues each kernel of the pass (MLX on CUDA: ~15 µs each, a matrix
product more), and the device waits for it. mlx-lm's Llama-family layers make seven products each; with the
attention's three and the MLP's first two each done as one, four. `bench/device/fuse_probe.py` (H200, 2026-11-28,
the 1B shape in bf16, the worker's DecodeBatch, blocks of 30 steps alternating): 64 rows 5.63 → 4.73 ms a step,
8 rows 7.06 → 6.16 ms, the same tokens (the probe then joined the layers with code of its own: the same products
as here). On a CPU the products' arithmetic is the cost, so nothing is joined there; on Apple silicon (Metal)
nothing either until it is measured there (no Mac here).

The layer's code is left as it is: the group's first projection computes the whole product for its input and each
projection of the group (the first too) returns its columns of it; a projection called with another input
computes the product for that one. The group's weights are one array in the model's tree (under the first
projection's `linear`), so its memory is counted once; `unfuse` puts plain projections back (views of those
weights) where something needs the layers as mlx-lm made them (a LoRA adapter's layers).
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
"""Per layer: the module and its projections that take the same input, in the order the layer calls them."""

MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "smollm3"}
"""mlx-lm's model types whose layers call every projection of each group with the same input, every time (a layer
that skipped one, as models that share keys and values across layers do, would keep its group's last product)."""


class _Group:
    """The projections of one fused group: their joined linear layer, each one's columns, the last product.
    (A plain object: nothing in it is a parameter of the model twice.)"""

    def __init__(self, linear: nn.Module, bounds: list[tuple[int, int]]):
        self.linear, self.bounds = linear, bounds
        self.input: mx.array | None = None
        self.output: mx.array | None = None
        self.unread = 0

    def columns(self, x: mx.array, index: int) -> mx.array:
        """Projection `index` of `x`: its columns of the group's product, computed once for `x`."""
        if self.input is not x:
            self.input, self.output, self.unread = x, self.linear(x), len(self.bounds)
        start, end = self.bounds[index]
        out = self.output[..., start:end]
        self.unread -= 1
        if self.unread <= 0:  # every projection has its part: hold no array past the layer
            self.input = self.output = None
        return out


class Projection(nn.Module):
    """One projection of a fused group (the first holds the group's weights as `linear`)."""

    def __init__(self, group: _Group, index: int):
        super().__init__()
        if index == 0:
            self.linear = group.linear
        self._group, self._index = group, index

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.columns(x, self._index)


def _joinable(layers: list[nn.Module]) -> bool:
    """Whether these linear layers can be one: the same kind and settings, every array with the output axis first."""
    first = layers[0]
    if not isinstance(first, (nn.Linear, nn.QuantizedLinear)) or any(type(m) is not type(first) for m in layers):
        return False
    names = set(first.keys())
    if any(set(m.keys()) != names for m in layers) or not all(isinstance(first[k], mx.array) for k in names):
        return False
    settings = {k: v for k, v in vars(first).items() if not k.startswith("_")}
    return all({k: v for k, v in vars(m).items() if not k.startswith("_")} == settings for m in layers) and all(
        m[k].shape[1:] == first[k].shape[1:] for m in layers for k in names)


def fuse_projections(model) -> int:
    """Join each layer's q/k/v and gate/up projections (a model of MODEL_TYPES, where they are plain or quantized
    linear layers of one kind); the number of groups joined."""
    joined = 0
    if getattr(getattr(model, "args", None), "model_type", None) not in MODEL_TYPES:
        return joined
    for layer in getattr(getattr(model, "model", None), "layers", None) or []:
        for owner_name, names in GROUPS:
            owner = layer.get(owner_name) if isinstance(layer, nn.Module) else None
            if not isinstance(owner, nn.Module) or not all(isinstance(owner.get(n), nn.Module) for n in names):
                continue
            parts = [owner[n] for n in names]
            if not _joinable(parts):
                continue
            linear = copy.copy(parts[0])
            for key in parts[0].keys():
                linear[key] = mx.concatenate([p[key] for p in parts])
            mx.eval(linear.parameters())
            ends = [sum(p["weight"].shape[0] for p in parts[:i + 1]) for i in range(len(parts))]
            group = _Group(linear, [(ends[i - 1] if i else 0, end) for i, end in enumerate(ends)])
            for i, name in enumerate(names):
                owner[name] = Projection(group, i)
            joined += 1
    return joined


def unfuse(model) -> set[int]:
    """Put plain projections back in place of fused groups (each a view of its columns of the group's weights);
    the ids of those views (arrays the model already had, in memory)."""
    views: set[int] = set()
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            if isinstance(child, Projection):
                group, index = child._group, child._index
                start, end = group.bounds[index]
                plain = copy.copy(group.linear)
                for key in group.linear.keys():
                    plain[key] = group.linear[key][start:end]
                    views.add(id(plain[key]))
                module[name] = plain
    return views
