"""The model catalog: resolve model references and list models, reading small JSON files only.

Imported by the web tier, so it must never import mlx (not even indirectly): it only reads
`mlxq.json` / `config.json` files and asks huggingface_hub to scan its cache.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

STORE_MANIFEST = "mlxq.json"
ALIASES_FILE = "aliases.json"
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
"""What a store name may look like: lowercase, safe for a directory name, never a path."""
HF_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".npz")
_MAX_ALIAS_DEPTH = 8


@dataclass(frozen=True)
class ModelInfo:
    """One model a client can name."""

    id: str  # the name clients use: store name, alias, or HF repo id
    path: Path  # the MLX model directory
    kind: str  # "text" | "vision" | "speech"
    context_length: int | None
    vocab_size: int | None  # tokens the model can emit (bounds top_k)
    size_bytes: int
    source: str  # "gguf:<file>", "ct2:<dir>", "hf:<repo>", "dir:<path>" or "pull:<repo>"
    quantization: str | None
    license: str | None
    created: int  # unix time (OpenAI's `created`)

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


_json_memo: dict[Path, tuple[tuple[int, int], dict]] = {}
_scan_memo: dict[Path, tuple[tuple, dict[str, tuple[Path, int, float]]]] = {}
_size_memo: dict[Path, tuple[int, int]] = {}

# Every synchronous call resolves its model twice (web, then worker), and a resolution builds a
# dozen Path objects and stats several files: ~120 µs, on the call's latency. So each successful
# resolution is memoized with what it read: (check, argument, value) triples, each check a cheap
# stat or realpath. While every check still gives its value, the files it came from are unchanged
# and the answer stands; any change (an edited alias, a removed entry, a new HF snapshot) misses.
Inputs = list[tuple[Callable, object, object]]
_resolve_memo: dict[tuple[str, str, bool], tuple[Inputs, "ModelInfo"]] = {}
_inputs: ContextVar[Inputs | None] = ContextVar("mlxq_store_inputs", default=None)


def _note(check: Callable, arg, value) -> None:
    """Record, for the resolution in progress (if any), that it read `value` from `check(arg)`."""
    inputs = _inputs.get()
    if inputs is not None:
        inputs.append((check, arg, value))


def _file_key(path) -> tuple[int, int] | None:
    """(mtime_ns, size) of a file, or None when it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _dir_key(path) -> int | None:
    """mtime_ns of a directory (moves when an entry is added, removed or renamed), or None."""
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _read_json(path: Path) -> dict | None:
    """Return the JSON object in `path` (None if missing or invalid), memoized on mtime and size."""
    key = _file_key(path)
    _note(_file_key, path, key)
    if key is None:
        return None
    hit = _json_memo.get(path)
    if hit and hit[0] == key:
        return hit[1]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    if len(_json_memo) > 4096:  # bound the memo; it only ever holds a few small files
        _json_memo.clear()
    _json_memo[path] = (key, data)
    return data


def _dir_size(path: Path) -> int:
    """Sum of the sizes of the files under `path`, memoized on the directory's mtime.

    Every request resolves its model, and walking the directory each time was most of that cost.
    A model directory changes by files being added, removed or renamed (imports are atomic
    renames), which moves its mtime; a file rewritten in place would only leave the size stale.
    """
    key = _dir_key(path)
    _note(_dir_key, path, key)
    if key is None:
        return 0
    hit = _size_memo.get(path)
    if hit and hit[0] == key:
        return hit[1]
    size = _walk_size(path)
    if len(_size_memo) > 4096:  # bound the memo, as for the JSON files
        _size_memo.clear()
    _size_memo[path] = (key, size)
    return size


def _walk_size(path: Path) -> int:
    """Sum of the sizes of the files under `path` (following symlinks, as HF snapshots use them)."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except OSError:
        return 0
    for entry in entries:
        try:
            if entry.is_dir():
                total += _walk_size(Path(entry.path))
            else:
                total += entry.stat().st_size
        except OSError:
            continue
    return total


def detect_kind(config: dict) -> str:
    """Return "speech", "vision" or "text" for a model's config.json contents."""
    if config.get("model_type") == "whisper" or "n_mels" in config or "n_audio_ctx" in config:
        return "speech"
    if "vision_config" in config:
        return "vision"
    return "text"


def context_length_of(config: dict) -> int | None:
    """Return the context length a config.json declares, if any."""
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "n_text_ctx", "max_target_positions"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


def vocab_size_of(config: dict) -> int | None:
    """Return the vocabulary size a config.json declares, if any."""
    for source in (config, config.get("text_config") or {}):
        for key in ("vocab_size", "n_vocab"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


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


def _quantization_of(config: dict) -> str | None:
    """Describe MLX quantization recorded in config.json (e.g. "4bit-g64"), None when unquantized."""
    quant = config.get("quantization") or config.get("quantization_config")
    if not isinstance(quant, dict) or "bits" not in quant:
        return None
    group = quant.get("group_size")
    return f"{quant['bits']}bit" + (f"-g{group}" if group else "")


def _has_weights(path: Path) -> bool:
    """True when `path` holds MLX-loadable weights (safetensors or npz) next to its config."""
    try:
        return any(name.endswith(_WEIGHT_SUFFIXES) for name in os.listdir(path))
    except OSError:
        return False


def _info_from_config_dir(ref: str, path: Path, source: str, size: int | None = None,
                          created: float | None = None) -> ModelInfo | None:
    """Build a ModelInfo for a directory holding config.json (None if it holds none)."""
    config = _read_json(path / "config.json")
    if config is None:
        return None
    if created is None:
        created = (path / "config.json").stat().st_mtime
    return ModelInfo(
        id=ref, path=path, kind=detect_kind(config), context_length=context_length_of(config),
        vocab_size=vocab_size_of(config), size_bytes=_dir_size(path) if size is None else size, source=source,
        quantization=_quantization_of(config), license=config.get("license"), created=int(created),
    )


def _parse_time(value, fallback: float) -> int:
    """Turn mlxq.json's imported_at (ISO 8601 or unix seconds) into unix seconds."""
    if isinstance(value, (int, float)):
        return int(value)
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return int(fallback)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return int(moment.timestamp())
    return int(fallback)


def store_entry(settings, name: str) -> ModelInfo | None:
    """Return the store entry `name` (a directory holding mlxq.json), or None."""
    if not NAME_RE.match(name):
        return None
    path = Path(settings.models_dir) / name
    manifest_path = path / STORE_MANIFEST
    manifest = _read_json(manifest_path)
    if manifest is None:
        return None
    config = _read_json(path / "config.json") or {}
    context = manifest.get("context_length") or context_length_of(config)
    try:
        mtime = manifest_path.stat().st_mtime
    except OSError:
        return None
    return ModelInfo(
        id=name, path=path, kind=manifest.get("kind") or detect_kind(config),
        context_length=context if isinstance(context, int) else None, vocab_size=vocab_size_of(config),
        size_bytes=_dir_size(path), source=str(manifest.get("source") or f"dir:{path}"),
        quantization=manifest.get("quantization") or _quantization_of(config),
        license=manifest.get("license"), created=_parse_time(manifest.get("imported_at"), mtime),
    )


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
    data = _read_json(Path(settings.models_dir) / ALIASES_FILE) or {}
    return {str(k): str(v) for k, v in data.items() if isinstance(v, str)}


def hf_hub_cache_dir() -> Path:
    """The HF hub cache directory, read from the environment now (not at import time, as hf does)."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _cache_signature(cache_dir: Path) -> tuple:
    """mtimes of every repo's snapshots dir and revision dirs: changes whenever a download lands."""
    sig = []
    try:
        repos = sorted(os.scandir(cache_dir), key=lambda e: e.name)
    except OSError:
        return ()
    for repo in repos:
        snapshots = os.path.join(repo.path, "snapshots")
        try:
            sig.append((repo.name, os.stat(snapshots).st_mtime_ns))
            sig.extend((rev.name, rev.stat().st_mtime_ns) for rev in os.scandir(snapshots))
        except OSError:
            continue
    return tuple(sig)


def _scan_hf_cache(cache_dir: Path) -> dict[str, tuple[Path, int, float]]:
    """Map repo id -> (newest snapshot path, its size, its last_modified) using scan_cache_dir."""
    from huggingface_hub import scan_cache_dir  # imported here: keeps `import jobs.store` cheap

    try:
        info = scan_cache_dir(cache_dir)
    except Exception:  # CacheNotFound, or a cache that is a file: nothing cached, not an error
        return {}
    repos = {}
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: (r.last_modified, "main" in r.refs))
        repos[repo.repo_id] = (Path(newest.snapshot_path), newest.size_on_disk, newest.last_modified)
    return repos


def _hf_cache_state() -> tuple[Path, tuple]:
    """Where the HF cache is and the signature of its snapshots (changes when a download lands)."""
    cache_dir = hf_hub_cache_dir()
    return cache_dir, _cache_signature(cache_dir)


def hf_cached_repos() -> dict[str, tuple[Path, int, float]]:
    """The model repos in the local HF cache, memoized until a snapshot directory changes."""
    state = _hf_cache_state()
    _note(_hf_cache_state, None, state)
    cache_dir, signature = state
    if not cache_dir.is_dir():
        return {}
    hit = _scan_memo.get(cache_dir)
    if hit and hit[0] == signature:
        return hit[1]
    repos = _scan_hf_cache(cache_dir)
    _scan_memo[cache_dir] = (signature, repos)
    return repos


def _hf_entry(repo_id: str, cached: tuple[Path, int, float]) -> ModelInfo | None:
    """ModelInfo for a cached HF snapshot, if it looks like an MLX model (config + weights)."""
    path, size, modified = cached
    if not _has_weights(path):
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
        _note(_real_path, ref, real)
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
    key = (str(settings.models_dir), ref, allow_paths)
    hit = _resolve_memo.get(key)
    if hit is not None and all(check(arg) == value for check, arg, value in hit[0]):
        return hit[1]
    inputs: Inputs = []
    token = _inputs.set(inputs)
    try:
        info = _resolve(ref, settings, (), allow_paths)
    finally:
        _inputs.reset(token)
    if len(_resolve_memo) > 4096:  # bound the memo, as for the JSON files
        _resolve_memo.clear()
    _resolve_memo[key] = (inputs, info)
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
