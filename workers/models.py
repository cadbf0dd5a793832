"""The model manager: models loaded once, kept between requests, evicted least-recently-used within a
memory budget, loaded and unloaded explicitly too (the admin API will drive it through control jobs).
LoRA adapters are applied to resident models here too (workers/adapters.py: a model object of their own that
shares the base's weights): counted in the budget, kept while their base is resident, dropped with it.

Only the scheduler's thread (the worker's main thread, which owns MLX) touches it, so it needs no lock.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobs.errors import InvalidRequest, JobError, ModelTooLarge
from workers import memory
from workers.platform import PlatformInfo

log = logging.getLogger(__name__)

BUDGET_FRACTION = 0.7
"""Share of RAM (CPU) or of the GPU's recommended working set used when no budget is configured."""

Loader = Callable[[Path, bool], tuple[Any, Any]]
"""A backend's load function: (model directory, upcast to float32?) -> (model, tokenizer/processor)."""

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class Resident:
    """A loaded model and what it costs."""

    info: Any  # what was asked for: a jobs.contract.ModelRef (id, path, kind) or a jobs.store.ModelInfo
    model: Any
    processor: Any  # the tokenizer (text), processor (vision) or None
    nbytes: int
    float32: bool
    load_s: float
    adapter: str | None = None  # the LoRA adapter applied to `model` (its nbytes: the adapter's own arrays only)


def batch_key(path, adapter: str | None = None) -> str:
    """The key of a model's text batch and of its kept prompt caches: the model's directory, and the adapter
    applied, if any (requests with different adapters never share a batch or a cached prefix)."""
    return str(path) if adapter is None else f"{path}#adapter:{adapter}"


@dataclass(frozen=True)
class WeightStats:
    """Sizes read from safetensors headers, without loading any weight."""

    stored_bytes: int
    float32_bytes: int  # the size once dequantized/upcast to float32


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a .safetensors file (tensor name -> dtype, shape, offsets)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _quant_bits(quantization: dict, module: str) -> int | None:
    """Bits of a quantized module from config.json's quantization block (per-module overrides first)."""
    override = quantization.get(module)
    if isinstance(override, dict) and "bits" in override:
        return int(override["bits"])
    return int(quantization["bits"]) if "bits" in quantization else None


def _tensor_float32_bytes(name: str, meta: dict, names: set[str], quantization: dict) -> int:
    """The float32 size of one tensor; quantization scales/biases vanish once dequantized."""
    module, _, leaf = name.rpartition(".")
    quantized = f"{module}.scales" in names
    if quantized and leaf in ("scales", "biases"):
        return 0
    elements = math.prod(meta["shape"])
    bits = _quant_bits(quantization, module) if quantized and meta["dtype"] == "U32" else None
    return elements * (32 // bits if bits else 1) * 4


def weight_stats(model_dir: Path) -> WeightStats:
    """Stored and float32 sizes of the model's weights (plain file sizes when headers can't be read)."""
    config = _read_config(model_dir)
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    stored = f32 = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        header = {k: v for k, v in read_safetensors_header(file).items() if k != "__metadata__"}
        names = set(header)
        stored += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
        f32 += sum(_tensor_float32_bytes(k, v, names, quantization) for k, v in header.items())
    if stored == 0:  # npz or unknown format: assume the files are the weights
        stored = f32 = sum(p.stat().st_size for p in Path(model_dir).glob("*.npz"))
    return WeightStats(stored, f32)


def _read_config(model_dir: Path) -> dict:
    """config.json of a model directory (empty when missing)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def total_memory_bytes(device: str) -> int:
    """Memory models may use: the GPU's recommended working set, else physical RAM."""
    if device in ("metal", "cuda"):
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        for key in ("max_recommended_working_set_size", "total_memory", "memory_size"):
            if isinstance(info.get(key), int) and info[key] > 0:
                return info[key]
    return physical_ram_bytes()


def physical_ram_bytes() -> int:
    """Physical RAM from /proc/meminfo (Linux), else sysconf."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget_bytes(memory_budget_mb: int, device: str) -> int:
    """settings.memory_budget_mb in bytes, or 70% of the device's memory when it is 0."""
    if memory_budget_mb > 0:
        return memory_budget_mb * 2**20
    return int(total_memory_bytes(device) * BUDGET_FRACTION)


def params_nbytes(model) -> int:
    """Bytes held by a loaded model's parameters."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


class ModelManager:
    """Resident models within a byte budget (LRU eviction); one loader per model kind.

    The budget holds the models, the KV caches (workers/backends/textbatch.py takes what is left) and MLX's
    buffer cache, whose limit (`cache_bytes`) is set aside from the start: freed buffers may fill it at any time.
    """

    def __init__(self, budget_bytes: int, platform: PlatformInfo, loaders: dict[str, Loader],
                 on_load: Callable[[Resident], None] | None = None, cache_bytes: int = 0):
        self.budget_bytes = budget_bytes
        self.cache_bytes = cache_bytes
        self.platform = platform
        self.loaders = loaders
        self.on_load = on_load or (lambda resident: None)  # the worker records a metric
        self._models: OrderedDict[str, Resident] = OrderedDict()  # least recently used first
        self.pinned: set[str] = set()  # directories an operator pinned: never evicted
        self.in_use: Callable[[], set[str]] = set  # directories requests are using now (the scheduler's)
        self.adapters_in_use: Callable[[], set[tuple[str, str]]] = set  # (directory, adapter) of running requests
        self._adapted: dict[tuple[str, str], Resident] = {}  # (base directory, adapter name): the adapted models
        self.ttl_s = -1.0  # how long an idle model stays (MLXQ_MODEL_TTL_S; -1: until evicted)
        self._keep_s: dict[str, float] = {}  # a model's own, from its latest request's keep_alive
        self._last_used: dict[str, float] = {}  # when a request last used each resident model (monotonic)
        self.snapshot: list[dict] = []  # list(), rebuilt on every change: what other threads may read

    def get(self, info, pinned: frozenset | set = frozenset(), adapter=None) -> Resident:
        """Return the model resident, loading it (and evicting others, never a `pinned` one) if needed; with an
        `adapter` (a jobs.contract.AdapterRef), the model with that adapter applied.

        `pinned`: the directories of models in use (a batch decoding on them).
        """
        key = str(Path(info.path).resolve())
        self._last_used[key] = time.monotonic()
        if key in self._models:
            self._models.move_to_end(key)
            resident = self._models[key]
        else:
            resident = self._load(info, {str(Path(p).resolve()) for p in pinned} | self.pinned)
            self._models[key] = resident
            self._changed()
            self.on_load(resident)
        return resident if adapter is None else self._adapted_model(key, resident, adapter, pinned)

    def _adapted_model(self, key: str, resident: Resident, adapter, pinned) -> Resident:
        """The resident model with `adapter` applied, applying it now (making room for it) if it is not yet."""
        if (key, adapter.name) in self._adapted:
            return self._adapted[(key, adapter.name)]
        weights = Path(adapter.path) / "adapters.safetensors"
        if not weights.is_file():  # removed from the store since the request was made
            raise JobError(f"Adapter {adapter.name!r} is not in the server's adapter store any more.", status=404,
                           code="adapter_not_found", param="adapter")
        self._make_room(weights.stat().st_size, {str(Path(p).resolve()) for p in pinned} | self.pinned | {key})
        from workers.adapters import apply

        try:
            adapted = apply(adapter.name, resident.model, adapter.path)
        except (ValueError, KeyError) as exc:  # mlx-lm's checks: checked at import, so the store was edited since
            raise JobError(f"Adapter {adapter.name!r} does not fit model {resident.info.id!r}: {exc}", status=400,
                           code="invalid_adapter", param="adapter") from None
        entry = Resident(resident.info, adapted.model, resident.processor, adapted.nbytes, resident.float32,
                         adapted.load_s, adapter=adapter.name)
        self._adapted[(key, adapter.name)] = entry
        self._changed()
        return entry

    def mount(self, info, adapter) -> bool:
        """Apply an adapter to its base model now (loading the model if needed); True if it was not applied."""
        was = (str(Path(info.path).resolve()), adapter.name) in self._adapted
        self.get(info, adapter=adapter)
        return not was

    def unmount(self, model_path: str | Path, name: str) -> bool:
        """Drop an adapter applied to a model; True if it was applied. One that requests are using now stays
        (JobError 409)."""
        key = str(Path(model_path).resolve())
        if (key, name) in {(str(Path(p).resolve()), n) for p, n in self.adapters_in_use()}:
            raise JobError(f"adapter {name!r} is in use by requests running now; unmount it when they are done",
                           status=409, code="adapter_in_use", param="adapter")
        dropped = self._adapted.pop((key, name), None)
        self._changed()
        if dropped is None:
            return False
        del dropped
        _free_memory()
        return True

    def _drop_adapters(self, key: str) -> None:
        """Forget the adapters applied to a model that leaves (they hold its weights)."""
        for pair in [pair for pair in self._adapted if pair[0] == key]:
            del self._adapted[pair]

    def load(self, info) -> Resident:
        """Load a model now (or keep it resident), evicting others as the budget needs."""
        return self.get(info)

    def plan(self, info) -> tuple[int, bool]:
        """(estimated resident bytes, float32?) for a model, from its files only."""
        stats = weight_stats(info.path)
        # float32 is a speed choice only: never let it turn a model that fits into one that does not.
        float32 = self.platform.use_float32(stats.float32_bytes) and stats.float32_bytes <= self.capacity_bytes
        return (stats.float32_bytes if float32 else stats.stored_bytes), float32

    def _load(self, info, pinned: set[str]) -> Resident:
        """Admit, make room for and load a model; log how long it took."""
        loader = self.loaders.get(info.kind)
        if loader is None:
            raise InvalidRequest(f"this worker serves no {info.kind} models", code="invalid_model", param="model")
        if not (Path(info.path) / "config.json").is_file():  # removed from the store since it was resolved
            raise JobError(f"Model {info.id!r} is not in the server's store any more.", status=404,
                           code="model_not_found", param="model")
        needed, float32 = self.plan(info)
        if needed > self.capacity_bytes:
            raise ModelTooLarge(f"model {info.id!r} needs about {needed / 2**20:.0f} MiB but the worker's "
                                f"memory budget is {self.budget_bytes / 2**20:.0f} MiB, "
                                f"{self.cache_bytes / 2**20:.0f} MiB of it for MLX's buffer cache")
        self._make_room(needed, pinned)
        start = time.perf_counter()
        model, processor = loader(Path(info.path), float32)
        resident = Resident(info, model, processor, params_nbytes(model), float32, time.perf_counter() - start)
        memory.freeze_heap()  # the model's objects out of the cycle collector's full collections
        log.info("loaded %s (%s) in %.2fs: %.0f MiB%s", info.id, info.path, resident.load_s,
                 resident.nbytes / 2**20, ", dequantized to float32" if float32 else "")
        return resident

    def _make_room(self, needed: int, pinned: set[str]) -> None:
        """Evict least-recently-used models (never a pinned one) until `needed` more bytes fit the budget."""
        while self.used_bytes() + needed > self.budget_bytes:
            victims = [key for key in self._models if key not in pinned]
            if not victims:
                raise JobError("the worker's memory is taken by models in use; retry when they are done",
                               status=503, code="worker_busy")
            victim = self._models.pop(victims[0])
            self._keep_s.pop(victims[0], None)
            self._last_used.pop(victims[0], None)
            self._drop_adapters(victims[0])
            log.info("evicting %s (%.0f MiB) to make room", victim.info.id, victim.nbytes / 2**20)
            del victim
            self._changed()
            _free_memory()

    def keep_alive(self, model_path: str | Path, seconds: float) -> None:
        """How long this model stays once idle, from now on (a request's keep_alive: the latest one wins, as in
        Ollama; negative: until evicted)."""
        key = str(Path(model_path).resolve())
        if self._keep_s.get(key) != seconds:
            self._keep_s[key] = seconds
            self._changed()

    def expire(self, now: float | None = None) -> list[str]:
        """Unload the models idle for longer than their keep-alive (never a pinned one or one in use); their ids."""
        now = time.monotonic() if now is None else now
        busy = {str(Path(p).resolve()) for p in self.in_use()}
        gone = []
        for key in list(self._models):
            if key in busy:
                self._last_used[key] = now
                continue
            ttl = self._keep_s.get(key, self.ttl_s)
            if key in self.pinned or ttl < 0 or now - self._last_used.get(key, now) < ttl:
                continue
            gone.append(self._models[key].info.id)
            log.info("unloading %s: idle for %.0f s, its keep-alive is %g s", gone[-1],
                     now - self._last_used.get(key, now), ttl)
            self.unload(key)
        return gone

    def unload(self, model_path: str | Path) -> bool:
        """Drop a resident model (by directory) and its pin; True if it was loaded. A model that requests
        are using now is not dropped (JobError 409)."""
        key = str(Path(model_path).resolve())
        if key in {str(Path(p).resolve()) for p in self.in_use()}:
            raise JobError("the model is in use by requests running now; unload it when they are done",
                           status=409, code="model_in_use", param="model")
        self.pinned.discard(key)
        victim = self._models.pop(key, None)
        self._keep_s.pop(key, None)
        self._last_used.pop(key, None)
        self._drop_adapters(key)
        self._changed()
        if victim is None:
            return False
        del victim
        _free_memory()
        return True

    def pin(self, info) -> bool:
        """Load a model if needed and keep it: LRU eviction passes it by until it is unpinned. True if it
        was not pinned before."""
        self.get(info)
        key = str(Path(info.path).resolve())
        was = key in self.pinned
        self.pinned.add(key)
        self._changed()
        return not was

    def holds(self, model_path: str | Path) -> bool:
        """Whether the model (by directory) is resident."""
        return str(Path(model_path).resolve()) in self._models

    def unpin(self, model_path: str | Path) -> bool:
        """Let a pinned model be evicted again; True if it was pinned."""
        key = str(Path(model_path).resolve())
        was = key in self.pinned
        self.pinned.discard(key)
        self._changed()
        return was

    def _changed(self) -> None:
        self.snapshot = self.list()

    @property
    def capacity_bytes(self) -> int:
        """What the budget leaves for models and KV caches once MLX's buffer cache has its share."""
        return self.budget_bytes - self.cache_bytes

    def used_bytes(self) -> int:
        """Bytes of the budget taken: resident models and MLX's buffer cache (its limit)."""
        return (self.cache_bytes + sum(r.nbytes for r in self._models.values())
                + sum(r.nbytes for r in self._adapted.values()))

    def list(self) -> list[dict]:
        """Resident models, least recently used first (for logs and admin views)."""
        return [{"id": r.info.id, "path": str(r.info.path), "bytes": r.nbytes, "float32": r.float32,
                 "load_s": round(r.load_s, 3), "pinned": key in self.pinned,
                 "keep_alive_s": self._keep_s.get(key, self.ttl_s),
                 "adapters": [{"name": a.adapter, "bytes": a.nbytes, "load_s": round(a.load_s, 3)}
                              for (base, _), a in self._adapted.items() if base == key]}
                for key, r in self._models.items()]


def _free_memory() -> None:
    """Return freed model memory: drop Python references first (the frozen ones too), then MLX's buffer cache and
    malloc's free pages."""
    memory.collect_all()
    memory.release()
