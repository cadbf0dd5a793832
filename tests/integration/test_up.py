"""`mlxq up` as an operator runs it: an embedded Redis when none is there, a worker killed with -9
restarted (its async job resumed), and Ctrl-C / SIGTERM leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from mlxq.devstack import Stack, free_port, redis_answers
from tests.conftest import REPO, wait_until
from tests.integration.test_transcription import long_wav, submit_job

RESTARTED_WITHIN_S = 30


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

    The store is a fresh directory linking to the demo models, so the Redis data directory `mlxq up`
    derives from it (<store>/../redis) is this test's own.
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
    from jobs.settings import load_settings

    settings = load_settings().with_overrides(redis_url=bare_env["REDIS_URL"])
    url = stack.ensure_redis(settings, tmp_path / "redis")
    try:
        assert redis_answers(url) and url != settings.redis_url
        assert "embedded valkey-server" in lines[-1], lines
        conn = redis.Redis.from_url(url)
        assert conn.config_get("appendonly") == {"appendonly": "yes"}  # queued jobs survive a restart
        assert Path(conn.config_get("dir")["dir"]) == tmp_path / "redis"
    finally:
        stack.stop()
    assert not redis_answers(url)


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


def test_up_restarts_a_killed_worker_and_its_job_resumes(bare_env, tmp_path):
    port = free_port()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "mlxq.cli", "up", "--port", str(port), "--web-workers", "1"],
                              env=bare_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    everything: set[int] = set()
    try:
        wait_until(lambda: _ready(api), 180, interval=0.5, what="mlxq up to be ready")
        assert "embedded valkey-server" in log_path.read_text()

        job = submit_job(api, "minute.wav", content=long_wav(repeats=1))
        wait_until(lambda: ((_record(api, job).get("progress") or {}).get("done_s") or 0) > 0, 300,
                   interval=0.2, what="the first window to be transcribed")
        everything.update(_descendants(up.pid))
        old_worker = _worker_pid(up.pid)
        os.kill(old_worker, signal.SIGKILL)
        killed_at = time.monotonic()

        new_worker = wait_until(lambda: (p := _worker_pid(up.pid)) not in (None, old_worker) and p,
                                RESTARTED_WITHIN_S, interval=0.2, what="a new worker process")
        wait_until(lambda: _ready(api), RESTARTED_WITHIN_S, interval=0.2, what="the service to be ready again")
        chat = api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                      "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200, chat.text
        assert time.monotonic() - killed_at < RESTARTED_WITHIN_S
        text = log_path.read_text()
        assert f"worker (pid {old_worker}) exited with code -9" in text and f"worker restarted (pid {new_worker})" in text

        record = wait_until(lambda: (r := _record(api, job))["status"] in ("succeeded", "failed") and r, 300,
                            interval=0.5, what="the resumed job to finish")
        assert record["status"] == "succeeded" and record["attempts"] >= 2, record
        assert record["result"]["text"].strip()
        everything.update(_descendants(up.pid))
    finally:
        api.close()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0, log_path.read_text()[-3000:]
    leftovers = [(pid, _cmdline(pid)) for pid in everything if _alive(pid)]
    assert not leftovers, leftovers


def _ready(api: httpx.Client) -> bool:
    try:
        return api.get("/ready").status_code == 200
    except httpx.HTTPError:
        return False


def _record(api: httpx.Client, job: dict) -> dict:
    return api.get(job["links"]["self"]).json()
