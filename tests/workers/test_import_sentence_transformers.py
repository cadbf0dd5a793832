"""Importing a sentence-transformers folder, or a zip of one, as an embedding model (pure file work: the importer
never loads the weights, so small stand-ins do here; the real model's import runs in pull-demo)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from jobs.settings import load_settings
from workers.importers.errors import ConversionError, UnsupportedModel
from workers.store_admin import converter_for, import_into_store

CONFIG = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 384, "num_hidden_layers": 6,
          "num_attention_heads": 12, "intermediate_size": 1536, "max_position_embeddings": 512, "vocab_size": 30522}
FILES = {
    "config.json": json.dumps(CONFIG),
    "model.safetensors": "weights",
    "tokenizer.json": "{}",
    "modules.json": json.dumps([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                                {"idx": 1, "name": "1", "path": "1_Pooling",
                                 "type": "sentence_transformers.models.Pooling"}]),
    "sentence_bert_config.json": json.dumps({"max_seq_length": 128}),
    "1_Pooling/config.json": json.dumps({"word_embedding_dimension": 384, "pooling_mode_cls_token": True}),
    "pytorch_model.bin": "not read",
    "onnx/model.onnx": "left behind",
}


def write_folder(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def write_zip(path: Path, files: dict, folder: str = "") -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(folder + name, text)
    return path


def store(tmp_path):
    return load_settings({"models_dir": tmp_path / "store"})


@pytest.mark.parametrize("form", ["folder", "zip", "zip in a folder"])
def test_the_files_a_worker_needs_are_copied_and_the_rest_left_behind(tmp_path, form):
    if form == "folder":
        src = write_folder(tmp_path / "src", FILES)
    else:
        src = write_zip(tmp_path / "m.zip", FILES, "all-MiniLM/" if form == "zip in a folder" else "")
    info = import_into_store(store(tmp_path), "mini", converter_for("sentence-transformers"), src)
    kept = sorted(p.relative_to(info.path).as_posix() for p in info.path.rglob("*") if p.is_file())
    assert kept == ["1_Pooling/config.json", "config.json", "mlxq.json", "model.safetensors", "modules.json",
                    "sentence_bert_config.json", "tokenizer.json"]
    assert (info.kind, info.context_length, info.dimensions) == ("embedding", 128, 384)


@pytest.mark.parametrize("change, error", [
    ({"config.json": json.dumps({**CONFIG, "model_type": "llama"})}, UnsupportedModel),
    ({"model.safetensors": None}, UnsupportedModel),
    ({"tokenizer.json": None}, UnsupportedModel),
    ({"config.json": None}, ConversionError),
])
def test_what_cannot_be_served_is_refused_and_nothing_is_left(tmp_path, change, error):
    files = {k: v for k, v in {**FILES, **change}.items() if v is not None}
    with pytest.raises(error):
        import_into_store(store(tmp_path), "mini", converter_for("sentence-transformers"),
                          write_zip(tmp_path / "m.zip", files))
    assert not [p for p in (tmp_path / "store").iterdir() if p.name != "aliases.json"]


def test_a_zip_member_outside_the_model_folder_is_never_written(tmp_path):
    src = write_zip(tmp_path / "m.zip", {**FILES, "../escaped.json": "{}", "1_Pooling/../../up.json": "{}"})
    info = import_into_store(store(tmp_path), "mini", converter_for("sentence-transformers"), src)
    assert not (tmp_path / "escaped.json").exists() and not (tmp_path / "store" / "up.json").exists()
    assert not list(info.path.parent.glob("*.json"))
