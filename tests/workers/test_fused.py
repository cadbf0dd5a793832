"""Joined projections (workers/backends/fused.py) compute what mlx-lm's layers compute: the demo model quantized as
stored and in float32, decoding a batch, and with a LoRA adapter put on (which needs the layers as they were)."""

from __future__ import annotations

import pytest

from jobs.settings import load_settings
from jobs.store import resolve


@pytest.fixture(scope="module")
def demo_path(models_dir) -> str:
    return str(resolve("smollm2-135m", load_settings({"models_dir": models_dir})).path)


def decode(model, vocab: int, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of a few rows decoding together in the worker's DecodeBatch."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from jobs.contract import Sampling
    from workers.backends import sampling
    from workers.backends.decoding import DecodeBatch, Joining

    batch, keys = DecodeBatch(model, vocab, set()), [object() for _ in prompts]
    joining = []
    for key, ids in zip(keys, prompts, strict=True):
        cache = make_prompt_cache(model)
        model(mx.array(ids[:-1])[None], cache=cache)
        joining.append(Joining(key, cache, ids[:-1], ids[-1], steps + 2, sampling.row_for(Sampling(temperature=0.0), vocab)))
    batch.insert_many(joining)
    out = {id(k): [] for k in keys}
    for _ in range(steps):
        for token in batch.step():
            out[id(token.key)].append(token.token)
    return [out[id(k)] for k in keys]


@pytest.mark.parametrize("float32", [False, True], ids=["quantized", "float32"])
def test_joined_projections_compute_what_the_layers_did(demo_path, float32):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from workers.backends import fused, textgen

    model, tokenizer = textgen.load(demo_path, float32)
    vocab = textgen.output_size(model, tokenizer)
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "One, two, three,")]
    tokens = mx.array([prompts[0]])
    before, names = model(tokens), {k: v.shape for k, v in tree_flatten(model.parameters())}
    nbytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    alone = decode(model, vocab, prompts, 4)
    layers = len(model.model.layers)
    kind = type(model.model.layers[0].self_attn.q_proj)
    assert kind is (nn.Linear if float32 else nn.QuantizedLinear)
    assert fused.fuse_projections(model) == 2 * layers
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.k_proj, fused.Projection) and type(attention.q_proj.linear) is kind
    # The weights are in the tree once: q/k/v's joined under q_proj, nothing under k_proj and v_proj.
    joined = {k: v for k, v in tree_flatten(model.parameters())}
    assert sum(v.nbytes for v in joined.values()) == nbytes
    assert not any(".k_proj." in k or ".up_proj." in k for k in joined)
    assert mx.allclose(model(tokens), before, atol=1e-4).item()
    assert decode(model, vocab, prompts, 4) == alone
    fused.unfuse(model)
    assert {k: v.shape for k, v in tree_flatten(model.parameters())} == names
    assert mx.allclose(model(tokens), before, atol=1e-4).item()


def test_an_adapter_goes_on_a_model_whose_projections_are_joined(demo_path, pirate):
    import mlx.core as mx

    from workers import adapters
    from workers.backends import fused, textgen

    plain, _ = textgen.load(demo_path)
    joined, _ = adapters.share_copy(plain)  # the same weights, its own modules
    fused.fuse_projections(joined)
    tokens = mx.array([[1, 504, 3458, 314, 2]])
    on_plain = adapters.apply("pirate", plain, str(pirate.path))
    on_joined = adapters.apply("pirate", joined, str(pirate.path))
    assert on_joined.nbytes == on_plain.nbytes < 4 * 2**20  # its LoRA tensors only: the views are the base's weights
    assert mx.allclose(on_joined.model(tokens), on_plain.model(tokens), atol=1e-4).item()
    assert not mx.allclose(on_joined.model(tokens), joined(tokens), atol=1e-2).item()
    assert isinstance(joined.model.layers[0].self_attn.k_proj, fused.Projection)  # the base stays joined
