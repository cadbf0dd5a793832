"""KV-cache quantization settings: the worker's (MLXQ_KV_BITS, MLXQ_KV_GROUP_SIZE) and a model's own (its
store entry's `mlxq.json`), checked, so that a bad value is an error and never a silent fallback.

Pure settings logic (no MLX): the worker turns a `KVQuant` into quantized caches
(workers/backends/quantized_kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from jobs.model_files import read_json

BITS = (4, 8)
"""Bits a quantized KV cache may store per element (0 turns quantization off)."""

GROUP_SIZES = (32, 64, 128)
"""Elements that share one scale and bias: the group sizes MLX's quantization takes."""

MANIFEST = "mlxq.json"
"""The store entry's file a model's own KV settings are read from (jobs/store.py's STORE_MANIFEST)."""


@dataclass(frozen=True)
class KVQuant:
    """How a model's KV caches are quantized: `bits` per element, one scale and bias per `group_size`."""

    bits: int
    group_size: int = 64

    def __str__(self) -> str:
        return f"{self.bits}-bit KV (groups of {self.group_size})"


def check(bits, group_size, where: str) -> KVQuant | None:
    """A KVQuant for these values (None: bits 0, quantization off); ValueError naming `where` otherwise."""
    if isinstance(bits, bool) or not isinstance(bits, int) or (bits and bits not in BITS):
        raise ValueError(f"{where}: KV bits must be one of {', '.join(map(str, BITS))} or 0 (off), not {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size not in GROUP_SIZES:
        raise ValueError(f"{where}: the KV group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                         f"not {group_size!r}")
    return KVQuant(bits, group_size) if bits else None


def of_settings(settings) -> KVQuant | None:
    """The worker's own KV quantization (MLXQ_KV_BITS, MLXQ_KV_GROUP_SIZE); ValueError on a bad value."""
    return check(settings.kv_bits, settings.kv_group_size, "MLXQ_KV_BITS / MLXQ_KV_GROUP_SIZE")


def for_model(model_dir: Path | str, settings) -> KVQuant | None:
    """The KV quantization of one model: its `mlxq.json`'s `kv_bits` / `kv_group_size` where it sets them
    (`"kv_bits": 0` turns it off for that model), else the worker's; ValueError on a bad value of either."""
    worker = of_settings(settings)
    manifest = read_json(Path(model_dir) / MANIFEST) or {}
    if "kv_bits" not in manifest and "kv_group_size" not in manifest:
        return worker
    bits = manifest.get("kv_bits", worker.bits if worker else 0)
    group_size = manifest.get("kv_group_size", settings.kv_group_size)
    return check(bits, group_size, str(Path(model_dir) / MANIFEST))
