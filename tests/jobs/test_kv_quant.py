"""KV-cache quantization settings: the worker's and a model's own, and bad values refused by name."""

from __future__ import annotations

import json

import pytest

from jobs import kv_quant
from jobs.kv_quant import KVQuant
from jobs.settings import load_settings


def test_off_by_default_and_on_from_the_environment():
    assert kv_quant.of_settings(load_settings(environ={})) is None
    settings = load_settings(environ={"MLXQ_KV_BITS": "4", "MLXQ_KV_GROUP_SIZE": "32"})
    assert kv_quant.of_settings(settings) == KVQuant(4, 32)
    assert kv_quant.of_settings(load_settings(environ={"MLXQ_KV_BITS": "8"})) == KVQuant(8, 64)


@pytest.mark.parametrize("environ, said", [
    ({"MLXQ_KV_BITS": "5"}, "KV bits must be one of 4, 8 or 0"),
    ({"MLXQ_KV_BITS": "16"}, "not 16"),
    ({"MLXQ_KV_BITS": "8", "MLXQ_KV_GROUP_SIZE": "48"}, "group size must be one of 32, 64, 128"),
])
def test_a_bad_worker_value_is_an_error_naming_the_setting(environ, said):
    with pytest.raises(ValueError, match="MLXQ_KV_BITS") as caught:
        kv_quant.of_settings(load_settings(environ=environ))
    assert said in str(caught.value)


def test_a_value_that_is_not_a_number_is_said_plainly():
    with pytest.raises(ValueError, match=r"MLXQ_KV_BITS='eight' is not a number"):
        load_settings(environ={"MLXQ_KV_BITS": "eight"})


def manifest(tmp_path, **fields):
    (tmp_path / "mlxq.json").write_text(json.dumps({"name": "m", "kind": "text", **fields}))
    return tmp_path


def test_a_models_own_settings_come_before_the_workers(tmp_path):
    worker = load_settings(environ={"MLXQ_KV_BITS": "8"})
    off = load_settings(environ={})
    assert kv_quant.for_model(manifest(tmp_path), worker) == KVQuant(8, 64)  # it sets nothing: the worker's
    assert kv_quant.for_model(tmp_path / "no-such-entry", worker) == KVQuant(8, 64)  # a directory, an HF snapshot
    assert kv_quant.for_model(manifest(tmp_path, kv_bits=4), off) == KVQuant(4, 64)
    assert kv_quant.for_model(manifest(tmp_path, kv_bits=0), worker) is None  # off for this model
    assert kv_quant.for_model(manifest(tmp_path, kv_group_size=32), worker) == KVQuant(8, 32)
    assert kv_quant.for_model(manifest(tmp_path, kv_group_size=32), off) is None  # a group size alone: still off


@pytest.mark.parametrize("fields", [{"kv_bits": 3}, {"kv_bits": "8"}, {"kv_bits": True}, {"kv_group_size": 100}])
def test_a_bad_model_value_is_an_error_naming_its_file(tmp_path, fields):
    with pytest.raises(ValueError, match="mlxq.json"):
        kv_quant.for_model(manifest(tmp_path, **fields), load_settings(environ={}))
