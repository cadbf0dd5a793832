"""An adapter applied in the model manager: a model of its own sharing the base's weights, counted in the
budget, leaving the base untouched; not unmounted while in use (the demo adapter, in a temporary store)."""

from __future__ import annotations

import pytest

from jobs.contract import ModelRef
from jobs.errors import JobError
from jobs.settings import load_settings
from jobs.store import resolve


@pytest.fixture()
def demo_ref(models_dir) -> ModelRef:
    info = resolve("smollm2-135m", load_settings({"models_dir": models_dir}))
    return ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


def test_an_adapted_model_shares_the_base_and_leaves_it_alone(text_worker_parts, demo_ref, pirate):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    models = text_worker_parts[0]
    base = models.get(demo_ref)
    tokens = mx.array([[1, 504, 3458, 314, 2]])
    before = base.model(tokens)
    used = models.used_bytes()
    adapted = models.get(demo_ref, adapter=pirate)
    try:
        assert adapted.adapter == pirate.name and adapted.model is not base.model
        assert adapted.processor is base.processor and models.get(demo_ref, adapter=pirate) is adapted
        base_arrays = {id(v) for _, v in tree_flatten(base.model.parameters())}
        own = {k: v for k, v in tree_flatten(adapted.model.parameters()) if id(v) not in base_arrays}
        assert own and all(k.endswith((".lora_a", ".lora_b")) for k in own)  # every base weight is shared
        assert adapted.nbytes == sum(v.nbytes for v in own.values()) < 4 * 2**20
        assert models.used_bytes() == used + adapted.nbytes  # counted in the budget
        assert mx.array_equal(base.model(tokens), before)  # the base computes as before
        assert not mx.allclose(adapted.model(tokens), before)
        listed = next(m for m in models.snapshot if m["id"] == "smollm2-135m")["adapters"]
        assert [a["name"] for a in listed] == [pirate.name] and listed[0]["bytes"] == adapted.nbytes
    finally:
        keep = models.adapters_in_use
        models.adapters_in_use = lambda: {(demo_ref.path, pirate.name)}
        with pytest.raises(JobError) as busy:
            models.unmount(demo_ref.path, pirate.name)
        assert busy.value.status == 409 and busy.value.code == "adapter_in_use"
        models.adapters_in_use = keep
        assert models.unmount(demo_ref.path, pirate.name) is True
    assert models.used_bytes() == used and models.unmount(demo_ref.path, pirate.name) is False


def test_batches_and_kept_caches_are_keyed_by_adapter(demo_ref):
    from workers.models import batch_key

    assert batch_key(demo_ref.path) == demo_ref.path
    assert batch_key(demo_ref.path, "a") != batch_key(demo_ref.path, "b") != batch_key(demo_ref.path)
