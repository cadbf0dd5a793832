"""Import a sentence-transformers model folder (or a zip of one) as an embedding model: its files as they are.

A sentence-transformers folder is already what mlx-embeddings loads: config.json, safetensors weights with the
encoder's own names, tokenizer.json, and the pipeline's modules (pooling, normalization) that
jobs.model_files.embedding_facts reads. So the import checks it and copies the files a worker needs, nothing else
(no PyTorch .bin, ONNX or OpenVINO copies, which such folders often carry too).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path, PurePosixPath

from jobs.model_files import ENCODER_MODEL_TYPES, embedding_facts
from workers.importers.errors import ConversionError, UnsupportedModel

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
         "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "README.md", "LICENSE")
"""The top-level files kept besides the weights (those present), and the module folders modules.json names."""


def convert_sentence_transformers(src: Path, out_dir: Path) -> dict:
    """Copy the model in `src` (a folder, or a .zip holding one) into out_dir; the facts for its manifest."""
    src = Path(src)
    if src.is_file():
        if not zipfile.is_zipfile(src):
            raise ConversionError(f"{src} is neither a sentence-transformers folder nor a zip of one")
        _copy_from_zip(src, out_dir)
    else:
        _copy_from_dir(src, out_dir)
    config = _read(out_dir / "config.json")
    if config.get("model_type") not in ENCODER_MODEL_TYPES:
        raise UnsupportedModel(f"config.json's model_type is {config.get('model_type')!r}; embedding models of types "
                               f"{', '.join(sorted(ENCODER_MODEL_TYPES))} can be imported")
    if not any(out_dir.glob("*.safetensors")):
        raise UnsupportedModel(f"{src} has no .safetensors weights (PyTorch .bin files are not read)")
    if not (out_dir / "tokenizer.json").is_file():
        raise UnsupportedModel(f"{src} has no tokenizer.json (a fast tokenizer's file)")
    facts = embedding_facts(out_dir, config)
    if facts is None:
        raise ConversionError("config.json declares no hidden_size")
    architectures = config.get("architectures") or [config["model_type"]]
    return {"kind": "embedding", "context_length": facts.max_tokens, "architecture": architectures[0]}


def _wanted(name: str, modules: list[str]) -> bool:
    """Whether a file (its path inside the model folder) is one the worker needs."""
    path = PurePosixPath(name)
    if len(path.parts) == 1:
        return name in FILES or name.endswith(".safetensors") or name == "model.safetensors.index.json"
    return len(path.parts) == 2 and path.parts[0] in modules and path.suffix == ".json"


def _module_dirs(modules_json: str | None) -> list[str]:
    """The folders of the pipeline's modules (1_Pooling, 2_Normalize...) that modules.json lists."""
    try:
        modules = json.loads(modules_json) if modules_json else []
    except ValueError:
        raise ConversionError("modules.json is not valid JSON") from None
    return [m["path"] for m in modules if isinstance(m, dict) and isinstance(m.get("path"), str) and m["path"]
            and "/" not in m["path"] and m["path"] not in (".", "..")] if isinstance(modules, list) else []


def _copy_from_dir(src: Path, out_dir: Path) -> None:
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src} has no config.json")
    modules_file = src / "modules.json"
    modules = _module_dirs(modules_file.read_text(encoding="utf-8") if modules_file.is_file() else None)
    for file in sorted(src.rglob("*")):
        name = file.relative_to(src).as_posix()
        if file.is_file() and not file.is_symlink() and _wanted(name, modules):
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, out_dir / name)


def _copy_from_zip(src: Path, out_dir: Path) -> None:
    """Copy the wanted members of a zip whose config.json sits at its root or in one folder."""
    with zipfile.ZipFile(src) as archive:
        names = archive.namelist()
        configs = sorted((n for n in names if PurePosixPath(n).name == "config.json"
                          and len(PurePosixPath(n).parts) <= 2), key=len)
        if not configs:
            raise ConversionError(f"{src} holds no config.json")
        root = str(PurePosixPath(configs[0]).parent)
        prefix = "" if root == "." else root + "/"
        modules_name = prefix + "modules.json"
        modules = _module_dirs(archive.read(modules_name).decode("utf-8") if modules_name in names else None)
        for name in names:
            inner = name[len(prefix):] if name.startswith(prefix) else None
            if not inner or name.endswith("/") or not _wanted(inner, modules):
                continue  # (only known names are written: nothing of the zip's can escape out_dir)
            dest = out_dir / inner
            dest.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as member, open(dest, "wb") as out:
                shutil.copyfileobj(member, out, 1 << 20)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConversionError(f"{path.name} could not be read: {exc}") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{path.name} is not a JSON object")
    return data
