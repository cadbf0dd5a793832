"""A LoRA adapter applied to a resident model, without touching the model that requests on the base use.

The adapted model is a copy of the resident model's modules (Python objects only: a deep copy told to keep
every array as it is, so the base's weights are shared, not copied) into which mlx-lm's own
`load_adapters` puts its LoRA layers and the adapter's weights. What it costs is the adapter's tensors
(docs/models.md has the figures); the base model is never modified, so requests with and without the
adapter decode side by side, each in its own batch (workers/scheduler.py keys batches by model and adapter).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import load_adapters

from workers.backends import fused

log = logging.getLogger(__name__)


@dataclass
class Adapted:
    """An adapter applied to a resident model."""

    name: str
    model: Any
    nbytes: int  # what it adds to the base: the arrays it does not share with it
    load_s: float


def _arrays(tree, found: dict[int, mx.array]) -> dict[int, mx.array]:
    """Every mx.array in a module tree (parameters, and private arrays such as a RoPE's frequencies), by id."""
    if isinstance(tree, mx.array):
        found[id(tree)] = tree
    elif isinstance(tree, dict):
        for value in tree.values():
            _arrays(value, found)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _arrays(value, found)
    return found


def share_copy(model):
    """A copy of `model`'s modules that shares all of its arrays (deepcopy's memo maps each array to itself)."""
    arrays = _arrays(model, {})
    return copy.deepcopy(model, dict(arrays)), arrays


def apply(name: str, base_model, adapter_dir: str) -> Adapted:
    """The base model with adapter `adapter_dir` applied, as a model of its own; the base is left as it was.
    ValueError (mlx-lm's) when the adapter does not fit the model."""
    started = time.perf_counter()
    model, shared = share_copy(base_model)
    views = fused.unfuse(model)  # mlx-lm's LoRA layers go on its own projections (views of the joined weights)
    load_adapters(model, adapter_dir)  # mlx-lm's: its LoRA layers, its checks, the adapter's weights
    own = [v for _, v in tree_flatten(model.parameters()) if id(v) not in shared and id(v) not in views]
    mx.eval(own)
    adapted = Adapted(name, model, sum(v.nbytes for v in own), time.perf_counter() - started)
    log.info("applied adapter %s in %.3fs: %.2f MiB of its own", name, adapted.load_s, adapted.nbytes / 2**20)
    return adapted
