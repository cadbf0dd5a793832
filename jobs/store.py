"""The model catalog: resolve model references and list models, reading small JSON files only.

Imported by the web tier, so it must never import mlx (not even indirectly): it only reads
`mlxq.json` / `config.json` files and asks huggingface_hub to scan its cache.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from jobs.hf_cache import hf_cached_repos, hf_hub_cache_dir
from jobs.model_files import (
    capabilities_of,
    context_length_of,
    detect_kind,
    dir_size,
    embedding_facts,
    has_weights,
    parse_time,
    quantization_of,
    read_json,
    sampling_defaults_of,
    vocab_size_of,
)

STORE_MANIFEST = "mlxq.json"
ALIASES_FILE = "aliases.json"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
"""What a store name may look like: lowercase, safe for a directory name, never a path."""
HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_MAX_ALIAS_DEPTH = 8


@dataclass(frozen=True)
class ModelInfo:
    """One model a client can name."""

    id: str  # the name clients use: store name, alias, or HF repo id
    path: Path  # the MLX model directory
    kind: str  # "text" | "vision" | "speech" | "embedding"
    context_length: int | None  # an embedding model's: the most tokens of one input
    vocab_size: int | None  # tokens the model can emit (bounds top_k)
    size_bytes: int
    source: str  # "gguf:<file>", "ct2:<dir>", "hf:<repo>", "dir:<path>" or "pull:<repo>"
    quantization: str | None
    license: str | None
    created: int  # unix time (OpenAI's `created`)
    capabilities: tuple[str, ...] = ()  # "vision", "audio": what it takes besides text
    sampling_defaults: tuple[tuple[str, float], ...] = ()  # generation_config.json's, for fields a request leaves out
    dimensions: int | None = None  # an embedding model's vector length

    def as_dict(self) -> dict:
        """Return a JSON-serializable dict of every field."""
        data = asdict(self)
        data["path"] = str(self.path)
        return data


class ModelNotFound(LookupError):
    """A model reference matched nothing; the message names the reference and every place looked."""

    def __init__(self, ref: str, looked: list[str]):
        self.ref = ref
        self.looked = looked
        super().__init__(f"model {ref!r} not found; looked for: " + "; ".join(looked))

    @property
    def public_message(self) -> str:
        """What an API client is told: the reference and where names resolve, never a server path."""
        return (f"Model {self.ref!r} not found: it is not an alias, a model in the server's store, or a "
                "Hugging Face repo in its local cache. GET /v1/models lists the models available.")


def public_source(source: str) -> str:
    """A model's source as clients may see it: never a path of the server's file system.

    "gguf:/srv/x/model.gguf" -> "gguf:model.gguf", "dir:/srv/x" -> "dir", "hf:owner/name" unchanged.
    """
    scheme, _, rest = source.partition(":")
    if scheme in ("hf", "pull") or not rest:
        return source
    if scheme == "dir":
        return "dir"
    return f"{scheme}:{os.path.basename(rest.rstrip('/'))}"


def _info_from_config_dir(ref: str, path: Path, source: str, size: int | None = None,
                          created: float | None = None) -> ModelInfo | None:
    """Build a ModelInfo for a directory holding config.json (None if it holds none)."""
    config = read_json(path / "config.json")
    if config is None:
        return None
    if created is None:
        created = (path / "config.json").stat().st_mtime
    kind = detect_kind(config)
    return _with_embedding_facts(ModelInfo(
        id=ref, path=path, kind=kind, context_length=context_length_of(config),
        vocab_size=vocab_size_of(config), size_bytes=dir_size(path) if size is None else size, source=source,
        quantization=quantization_of(config), license=config.get("license"), created=int(created),
        capabilities=capabilities_of(config, path), sampling_defaults=sampling_defaults_of(path),
    ), config)


def _with_embedding_facts(info: ModelInfo, config: dict) -> ModelInfo:
    """An embedding model's entry with its vector length, and its most tokens per input as its context."""
    facts = embedding_facts(info.path, config) if info.kind == "embedding" else None
    if facts is None:
        return info
    return replace(info, context_length=facts.max_tokens, dimensions=facts.dimensions, sampling_defaults=())


def store_entry(settings, name: str) -> ModelInfo | None:
    """Return the store entry `name` (a directory holding mlxq.json), or None."""
    if not NAME_RE.match(name):
        return None
    path = Path(settings.models_dir) / name
    manifest_path = path / STORE_MANIFEST
    manifest = read_json(manifest_path)
    if manifest is None:
        return None
    config = read_json(path / "config.json") or {}
    context = manifest.get("context_length") or context_length_of(config)
    try:
        mtime = manifest_path.stat().st_mtime
    except OSError:
        return None
    return _with_embedding_facts(ModelInfo(
        id=name, path=path, kind=manifest.get("kind") or detect_kind(config),
        context_length=context if isinstance(context, int) else None, vocab_size=vocab_size_of(config),
        size_bytes=dir_size(path), source=str(manifest.get("source") or f"dir:{path}"),
        quantization=manifest.get("quantization") or quantization_of(config),
        license=manifest.get("license"), created=parse_time(manifest.get("imported_at"), mtime),
        capabilities=capabilities_of(config, path), sampling_defaults=sampling_defaults_of(path),
    ), config)


def store_names(settings) -> list[str]:
    """Names of the complete store entries, sorted (temp dirs of imports in progress never count)."""
    try:
        entries = os.scandir(settings.models_dir)
    except OSError:
        return []
    with entries:
        return sorted(
            e.name for e in entries
            if NAME_RE.match(e.name) and os.path.isfile(os.path.join(e.path, STORE_MANIFEST))
        )


def read_aliases(settings) -> dict[str, str]:
    """Return the {alias: target ref} map from `<models_dir>/aliases.json` (empty if absent)."""
    data = read_json(Path(settings.models_dir) / ALIASES_FILE) or {}
    return {str(k): str(v) for k, v in data.items() if isinstance(v, str)}


def _hf_entry(repo_id: str, cached: tuple[Path, int, float]) -> ModelInfo | None:
    """ModelInfo for a cached HF snapshot, if it looks like an MLX model (config + weights)."""
    path, size, modified = cached
    if not has_weights(path):
        return None
    return _info_from_config_dir(repo_id, path, f"hf:{repo_id}", size=size, created=modified)


def _is_path_ref(ref: str) -> bool:
    """Only explicit path forms count as paths, so an "owner/name" never shadows an HF repo id."""
    return ref.startswith(("/", "./", "../", "~")) or ref in (".", "..")


def _real_path(ref: str) -> str:
    """The directory a path reference names, with `~` expanded and symlinks resolved."""
    return os.path.realpath(os.path.expanduser(ref))


def _resolve(ref: str, settings, seen: tuple[str, ...], allow_paths: bool = True) -> ModelInfo:
    """Resolve `ref` in order: alias, store name, directory path, HF cache; raise ModelNotFound."""
    models_dir = Path(settings.models_dir)
    aliases = read_aliases(settings)
    if ref in aliases and ref not in seen and len(seen) < _MAX_ALIAS_DEPTH:
        try:
            # Aliases are the operator's own config, so their targets may be paths.
            return replace(_resolve(aliases[ref], settings, seen + (ref,)), id=ref)
        except ModelNotFound as exc:
            raise ModelNotFound(ref, [f"alias {ref!r} -> {aliases[ref]!r} in {models_dir / ALIASES_FILE}",
                                      *exc.looked]) from None
    looked = [f"an alias in {models_dir / ALIASES_FILE}",
              f"a store entry {models_dir / ref / STORE_MANIFEST}" if NAME_RE.match(ref)
              else f"a store entry in {models_dir} (not a valid store name)"]
    info = store_entry(settings, ref)
    if info:
        return info
    if _is_path_ref(ref) and allow_paths:
        real = _real_path(ref)
        path = Path(real)
        looked.append(f"a model directory {path}/config.json")
        info = _info_from_config_dir(ref, path, f"dir:{path}") if path.is_dir() else None
        if info:
            return info
    elif allow_paths:
        looked.append("a directory path (absolute, ./ or ../ or ~ only)")
    cache_dir = hf_hub_cache_dir()
    if HF_REPO_RE.match(ref):
        looked.append(f"Hugging Face repo {ref} in the local cache {cache_dir}")
        cached = hf_cached_repos().get(ref)
        info = _hf_entry(ref, cached) if cached else None
        if info:
            return info
    else:
        looked.append(f"the Hugging Face cache {cache_dir} (not an owner/name repo id)")
    raise ModelNotFound(ref, looked)


def resolve(ref: str | None, settings, allow_paths: bool = True) -> ModelInfo:
    """Resolve a model reference (None: settings.default_model) to a ModelInfo or raise ModelNotFound.

    API clients get allow_paths=False: they may name models, never arbitrary server directories.
    """
    ref = settings.default_model if ref is None else ref.strip()
    if not ref:
        raise ModelNotFound("", ["a non-empty model reference"])
    info = _resolve(ref, settings, (), allow_paths)
    return info


def list_models(settings) -> list[ModelInfo]:
    """Every model a client can name: store entries, then aliases, then MLX models in the HF cache."""
    aliases = read_aliases(settings)
    # An alias shadows a store entry of the same name (aliases resolve first), so list what resolves.
    models = [info for name in store_names(settings)
              if name not in aliases and (info := store_entry(settings, name))]
    for alias in sorted(aliases):
        try:
            models.append(resolve(alias, settings))
        except ModelNotFound:
            continue  # a dangling alias is not a model anyone can use
    ids = {m.id for m in models}
    for repo_id, cached in sorted(hf_cached_repos().items()):
        info = None if repo_id in ids else _hf_entry(repo_id, cached)
        if info:
            models.append(info)
    return models
