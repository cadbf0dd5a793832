"""`mlxq up`: find or start Redis, then run web (gunicorn + gevent), the worker and the webhook worker.

Every child gets PR_SET_PDEATHSIG on Linux and its own process group, and Ctrl-C / SIGTERM stops
them all (TERM, then KILL after a grace period), so no orphan outlives `mlxq up`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import redis

from jobs.settings import Settings

GRACE_S = 20.0
"""How long children get to finish (the worker completes its current job) before SIGKILL."""


def _die_with_parent():
    """In the child: ask Linux to SIGTERM us when the parent dies, even by kill -9."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def redis_answers(url: str) -> bool:
    """Whether a Redis server answers PING at `url` within a second."""
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except (redis.RedisError, ValueError):
        return False


def redis_argv(port: int, data_dir: Path) -> list[str]:
    """redis-server's options for mlxq: loopback only, and durable (an fsync'd append-only file every
    second), so queued jobs and their records survive a restart; docs/operations.md says why."""
    return ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir), "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (also used by the tests and benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The processes started by `mlxq up`, stopped together."""

    def __init__(self, log=print):
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.log = log

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        """Start one child in its own process group, tied to our life."""
        process = subprocess.Popen(argv, env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)
        self.children.append((name, process))
        return process

    def ensure_redis(self, settings: Settings, data_dir: Path) -> str:
        """Use settings.redis_url if it answers, else start a private redis-server; return the URL."""
        if redis_answers(settings.redis_url):
            self.log(f"redis: using {settings.redis_url} (it answers)")
            return settings.redis_url
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(
                f"redis: nothing answers at {settings.redis_url} (REDIS_URL) and no redis-server on PATH "
                f"({os.environ.get('PATH', '')}).\nInstall one (Debian/Ubuntu: apt-get install redis-server; "
                "macOS: brew install redis) or set REDIS_URL to a running Redis."
            )
        port = free_port()
        data_dir.mkdir(parents=True, exist_ok=True)
        url = f"redis://127.0.0.1:{port}/0"
        self.log(f"redis: nothing answers at {settings.redis_url}; starting {binary} on port {port}")
        # An append-only file: jobs accepted (answered 202) survive a restart of this Redis.
        self.start("redis", [binary, *redis_argv(port, data_dir)])
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            if time.monotonic() > deadline:
                raise SystemExit(f"redis: {binary} did not answer on port {port} within 10s")
            time.sleep(0.1)
        return url

    def wait(self) -> int:
        """Block until a child exits or we are told to stop; then stop everything. Return an exit code."""
        stopping = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.append(True))
        code = 0
        while not stopping:
            for name, process in self.children:
                if process.poll() is not None:
                    self.log(f"{name} exited with code {process.returncode}; stopping the rest")
                    code = process.returncode or 1
                    stopping.append(True)
                    break
            time.sleep(0.2)
        self.stop()
        return code

    def stop(self) -> None:
        """Stop the services first (the worker finishes its job), then Redis, which they still need."""
        services = [c for c in self.children if c[0] != "redis"]
        self._stop_all(services)
        self._stop_all([c for c in self.children if c[0] == "redis"])

    def _stop_all(self, children) -> None:
        """SIGTERM each child's process group, then SIGKILL whatever outlives the grace period."""
        for name, process in children:
            if process.poll() is None:
                self.log(f"stopping {name} (pid {process.pid})")
                _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for name, process in children:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{name} did not stop within {GRACE_S:g}s; killing it")
                _signal_group(process, signal.SIGKILL)
                process.wait(5)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
