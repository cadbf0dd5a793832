"""`mlxq up` as an operator runs it: an embedded Redis when none is there, a worker killed with -9
restarted, and Ctrl-C / SIGTERM leaving no process behind. (What a restarted worker does with the job the
killed one was running, a transcription resumed from its checkpoint, is tests/integration/test_faults.py.)"""

from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from jobs.settings import load_settings
from mlxq.devstack import LOCK_NAME, Stack, free_port, lock_data_dir, redis_answers
from tests.conftest import REPO, wait_until

RESTARTED_WITHIN_S = 30
"""How soon the supervisor starts a new worker after one is killed (its own delay is a fraction of a second)."""

READY_WITHIN_S = 180
"""A bound on a worker's start up to a warm model (seconds on an idle machine; far longer on a busy one)."""


def _children(pid: int) -> list[int]:
    """The direct children of a process (Linux)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    found = []
    for child in _children(pid):
        found += [child, *_descendants(child)]
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _worker_pid(up_pid: int) -> int | None:
    return next((p for p in _children(up_pid) if "workers.main" in _cmdline(p)), None)


@pytest.fixture()
def bare_env(tmp_path, models_dir):
    """An environment with no Redis anywhere: REDIS_URL names a closed port, PATH holds no redis-server.

    The store is a fresh directory linking to the demo models, so the Redis data directories `mlxq up`
    derives from it (<store>/../redis/<port>) are this test's own.
    """
    store = tmp_path / "mlxq" / "models"
    store.mkdir(parents=True)
    for entry in models_dir.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            (store / entry.name).symlink_to(entry)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    return {**os.environ, "PATH": str(empty_bin), "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
            "MLXQ_MODELS_DIR": str(store), "MLXQ_SPOOL_DIR": str(tmp_path / "spool"), "PYTHONUNBUFFERED": "1"}


def test_embedded_redis_starts_when_none_is_there(bare_env, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", bare_env["PATH"])
    lines = []
    stack = Stack(log=lines.append)
    settings = load_settings().with_overrides(redis_url=bare_env["REDIS_URL"])
    url = stack.ensure_redis(settings, tmp_path / "redis")
    port = urlsplit(url).port
    try:
        assert url == settings.redis_url  # on the port REDIS_URL names, not a random one
        assert "embedded valkey-server" in lines[-1], lines
        conn = redis.Redis.from_url(url)
        assert conn.config_get("appendonly") == {"appendonly": "yes"}  # queued jobs survive a restart
        data_dir = tmp_path / "redis" / str(port)  # a directory per port: instances never share one
        assert Path(conn.config_get("dir")["dir"]) == data_dir
        assert (data_dir / LOCK_NAME).read_text().strip() == str(os.getpid())
        with pytest.raises(SystemExit, match="in use by another mlxq"):
            lock_data_dir(data_dir)
    finally:
        stack.stop()
    assert not redis_answers(url)
    os.close(lock_data_dir(data_dir))  # free again once the stack and its Redis are gone


def test_a_locked_data_directory_is_refused(bare_env, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", bare_env["PATH"])
    settings = load_settings().with_overrides(redis_url=bare_env["REDIS_URL"])
    held = lock_data_dir(tmp_path / "redis" / str(urlsplit(settings.redis_url).port))  # as another mlxq up would
    try:
        with pytest.raises(SystemExit, match=f"in use by another mlxq \\(pid {os.getpid()}\\)"):
            Stack(log=lambda line: None).ensure_redis(settings, tmp_path / "redis")
    finally:
        os.close(held)
    assert not redis_answers(settings.redis_url)


def test_a_redis_port_held_by_something_else_is_named(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as other:  # listens, never answers PING
        port = other.getsockname()[1]
        settings = load_settings().with_overrides(redis_url=f"redis://127.0.0.1:{port}/0")
        with pytest.raises(SystemExit, match=f"port {port} cannot be listened on"):
            Stack(log=lambda line: None).ensure_redis(settings, tmp_path / "redis")
    assert not (tmp_path / "redis").exists()


def test_up_refuses_a_taken_port_before_starting_anything(bare_env, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as other:
        port = other.getsockname()[1]
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "mlxq.cli", "up", "--port", str(port)], env=bare_env,
                              cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert time.monotonic() - started < 30
    assert f"cannot listen on 127.0.0.1:{port}: taken" in done.stderr and "--port" in done.stderr, done.stderr
    assert "make run PORT=" in done.stderr and "mlxq is starting" not in done.stdout
    assert not redis_answers(bare_env["REDIS_URL"]) and not (tmp_path / "mlxq" / "redis").exists()


def test_a_child_that_cannot_stay_up_ends_the_stack_with_its_code(monkeypatch):
    from mlxq import devstack

    monkeypatch.setattr(devstack, "RESTART_DELAY_S", 0.01)
    lines = []
    stack = Stack(log=lines.append)
    stack.start("broken", [sys.executable, "-c", "raise SystemExit(3)"])
    code = wait_until(lambda: stack.supervise(time.monotonic()), 30, interval=0.02, what="the stack to give up")
    assert code == 3
    assert sum("restarted" in line for line in lines) == devstack.MAX_QUICK_DEATHS - 1
    assert "giving up" in lines[-1]
    stack.stop()


def test_two_instances_keep_their_own_redis_and_a_killed_worker_is_restarted(bare_env, tmp_path):
    """Two `mlxq up` sharing one store (as on one machine), each REDIS_URL on a port where nothing answers:
    each starts its Redis there, with a data directory of its own, and neither sees the other's jobs. Then the
    first one's worker, killed with -9 once it serves, is restarted, and Ctrl-C's SIGTERM stops each stack
    with code 0, leaving no process behind (one pair of stacks for both stories: each start loads a model)."""
    instances = []
    everything: set[int] = set()
    try:
        for name in ("a", "b"):
            env = {**bare_env, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
            port = free_port()
            with open(tmp_path / f"up-{name}.log", "wb") as log:
                argv = [sys.executable, "-m", "mlxq.cli", "up", "--port", str(port), "--web-workers", "1"]
                up = subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            instances.append((up, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60), env["REDIS_URL"]))
        for up, api, _ in instances:  # the web tier answering is enough: async jobs queue without a worker
            wait_until(functools.partial(_healthy, api, up), 120, interval=0.2, what="the web tier to answer")
        (up_a, api_a, url_a), (up_b, api_b, url_b) = instances
        job = api_b.post("/v1/jobs/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                             "max_tokens": 1})
        assert job.status_code == 202, job.text
        assert api_b.get(job.json()["links"]["self"]).status_code in (200, 202)
        assert api_a.get(job.json()["links"]["self"]).status_code == 404
        dirs = [Path(redis.Redis.from_url(url).config_get("dir")["dir"]) for url in (url_a, url_b)]
        home = tmp_path / "mlxq" / "redis"
        assert dirs == [home / str(urlsplit(url_a).port), home / str(urlsplit(url_b).port)]
        base = str(api_a.base_url).rstrip("/")  # the banner names this instance's page and Swagger UI
        log_a = tmp_path / "up-a.log"
        banner = log_a.read_text()
        assert f"Page        {base}/\n" in banner and f"Swagger UI  {base}/docs\n" in banner, banner
        assert "embedded valkey-server" in banner
        everything.update(_descendants(up_b.pid))
        up_b.send_signal(signal.SIGTERM)  # done with: it stops while the first one goes on

        wait_until(lambda: _ready(api_a), READY_WITHIN_S, interval=0.2, what="mlxq up to be ready")
        everything.update(_descendants(up_a.pid))
        old_worker = _worker_pid(up_a.pid)
        os.kill(old_worker, signal.SIGKILL)
        killed_at = time.monotonic()

        new_worker = wait_until(lambda: (p := _worker_pid(up_a.pid)) not in (None, old_worker) and p,
                                RESTARTED_WITHIN_S, interval=0.2, what="a new worker process")
        assert time.monotonic() - killed_at < RESTARTED_WITHIN_S
        # Until the new worker has warmed its model a chat is refused (503 no_worker, Retry-After), as a
        # client that follows Retry-After sees it; /ready alone may still count the dead worker's key. How
        # long the warm-up takes is the machine's load, not the supervisor's: it is waited for, not timed.
        wait_until(lambda: _chat_answered(api_a), READY_WITHIN_S, interval=0.2, what="a chat to be answered")
        text = log_a.read_text()
        assert f"worker (pid {old_worker}) exited with code -9" in text and f"worker restarted (pid {new_worker})" in text
        everything.update(_descendants(up_a.pid))
    finally:
        for up, api, _ in instances:
            api.close()
            if up.poll() is None:
                up.send_signal(signal.SIGTERM)
        codes = [up.wait(60) for up, _, _ in instances]
    assert codes == [0] * len(instances), [(tmp_path / f"up-{n}.log").read_text()[-2000:] for n in ("a", "b")]
    leftovers = [(pid, _cmdline(pid)) for pid in everything if _alive(pid)]
    assert not leftovers, leftovers


def _healthy(api: httpx.Client, up: subprocess.Popen) -> bool:
    assert up.poll() is None, f"mlxq up exited with code {up.returncode}"
    try:
        return api.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def _chat_answered(api: httpx.Client) -> bool:
    """A short chat answered (True), or refused only because no worker runs yet (False)."""
    chat = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 4, "temperature": 0})
    if chat.status_code == 503 and chat.json()["error"]["code"] == "no_worker":
        return False
    assert chat.status_code == 200, chat.text
    return True


def _ready(api: httpx.Client) -> bool:
    try:
        return api.get("/ready").status_code == 200
    except httpx.HTTPError:
        return False
