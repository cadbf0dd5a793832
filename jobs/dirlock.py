"""One process per directory: an flock on a lock file that holds the holder's pid.

`mlxq up`'s Redis data directory (mlxq/devstack.py) and a worker's prompt-cache directory
(workers/backends/prompt_disk.py) each belong to one process: two Redis servers appending to one file, or two
workers evicting each other's entries, would lose data. The lock dies with the process (every holder of the
descriptor), so a kill -9 never leaves a directory locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class DirectoryInUse(Exception):
    """Another process holds the directory; `holder` is its pid as it wrote it ("unknown" if it wrote none)."""

    def __init__(self, directory: Path, holder: str):
        super().__init__(f"{directory} is in use by another process (pid {holder})")
        self.directory, self.holder = directory, holder


def lock_directory(directory: Path, name: str) -> int:
    """Lock `directory` (created if needed) for this process through its lock file `name`; the descriptor, which
    holds the lock until it is closed. DirectoryInUse when another process has it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / name, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DirectoryInUse(directory, holder) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
