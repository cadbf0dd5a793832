"""The adapter store: config parsing, shape checks against the base model, import, list and remove (no mlx)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobs import adapters as catalog
from jobs.settings import load_settings
from workers.adapter_store import (
    AdapterConfig,
    AdapterError,
    base_shapes,
    check_shapes,
    fits_layer,
    import_adapter,
    parse_config,
    remove_adapter,
)

LAST = "model.layers.29"  # smollm2-135m has 30 blocks; hidden 576, 3 KV heads of 64, MLP 1536


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A float32 safetensors file of zeros with these tensors (as mlx_lm.lora saves an untrained adapter)."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def make_adapter(root: Path, shapes: dict[str, tuple[int, ...]], config: dict | None = None) -> Path:
    """An mlx_lm.lora output directory with these LoRA tensors."""
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / "adapters.safetensors", shapes)
    config = config or {"fine_tune_type": "lora", "num_layers": 1, "model": "smollm2-135m",
                        "lora_parameters": {"rank": 8, "scale": 20.0, "dropout": 0.0}}
    (root / "adapter_config.json").write_text(json.dumps(config))
    return root


FITS = {f"{LAST}.self_attn.q_proj.lora_a": (576, 8), f"{LAST}.self_attn.q_proj.lora_b": (8, 576),
        f"{LAST}.self_attn.k_proj.lora_a": (576, 8), f"{LAST}.self_attn.k_proj.lora_b": (8, 192),
        f"{LAST}.mlp.down_proj.lora_a": (1536, 8), f"{LAST}.mlp.down_proj.lora_b": (8, 576)}
# The same layers of a model twice as wide: an adapter trained for another base.
OTHER_BASE = {f"{LAST}.self_attn.q_proj.lora_a": (1152, 8), f"{LAST}.self_attn.q_proj.lora_b": (8, 1152)}


@pytest.fixture()
def store(models_dir, tmp_path):
    """Settings on the real model store (read only) and a temporary adapter store."""
    if not (models_dir / "smollm2-135m").exists():
        pytest.skip("demo model missing: run `mlxq models pull-demo`")
    return load_settings({"models_dir": models_dir, "adapters_dir": tmp_path / "adapters"})


def test_config_parsing():
    config = parse_config({"fine_tune_type": "dora", "num_layers": 16, "model": "org/base",
                           "lora_parameters": {"rank": 16, "scale": 10.0, "dropout": 0.05}})
    assert config == AdapterConfig("dora", 16, 16, 10.0, "org/base")
    assert parse_config({"num_layers": 4, "lora_parameters": {"rank": 8, "scale": 1}}).fine_tune_type == "lora"
    with pytest.raises(AdapterError, match="full fine-tune"):
        parse_config({"fine_tune_type": "full", "num_layers": 4})
    with pytest.raises(AdapterError, match="'alpha' is another framework's name"):
        parse_config({"num_layers": 4, "lora_parameters": {"rank": 8, "alpha": 16}})
    with pytest.raises(AdapterError, match="no 'lora_parameters'"):
        parse_config({"num_layers": 4})
    with pytest.raises(AdapterError, match="num_layers"):
        parse_config({"lora_parameters": {"rank": 8, "scale": 1}})
    with pytest.raises(AdapterError, match="at least 1"):
        parse_config({"num_layers": 4, "lora_parameters": {"rank": 0, "scale": 1}})


def test_layer_shapes():
    assert fits_layer((192, 576), (576, 8), (8, 192), 8)  # a linear layer: weight (out, in)
    assert fits_layer((49152, 576), (49152, 8), (8, 576), 8)  # an embedding: (count, dims)
    assert fits_layer((4, 1536, 576), (4, 8, 576), (4, 1536, 8), 8)  # experts: (experts, out, in)
    assert not fits_layer((192, 576), (576, 16), (16, 192), 8)  # another rank than the config's
    assert not fits_layer((192, 576), (1152, 8), (8, 192), 8)
    assert not fits_layer((4, 1536, 576), (4, 8, 1152), (4, 1536, 8), 8)


def test_shape_check_names_what_does_not_fit():
    config = AdapterConfig("lora", 1, 8, 20.0, None)
    base = {"m.q": (576, 576), "m.k": (192, 576)}
    assert check_shapes(config, {"m.q.lora_a": (576, 8), "m.q.lora_b": (8, 576)}, base) == []
    problems = check_shapes(config, {"m.k.lora_a": (576, 8), "m.k.lora_b": (8, 576), "m.v.lora_a": (576, 8),
                                     "m.v.lora_b": (8, 192), "m.q.lora_a": (576, 8), "m.q.weight": (576, 576)}, base)
    assert problems == ["m.q.weight: not a LoRA tensor (expected names ending in .lora_a or .lora_b)",
                        "m.k: lora_a [576, 8] and lora_b [8, 576] (rank 8) do not fit the base layer's weight [192, 576]",
                        "m.q: needs both lora_a and lora_b", "m.v: the base model has no such layer"]
    assert check_shapes(config, {}, base) == ["adapters.safetensors holds no LoRA tensors"]


def test_base_shapes_unpack_quantized_weights(store):
    shapes = base_shapes(store.models_dir / "smollm2-135m")  # Q4_1 layers, an 8-bit embedding
    assert shapes[f"{LAST}.self_attn.q_proj"] == (576, 576)
    assert shapes[f"{LAST}.self_attn.k_proj"] == (192, 576)
    assert shapes["model.embed_tokens"] == (49152, 576)


def test_import_list_remove(store, tmp_path):
    info = import_adapter(store, make_adapter(tmp_path / "my-adapter", FITS))
    assert (info.name, info.base, info.rank, info.num_layers) == ("my-adapter", "smollm2-135m", 8, 1)
    assert {p.name for p in info.path.iterdir()} == {"adapters.safetensors", "adapter_config.json",
                                                     "mlxq-adapter.json"}
    assert [a.name for a in catalog.list_adapters(store)] == ["my-adapter"]
    with pytest.raises(AdapterError, match="already exists"):
        import_adapter(store, tmp_path / "my-adapter")
    import_adapter(store, tmp_path / "my-adapter", force=True)
    remove_adapter(store, "my-adapter")
    assert catalog.list_adapters(store) == []
    with pytest.raises(catalog.AdapterNotFound):
        remove_adapter(store, "my-adapter")
    assert not [p for p in Path(store.adapters_dir).iterdir()]  # no temp directory left behind


def test_an_adapter_for_another_base_is_refused(store, tmp_path):
    with pytest.raises(AdapterError) as refused:
        import_adapter(store, make_adapter(tmp_path / "wide", OTHER_BASE))
    message = str(refused.value)
    assert "does not fit the base model 'smollm2-135m'" in message and "trained for another model" in message
    assert f"{LAST}.self_attn.q_proj: lora_a [1152, 8] and lora_b [8, 1152]" in message
    assert "[576, 576]" in message
    assert catalog.list_adapters(store) == []


def test_the_base_must_be_a_text_model_in_the_store(store, tmp_path):
    config = {"num_layers": 1, "model": "/nowhere/base", "lora_parameters": {"rank": 8, "scale": 20.0}}
    src = make_adapter(tmp_path / "a", FITS, config)
    with pytest.raises(AdapterError, match="'/nowhere/base' named by adapter_config.json .* not in the model store"):
        import_adapter(store, src)
    with pytest.raises(AdapterError, match="is a speech model"):
        import_adapter(store, src, base="whisper-tiny.en")
    assert import_adapter(store, src, base="smollm2-135m").base == "smollm2-135m"  # --base overrides the config
    with pytest.raises(AdapterError, match="has no adapter_config.json"):
        import_adapter(store, tmp_path)


def test_cli(store, tmp_path, monkeypatch):
    from mlxq.cli import main

    monkeypatch.setenv("MLXQ_MODELS_DIR", str(store.models_dir))
    monkeypatch.setenv("MLXQ_ADAPTERS_DIR", str(store.adapters_dir))
    runner = CliRunner()
    src = make_adapter(tmp_path / "src", FITS)
    done = runner.invoke(main, ["adapters", "import", str(src), "--name", "tiny"])
    assert done.exit_code == 0 and "imported tiny (LoRA rank 8 on 1 layers of smollm2-135m" in done.output
    listed = runner.invoke(main, ["adapters", "list", "--json"])
    assert [a["id"] for a in json.loads(listed.output)] == ["tiny"]
    bad = runner.invoke(main, ["adapters", "import", str(make_adapter(tmp_path / "wide", OTHER_BASE))])
    assert bad.exit_code == 1 and "error: this adapter does not fit the base model 'smollm2-135m'" in bad.output
    assert runner.invoke(main, ["adapters", "rm", "tiny"]).output == "removed tiny\n"
