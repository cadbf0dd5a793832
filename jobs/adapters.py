"""The adapter catalog: the LoRA adapters in the adapter store, read from small JSON files only.

An adapter store entry is `<adapters_dir>/<name>/` holding an `mlx_lm.lora` output
(`adapters.safetensors`, `adapter_config.json`) and `mlxq-adapter.json`, written last by the import
(workers/adapter_store.py), which records the base model it was checked against. Imported by the web tier:
never imports mlx.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jobs.model_files import dir_size, parse_time, read_json
from jobs.store import NAME_RE, ModelInfo, ModelNotFound, resolve

ADAPTER_MANIFEST = "mlxq-adapter.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
NO_ADAPTER = "none"
"""What a request sends for "the base model alone" (the same as leaving `adapter` out)."""


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter a request can name."""

    name: str
    path: Path  # the store entry's directory
    base: str  # the store name of the model it adapts (checked at import)
    fine_tune_type: str  # "lora" or "dora"
    rank: int
    num_layers: int
    size_bytes: int
    created: int  # unix time of the import
    description: str | None = None

    def public(self) -> dict:
        """What clients and operators see: no server paths."""
        return {"id": self.name, "object": "adapter", "base_model": self.base, "fine_tune_type": self.fine_tune_type,
                "rank": self.rank, "num_layers": self.num_layers, "size_bytes": self.size_bytes,
                "created": self.created, "description": self.description}


class AdapterNotFound(LookupError):
    """An adapter name matched no store entry."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"adapter {name!r} not found in the adapter store")

    @property
    def public_message(self) -> str:
        """What an API client is told."""
        return (f"Adapter {self.name!r} not found: it is not in the server's adapter store. GET /v1/models lists "
                "each model's adapters; send \"none\" (or leave `adapter` out) for the model alone.")


def adapter_entry(settings, name: str) -> AdapterInfo | None:
    """The store entry `name` (a directory holding mlxq-adapter.json), or None."""
    if not NAME_RE.match(name or ""):
        return None
    path = Path(settings.adapters_dir) / name
    manifest_path = path / ADAPTER_MANIFEST
    manifest = read_json(manifest_path)
    if manifest is None or not isinstance(manifest.get("base"), str):
        return None
    try:
        mtime = manifest_path.stat().st_mtime
    except OSError:
        return None
    return AdapterInfo(name=name, path=path, base=manifest["base"],
                       fine_tune_type=str(manifest.get("fine_tune_type") or "lora"),
                       rank=int(manifest.get("rank") or 0), num_layers=int(manifest.get("num_layers") or 0),
                       size_bytes=dir_size(path), created=parse_time(manifest.get("imported_at"), mtime),
                       description=manifest.get("description"))


def adapter_names(settings) -> list[str]:
    """Names of the complete store entries, sorted (an import in progress is a hidden temp dir)."""
    try:
        entries = os.scandir(settings.adapters_dir)
    except OSError:
        return []
    with entries:
        return sorted(e.name for e in entries
                      if NAME_RE.match(e.name) and os.path.isfile(os.path.join(e.path, ADAPTER_MANIFEST)))


def list_adapters(settings) -> list[AdapterInfo]:
    """Every adapter in the store."""
    return [info for name in adapter_names(settings) if (info := adapter_entry(settings, name))]


def base_path(settings, info: AdapterInfo) -> Path | None:
    """The directory of the adapter's base model as the catalog resolves it now (None: no longer there)."""
    try:
        return Path(os.path.realpath(resolve(info.base, settings).path))
    except ModelNotFound:
        return None


def fits(settings, info: AdapterInfo, model: ModelInfo) -> bool:
    """Whether the adapter was made for `model`: its base resolves to the same model directory (an alias of
    the base fits; another model with the same shapes does not)."""
    base = base_path(settings, info)
    return base is not None and base == Path(os.path.realpath(model.path))


def adapters_by_model(settings) -> dict[Path, list[str]]:
    """The store's adapters by the directory of the model each was made for (read once for a list of models)."""
    found: dict[Path, list[str]] = {}
    for info in list_adapters(settings):
        base = base_path(settings, info)
        if base is not None:
            found.setdefault(base, []).append(info.name)
    return found


def adapters_of(model: ModelInfo, by_model: dict[Path, list[str]]) -> list[str]:
    """Names of the adapters made for `model`, from `adapters_by_model`."""
    return by_model.get(Path(os.path.realpath(model.path)), [])
