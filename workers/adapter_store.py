"""Writes to the adapter store: import an `mlx_lm.lora` adapter after checking it against its base model, remove one.

An import reads the adapter's `adapter_config.json` and the safetensors headers of the adapter and of its
base model (no weight is loaded, nothing imports mlx), checks that every LoRA tensor fits the base layer
it adapts, then copies the two files into `<adapters_dir>/.tmp-<name>-<random>` and renames it into
place with `mlxq-adapter.json` (jobs/adapters.py reads it), as model imports do (workers/store_admin.py).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from jobs import adapters as catalog
from jobs.adapters import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS, AdapterInfo, AdapterNotFound
from jobs.store import ModelInfo, ModelNotFound, resolve
from workers.models import _quant_bits, read_safetensors_header
from workers.store_admin import StoreError, _move_into_place, _write_json, source_sha256, validate_name

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")
"""The tensors an mlx-lm LoRA (lora_a, lora_b) or DoRA (and m) adapter holds per adapted layer."""


class AdapterError(StoreError):
    """An adapter that cannot be imported (the message says why, for the user)."""


@dataclass(frozen=True)
class AdapterConfig:
    """What mlxq needs of an adapter_config.json (mlx_lm.lora writes it beside adapters.safetensors)."""

    fine_tune_type: str  # "lora" or "dora"
    num_layers: int
    rank: int
    scale: float
    base_hint: str | None  # the model it was trained on, as the config names it ("model", or "base_model")


def parse_config(data: dict) -> AdapterConfig:
    """The adapter's settings from its adapter_config.json; AdapterError naming what is missing or unsupported."""
    kind = data.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError("this is a full fine-tune (fine_tune_type 'full'), not an adapter: fuse it into a model "
                           "and import that model instead")
    if kind not in ("lora", "dora"):
        raise AdapterError(f"unsupported fine_tune_type {kind!r} in {ADAPTER_CONFIG} (expected 'lora' or 'dora')")
    lora = data.get("lora_parameters")
    if not isinstance(lora, dict):
        raise AdapterError(f"{ADAPTER_CONFIG} has no 'lora_parameters' object (is it an mlx_lm.lora output?)")
    if "scale" not in lora:
        hint = " ('alpha' is another framework's name: mlx-lm's LoRA takes 'scale')" if "alpha" in lora else ""
        raise AdapterError(f"{ADAPTER_CONFIG}'s lora_parameters has no 'scale'{hint}")
    try:
        rank, scale, layers = int(lora["rank"]), float(lora["scale"]), int(data["num_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{ADAPTER_CONFIG} needs integer 'num_layers' and lora_parameters 'rank' "
                           f"({type(exc).__name__}: {exc})") from None
    if rank < 1:
        raise AdapterError(f"{ADAPTER_CONFIG}'s lora_parameters rank must be at least 1, not {rank}")
    hint = data.get("base_model") or data.get("model")
    return AdapterConfig(kind, layers, rank, scale, hint if isinstance(hint, str) and hint else None)


def adapter_tensors(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of an adapters.safetensors, from its header."""
    header = read_safetensors_header(path)
    return {name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"}


def base_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Layer name -> the logical shape of its weight (as it computes: a quantized weight's packed last dimension
    unpacked) for every layer of a model directory, from its safetensors headers and config.json."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    header = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        header.update({k: v for k, v in read_safetensors_header(file).items() if k != "__metadata__"})
    shapes = {}
    for name, meta in header.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight":
            continue
        shape = list(meta["shape"])
        bits = _quant_bits(quantization, module) if f"{module}.scales" in header and meta["dtype"] == "U32" else None
        if bits:
            shape[-1] = shape[-1] * 32 // bits
        shapes[module] = tuple(shape)
    return shapes


def fits_layer(weight: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...], rank: int) -> bool:
    """Whether lora_a and lora_b of this rank fit a base layer whose (logical) weight has this shape: a linear
    layer's (out, in) takes a (in, r) and b (r, out); an embedding's (count, dims) takes a (count, r) and b (r, dims);
    a mixture of experts' (experts, out, in) takes a (experts, r, in) and b (experts, out, r)."""
    if len(weight) == 2:
        out, inp = weight
        return b[:1] == (rank,) and ((a == (inp, rank) and b == (rank, out)) or (a == (out, rank) and b == (rank, inp)))
    if len(weight) == 3:
        experts, out, inp = weight
        return a == (experts, rank, inp) and b == (experts, out, rank)
    return False


def check_shapes(config: AdapterConfig, tensors: dict[str, tuple[int, ...]],
                 base: dict[str, tuple[int, ...]]) -> list[str]:
    """What does not fit, one line per adapted layer (empty: the adapter fits the base)."""
    layers: dict[str, dict[str, tuple[int, ...]]] = {}
    problems = []
    for name, shape in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in ADAPTER_LEAVES or (leaf == "m" and config.fine_tune_type != "dora"):
            problems.append(f"{name}: not a LoRA tensor (expected names ending in .lora_a or .lora_b)")
            continue
        layers.setdefault(module, {})[leaf] = shape
    for module, leaves in sorted(layers.items()):
        if "lora_a" not in leaves or "lora_b" not in leaves:
            problems.append(f"{module}: needs both lora_a and lora_b")
        elif module not in base:
            problems.append(f"{module}: the base model has no such layer")
        elif not fits_layer(base[module], leaves["lora_a"], leaves["lora_b"], config.rank):
            problems.append(f"{module}: lora_a {list(leaves['lora_a'])} and lora_b {list(leaves['lora_b'])} (rank "
                            f"{config.rank}) do not fit the base layer's weight {list(base[module])}")
        elif "m" in leaves and leaves["m"] != base[module][:1]:
            problems.append(f"{module}: DoRA magnitude m {list(leaves['m'])} does not fit {list(base[module])}")
    if not layers and not problems:
        problems.append(f"{ADAPTER_WEIGHTS} holds no LoRA tensors")
    return problems


def find_base(settings, config: AdapterConfig, base: str | None) -> tuple[str, ModelInfo]:
    """The base model (its store name and entry): `base` if given, else the one the config names; AdapterError when
    it is not a text model mlxq has."""
    ref = base or config.base_hint
    if not ref:
        raise AdapterError(f"{ADAPTER_CONFIG} names no base model: pass --base MODEL (a model in the store)")
    try:
        info = resolve(ref, settings)
    except ModelNotFound:
        where = "--base" if base else f"{ADAPTER_CONFIG} ('model')"
        raise AdapterError(f"the base model {ref!r} named by {where} is not in the model store; import it first, "
                           "or pass --base MODEL naming the store's copy of it") from None
    if info.kind != "text":
        raise AdapterError(f"the base model {info.id!r} is a {info.kind} model; adapters are served on text models")
    models_dir = Path(os.path.realpath(settings.models_dir))
    name = info.path.name if Path(os.path.realpath(info.path)).parent == models_dir else info.id
    if name.startswith(("/", ".", "~")):  # a directory outside the store: requests could not name it
        raise AdapterError(f"the base model {ref!r} is a directory outside the model store ({models_dir}); import "
                           "it into the store, then pass --base NAME")
    return name, info


def inspect(settings, src: Path, base: str | None = None) -> tuple[AdapterConfig, str, ModelInfo]:
    """Check an adapter directory against its base model: its config, the base's store name and entry;
    AdapterError saying what is wrong otherwise."""
    src = Path(src).expanduser()
    for needed in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (src / needed).is_file():
            raise AdapterError(f"{src} has no {needed}: an adapter is an mlx_lm.lora output directory "
                               f"({ADAPTER_WEIGHTS} + {ADAPTER_CONFIG})")
    try:
        data = json.loads((src / ADAPTER_CONFIG).read_text())
    except ValueError as exc:
        raise AdapterError(f"{src / ADAPTER_CONFIG} is not valid JSON: {exc}") from None
    config = parse_config(data if isinstance(data, dict) else {})
    name, info = find_base(settings, config, base)
    problems = check_shapes(config, adapter_tensors(src / ADAPTER_WEIGHTS), base_shapes(info.path))
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise AdapterError(f"this adapter does not fit the base model {name!r} (it was probably trained for another "
                           f"model): {shown}")
    return config, name, info


def import_adapter(settings, src: Path, name: str | None = None, base: str | None = None, force: bool = False,
                   provenance: dict | None = None) -> AdapterInfo:
    """Check `src` against its base model and copy it into the adapter store as `name`; return its entry."""
    src = Path(src).expanduser().resolve()
    name = validate_name(name or catalog_name(src))
    config, base_name, _ = inspect(settings, src, base)
    store = Path(settings.adapters_dir)
    store.mkdir(parents=True, exist_ok=True)
    target = store / name
    if target.exists() and not force:
        raise AdapterError(f"adapter {name!r} already exists in {store}; use --force to replace it")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=store))
    try:
        os.chmod(tmp, 0o755)  # the web tier may run as another user
        for file in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
            shutil.copy2(src / file, tmp / file)
        manifest = {"name": name, "base": base_name, "fine_tune_type": config.fine_tune_type, "rank": config.rank,
                    "scale": config.scale, "num_layers": config.num_layers, "source": f"dir:{src}",
                    "source_sha256": source_sha256(src / ADAPTER_WEIGHTS),
                    "imported_at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
                    **(provenance or {})}
        _write_json(tmp / ADAPTER_MANIFEST, manifest)
        _move_into_place(tmp, target, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = catalog.adapter_entry(settings, name)
    assert info is not None, f"{target} vanished right after import"
    return info


def catalog_name(src: Path) -> str:
    """A store name derived from the adapter directory's name."""
    from workers.store_admin import safe_name

    return safe_name(src.name)


def remove_adapter(settings, name: str) -> None:
    """Remove adapter `name` from the store (AdapterNotFound if there is none)."""
    if catalog.adapter_entry(settings, name) is None:
        raise AdapterNotFound(name)
    target = Path(settings.adapters_dir) / name
    doomed = target.with_name(f".tmp-rm-{name}-{secrets.token_hex(4)}")
    os.rename(target, doomed)  # gone at once for readers; deleted at leisure
    shutil.rmtree(doomed, ignore_errors=True)
