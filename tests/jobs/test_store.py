"""The model catalog: reference resolution (alias, store name, directory, HF cache) and listing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs.settings import load_settings
from jobs.store import ModelNotFound, detect_kind, list_models, resolve

REPO = Path(__file__).resolve().parents[2]
LLAMA_CONFIG = {"model_type": "llama", "max_position_embeddings": 8192, "hidden_size": 64,
                "quantization": {"bits": 4, "group_size": 32}}
WHISPER_CONFIG = {"model_type": "whisper", "n_mels": 80, "n_audio_ctx": 1500, "n_text_ctx": 448}
VLM_CONFIG = {"model_type": "qwen2_vl", "vision_config": {"depth": 2},
              "text_config": {"max_position_embeddings": 32768}}


def safetensors_bytes() -> bytes:
    """A valid, empty safetensors file (header length, then a JSON header with metadata only)."""
    header = json.dumps({"__metadata__": {"format": "mlx"}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_model_dir(path: Path, config: dict, weights: bool = True) -> Path:
    """An MLX-style model directory: config.json and (optionally) a weights file."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if weights:
        (path / "model.safetensors").write_bytes(safetensors_bytes())
    return path


def write_store_entry(models_dir: Path, name: str, config: dict, **manifest) -> Path:
    """A store entry as store_admin writes it: model files plus mlxq.json."""
    path = write_model_dir(models_dir / name, config)
    record = {"name": name, "kind": detect_kind(config), "source": f"gguf:/src/{name}.gguf",
              "source_sha256": "0" * 64, "license": "Apache-2.0", "quantization": "Q4_1",
              "context_length": 2048, "architecture": "llama", "imported_at": "2024-05-01T12:00:00Z",
              "mlxq_version": "0.1.0", **manifest}
    (path / "mlxq.json").write_text(json.dumps(record))
    return path


def write_hf_snapshot(cache: Path, repo_id: str, revision: str, config: dict, mtime: float,
                      weights: bool = True, ref: str | None = "main") -> Path:
    """One revision in the HF cache layout: blobs/<hash>, snapshots/<rev>/<file> -> blob, refs/<ref>."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_dir / "blobs").mkdir(exist_ok=True)
    files = {"config.json": json.dumps(config).encode()}
    if weights:
        files["model.safetensors"] = safetensors_bytes()
    for name, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data + revision.encode()).hexdigest()
        blob.write_bytes(data)
        os.utime(blob, (mtime, mtime))
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    if ref:
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / ref).write_text(revision)
    return snapshot


@pytest.fixture()
def hf_cache(tmp_path, monkeypatch):
    """A private, empty HF hub cache (HF_HUB_CACHE), so the user's real cache never leaks in."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture()
def store_settings(tmp_path, hf_cache):
    """Settings whose model store is a fresh temporary directory."""
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    return load_settings({"models_dir": models_dir, "default_model": "smollm"})


def test_resolves_a_store_name_from_its_manifest(store_settings):
    path = write_store_entry(store_settings.models_dir, "smollm", LLAMA_CONFIG)
    info = resolve("smollm", store_settings)
    assert info.id == "smollm" and info.path == path and info.kind == "text"
    assert info.context_length == 2048  # mlxq.json wins over config.json
    assert info.quantization == "Q4_1" and info.license == "Apache-2.0"
    assert info.source == "gguf:/src/smollm.gguf"
    assert info.created == 1714564800
    assert info.size_bytes == sum(p.stat().st_size for p in path.iterdir())


def test_none_resolves_to_the_default_model(store_settings):
    write_store_entry(store_settings.models_dir, "smollm", LLAMA_CONFIG)
    assert resolve(None, store_settings).id == "smollm"


def test_an_alias_resolves_to_its_target_under_its_own_name(store_settings):
    path = write_store_entry(store_settings.models_dir, "smollm", LLAMA_CONFIG)
    aliases = {"chat": "fast", "fast": "smollm", "loop-a": "loop-b", "loop-b": "loop-a"}
    (store_settings.models_dir / "aliases.json").write_text(json.dumps(aliases))
    info = resolve("chat", store_settings)
    assert info.id == "chat" and info.path == path and info.kind == "text"
    with pytest.raises(ModelNotFound) as excinfo:
        resolve("loop-a", store_settings)
    assert "loop-a" in str(excinfo.value)


def test_a_directory_path_resolves_with_kind_and_context_from_config(store_settings, tmp_path, monkeypatch):
    whisper = write_model_dir(tmp_path / "dirs" / "whisper", WHISPER_CONFIG)
    vlm = write_model_dir(tmp_path / "dirs" / "vlm", VLM_CONFIG)
    info = resolve(str(whisper), store_settings)
    assert (info.kind, info.context_length, info.source) == ("speech", 448, f"dir:{whisper}")
    monkeypatch.chdir(tmp_path / "dirs")
    info = resolve("./vlm", store_settings)
    assert (info.kind, info.context_length, info.path) == ("vision", 32768, vlm)


def test_a_resolution_follows_every_change_to_what_it_read(store_settings, tmp_path):
    models_dir = store_settings.models_dir
    write_store_entry(models_dir, "smollm", LLAMA_CONFIG)
    other = write_store_entry(models_dir, "other-model", LLAMA_CONFIG)
    (models_dir / "aliases.json").write_text(json.dumps({"chat": "smollm"}))
    assert resolve("chat", store_settings).path == models_dir / "smollm"
    (models_dir / "aliases.json").write_text(json.dumps({"chat": "other-model"}))  # another size
    assert resolve("chat", store_settings).path == other
    (other / "mlxq.json").write_text(json.dumps({"kind": "speech", "source": "dir:elsewhere"}))
    assert resolve("chat", store_settings).kind == "speech"
    shutil.rmtree(other)
    with pytest.raises(ModelNotFound):
        resolve("chat", store_settings)
    one = write_model_dir(tmp_path / "dirs" / "one", LLAMA_CONFIG)
    two = write_model_dir(tmp_path / "dirs" / "two", WHISPER_CONFIG)
    link = tmp_path / "current"
    link.symlink_to(one)
    assert resolve(str(link), store_settings).path == one
    link.unlink()
    link.symlink_to(two)
    assert resolve(str(link), store_settings).path == two


def test_kind_detection():
    assert detect_kind({"n_mels": 128}) == "speech"
    assert detect_kind({"model_type": "whisper"}) == "speech"
    assert detect_kind({"vision_config": {}}) == "vision"
    assert detect_kind(LLAMA_CONFIG) == "text"


def test_an_hf_repo_id_resolves_to_the_newest_cached_snapshot(store_settings, hf_cache):
    old = time.time() - 3600
    write_hf_snapshot(hf_cache, "mlx-community/tiny-llama", "a" * 40, LLAMA_CONFIG, old, ref=None)
    newest = write_hf_snapshot(hf_cache, "mlx-community/tiny-llama", "b" * 40,
                               {**LLAMA_CONFIG, "max_position_embeddings": 4096}, old + 60)
    info = resolve("mlx-community/tiny-llama", store_settings)
    assert info.path == newest and info.source == "hf:mlx-community/tiny-llama"
    assert (info.kind, info.context_length, info.quantization) == ("text", 4096, "4bit-g32")
    assert info.created == int(old + 60)


def test_model_not_found_names_the_reference_and_every_place_looked(store_settings, hf_cache):
    with pytest.raises(ModelNotFound) as excinfo:
        resolve("someone/missing-model", store_settings)
    message = str(excinfo.value)
    assert "someone/missing-model" in message
    assert str(store_settings.models_dir / "aliases.json") in message
    assert str(hf_cache) in message
    with pytest.raises(ModelNotFound) as excinfo:
        resolve("nope", store_settings)
    assert str(store_settings.models_dir / "nope" / "mlxq.json") in str(excinfo.value)
    assert isinstance(excinfo.value, LookupError)


def test_list_models_shows_store_aliases_and_hf_models_only(store_settings, hf_cache):
    models_dir = store_settings.models_dir
    write_store_entry(models_dir, "smollm", LLAMA_CONFIG)
    write_store_entry(models_dir, "whisper", WHISPER_CONFIG)
    write_store_entry(models_dir, ".tmp-half-x1y2", LLAMA_CONFIG)  # an import in progress
    write_model_dir(models_dir / "stray", LLAMA_CONFIG)  # no mlxq.json: not a store entry
    (models_dir / "aliases.json").write_text(json.dumps({"chat": "smollm", "gone": "deleted-model"}))
    write_hf_snapshot(hf_cache, "mlx-community/whisper-tiny", "c" * 40, WHISPER_CONFIG, time.time())
    write_hf_snapshot(hf_cache, "someone/config-only", "d" * 40, LLAMA_CONFIG, time.time(), weights=False)
    listed = {m.id: m for m in list_models(store_settings)}
    assert sorted(listed) == ["chat", "mlx-community/whisper-tiny", "smollm", "whisper"]
    assert listed["chat"].path == listed["smollm"].path
    assert listed["mlx-community/whisper-tiny"].kind == "speech"
    assert listed["whisper"].kind == "speech"


def test_list_models_sees_a_download_that_lands_after_a_listing(store_settings, hf_cache):
    assert list_models(store_settings) == []
    write_hf_snapshot(hf_cache, "mlx-community/late", "e" * 40, LLAMA_CONFIG, time.time())
    assert [m.id for m in list_models(store_settings)] == ["mlx-community/late"]
    write_store_entry(store_settings.models_dir, "later", LLAMA_CONFIG)
    assert [m.id for m in list_models(store_settings)] == ["later", "mlx-community/late"]


def test_list_models_is_fast_with_many_entries(store_settings, hf_cache):
    for i in range(50):
        write_store_entry(store_settings.models_dir, f"model-{i:02d}", LLAMA_CONFIG)
        write_hf_snapshot(hf_cache, f"owner/repo-{i:02d}", f"{i:040x}", LLAMA_CONFIG, time.time())
    assert len(list_models(store_settings)) == 100
    start = time.perf_counter()
    for _ in range(10):
        list_models(store_settings)
    assert (time.perf_counter() - start) / 10 < 0.1


def test_the_catalog_never_imports_mlx(tmp_path):
    code = ("import sys; from pathlib import Path; import jobs.store as s; from jobs.settings import load_settings;"
            f"s.list_models(load_settings({{'models_dir': Path({str(tmp_path)!r})}}));"
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'mlx_audio', 'mlx_vlm')];"
            "assert not loaded, loaded")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf")}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
