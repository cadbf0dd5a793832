"""The local Hugging Face hub cache: which model repos it holds (scanned by huggingface_hub, memoized)."""

from __future__ import annotations

import os
from pathlib import Path

_scan_memo: dict[Path, tuple[tuple, dict[str, tuple[Path, int, float]]]] = {}


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
    cache_dir, signature = state
    if not cache_dir.is_dir():
        return {}
    hit = _scan_memo.get(cache_dir)
    if hit and hit[0] == signature:
        return hit[1]
    repos = _scan_hf_cache(cache_dir)
    _scan_memo[cache_dir] = (signature, repos)
    return repos
