"""`mlxq up` as an operator runs it: an embedded Redis when none is there, a worker killed with -9
restarted, and Ctrl-C / SIGTERM leaving no process behind; several workers (`--workers N`, `--gpus`), each
with its own device, name, prompt-cache directory and share of memory. (What a restarted worker does with the
job the killed one was running, a transcription resumed from its checkpoint, is tests/integration/test_faults.py.)"""

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
from click.testing import CliRunner

from jobs.settings import load_settings
from mlxq import devstack
from mlxq.cli import banner, default_web_workers, main, shared_budget_mb
from mlxq.devstack import LOCK_NAME, Stack, free_port, lock_data_dir, parse_gpus, redis_answers, worker_plans
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
    monkeypatch.setattr(devstack, "RESTART_DELAY_S", 0.01)
    lines = []
    stack = Stack(log=lines.append)
    stack.start("broken", [sys.executable, "-c", "raise SystemExit(3)"])
    code = wait_until(lambda: stack.supervise(time.monotonic()), 30, interval=0.02, what="the stack to give up")
    assert code == 3
    assert sum("restarted" in line for line in lines) == devstack.MAX_QUICK_DEATHS - 1
    assert "giving up" in lines[-1]
    stack.stop()


def _fake_nvidia_smi(bin_dir: Path, listing: str) -> None:
    """An `nvidia-smi` in bin_dir that prints `listing` for -L (as on a host with those GPUs)."""
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\n")  # a builtin: PATH may hold nothing else
    script.chmod(0o755)


def test_gpus_are_parsed_from_a_list_cuda_visible_devices_or_nvidia_smi(tmp_path, monkeypatch):
    assert parse_gpus("0,1", environ={}) == ["0", "1"]
    assert parse_gpus(" 3 , 01 ", environ={"CUDA_VISIBLE_DEVICES": "5"}) == ["3", "1"]  # a list is taken as given
    for spec, reason in (("0,0", "named twice"), ("a", "device indices"), ("-1", "device indices"),
                         ("", "device indices"), ("GPU-1f2e", "device indices")):
        with pytest.raises(ValueError, match=reason):
            parse_gpus(spec, environ={})
    # `all` with CUDA_VISIBLE_DEVICES set: the devices it lists, up to the first entry CUDA stops at.
    assert parse_gpus("all", environ={"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert parse_gpus("ALL", environ={"CUDA_VISIBLE_DEVICES": "GPU-8f1c,MIG-77aa"}) == ["GPU-8f1c", "MIG-77aa"]
    assert parse_gpus("all", environ={"CUDA_VISIBLE_DEVICES": "1,-1,2"}) == ["1"]
    for hidden in ("", "-1", "none"):
        with pytest.raises(ValueError, match="no GPU found.*CUDA_VISIBLE_DEVICES"):
            parse_gpus("all", environ={"CUDA_VISIBLE_DEVICES": hidden})
    # Else what nvidia-smi -L lists: one "GPU i: ..." line per GPU (MIG devices are indented lines below theirs).
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ValueError, match="no GPU found.*nvidia-smi -L"):
        parse_gpus("all", environ={})  # no nvidia-smi at all
    _fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aa)\n"
                               "  MIG 3g.40gb Device 0: (UUID: MIG-bb)\nGPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-cc)\n")
    assert parse_gpus("all", environ={}) == ["0", "1"]


def test_up_refuses_gpus_it_cannot_use_before_starting_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    runner = CliRunner()

    def up(*args: str):
        return runner.invoke(main, ["up", "--port", str(free_port()), *args], env={"REDIS_URL": redis_url})

    done = up("--gpus", "all")
    assert done.exit_code == 1 and "--gpus all: no GPU found" in done.output, done.output
    done = up("--gpus", "0,1", "--workers", "3")
    assert done.exit_code == 1 and "--workers 3 with --gpus 0,1 (2 GPU(s): 0, 1)" in done.output, done.output
    done = up("--gpus", "0,x")
    assert done.exit_code == 1 and "expected `all` or CUDA device indices" in done.output, done.output
    assert up("--workers", "0").exit_code == 2  # a usage error
    assert not redis_answers(redis_url) and "mlxq is starting" not in done.output


def test_each_worker_gets_its_device_name_prompt_cache_and_budget():
    env = {"REDIS_URL": "redis://127.0.0.1:6390/0"}
    cache = "/store/prompt-cache/6390-0"
    # One worker on the default device: exactly the worker `mlxq up` always started.
    (lone,) = worker_plans(1, None, "mlxq-h-8000", env, cache)
    assert (lone.child, lone.argv()) == ("worker", [sys.executable, "-m", "workers.main"])
    assert lone.env == {**env, "MLXQ_PROMPT_CACHE_DIR": cache}

    gpu0, gpu1 = worker_plans(1, ["0", "1"], "mlxq-h-8000", env, cache)
    assert [gpu0.child, gpu1.child] == ["worker-gpu0", "worker-gpu1"]
    assert gpu0.env == {**env, "CUDA_VISIBLE_DEVICES": "0", "MLXQ_PROMPT_CACHE_DIR": f"{cache}-w0"}
    assert gpu1.env == {**env, "CUDA_VISIBLE_DEVICES": "1", "MLXQ_PROMPT_CACHE_DIR": f"{cache}-w1"}
    first, again = gpu1.argv(), gpu1.argv()
    assert first[:3] == [sys.executable, "-m", "workers.main"] and first[3] == "--name"
    # A name of its own at each start: a restarted worker under its predecessor's name would hide that one's death.
    assert first[4].startswith("mlxq-h-8000-gpu1-") and again[4].startswith("mlxq-h-8000-gpu1-")
    assert first[4] != again[4]

    (only,) = worker_plans(1, ["3"], "mlxq-h-8000", env, cache)  # one GPU: its own name, today's cache directory
    assert only.child == "worker-gpu3" and only.env["MLXQ_PROMPT_CACHE_DIR"] == cache
    uuids = worker_plans(1, ["GPU-8f1c", "MIG-77aa"], "s", env, cache)
    assert [(p.child, p.env["CUDA_VISIBLE_DEVICES"]) for p in uuids] == [("worker-gpu0", "GPU-8f1c"),
                                                                        ("worker-gpu1", "MIG-77aa")]

    shared = worker_plans(3, None, "mlxq-h-8000", env, "", budget_mb=1234)
    assert [p.child for p in shared] == ["worker-w0", "worker-w1", "worker-w2"]
    assert all(p.env == {**env, "MLXQ_PROMPT_CACHE_DIR": "", "MLXQ_MEMORY_BUDGET_MB": "1234"} for p in shared)
    assert shared[2].argv()[4].startswith("mlxq-h-8000-w2-")


def test_workers_sharing_a_device_share_the_default_budget():
    from workers.models import memory_budget_bytes
    from workers.platform import backend

    one = devstack.default_budget_bytes()
    assert one == memory_budget_bytes(0, backend())  # the worker's own default, found without MLX in `mlxq up`
    settings = load_settings(environ={})
    assert shared_budget_mb(settings, 3, None) == one // 3 // 2**20
    assert shared_budget_mb(settings, 1, None) is None  # a lone worker keeps its default
    assert shared_budget_mb(settings, 2, ["0", "1"]) is None  # a GPU each
    assert shared_budget_mb(settings.with_overrides(memory_budget_mb=900), 2, None) is None  # the operator's, each


def test_the_web_tier_takes_half_the_cores_from_two_to_eight(monkeypatch):
    for cores, expected in ((None, 2), (1, 2), (2, 2), (6, 3), (16, 8), (128, 8)):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        assert default_web_workers() == expected, cores


def test_the_banner_says_how_many_workers_and_where():
    settings = load_settings(environ={})
    base, url = "http://127.0.0.1:8000", "redis://127.0.0.1:6379/0"
    assert "  Workers     1 on the default device\n" in banner(base, url, settings)
    assert "the worker loads its model first" in banner(base, url, settings)
    assert "  Workers     2, one per GPU (0, 1)\n" in banner(base, url, settings, 2, ["0", "1"])
    text = banner(base, url, settings, 3, None, 1234)
    assert "  Workers     3 on the default device, 1234 MiB of memory budget each\n" in text
    assert "each worker loads its model first" in text


def test_workers_are_restarted_each_on_its_own_under_a_new_command_line(monkeypatch):
    monkeypatch.setattr(devstack, "RESTART_DELAY_S", 0.01)
    starts = []

    def argv(tag: str):
        starts.append(tag)
        return [sys.executable, "-c", "import time; time.sleep(120)", f"{tag}-{len(starts)}"]

    lines = []
    stack = Stack(log=lines.append)
    try:
        first = stack.start("worker-w0", lambda: argv("w0"))
        second = stack.start("worker-w1", lambda: argv("w1"))
        first.kill()
        first.wait(10)
        restarted = wait_until(lambda: not stack.supervise(time.monotonic()) and stack.children[0].process,
                               30, interval=0.02, what="worker-w0 to be restarted")
        assert restarted.pid != first.pid and restarted.poll() is None
        assert stack.children[1].process is second and second.poll() is None  # its sibling runs on untouched
        assert starts == ["w0", "w1", "w0"] and _cmdline(restarted.pid).endswith("w0-3 ")
        assert f"worker-w0 restarted (pid {restarted.pid})" in lines[-1]
    finally:
        stack.stop()


def test_two_workers_register_each_with_its_own_name_cache_and_budget(bare_env, tmp_path):
    """`mlxq up --workers 2` on a CPU: both workers register in the admin API, each under its own name, with its
    own prompt-cache directory and half the default budget; one killed with -9 comes back under a new name while
    the other runs on; SIGTERM stops everything."""
    port = free_port()
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    stem = f"mlxq-{socket.gethostname()}-{port}"
    everything: set[int] = set()
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "mlxq.cli", "up", "--port", str(port), "--web-workers", "1",
                               "--workers", "2"], env=bare_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        wait_until(functools.partial(_healthy, api, up), 120, interval=0.2, what="the web tier to answer")
        listed = wait_until(lambda: _workers(api, up, 2), READY_WITHIN_S, interval=0.2, what="two workers")
        names = sorted(listed)
        assert [n.rsplit("-", 1)[0] for n in names] == [f"{stem}-w0", f"{stem}-w1"], names
        assert {w["pid"] for w in listed.values()} == {p for p in _children(up.pid) if "workers.main" in _cmdline(p)}
        share = devstack.default_budget_bytes() // 2 // 2**20 * 2**20
        assert [w["budget_bytes"] for w in listed.values()] == [share, share]
        cache = tmp_path / "mlxq" / "prompt-cache" / f"{urlsplit(bare_env['REDIS_URL']).port}-0"
        for i, name in enumerate(names):  # each holds the lock of its own directory (none went without)
            assert (cache.parent / f"{cache.name}-w{i}" / ".lock").read_text().strip() == str(listed[name]["pid"])
        assert "  Workers     2 on the default device, " in log_path.read_text()
        everything.update(_descendants(up.pid))

        w0, w1 = (listed[n] for n in names)
        os.kill(w0["pid"], signal.SIGKILL)
        again = wait_until(lambda: (found := _workers(api, up, 2)) and w0["name"] not in found and found,
                           READY_WITHIN_S, interval=0.2, what="worker-w0 back under a new name")
        (new_w0,) = [w for n, w in again.items() if n != w1["name"]]
        assert new_w0["name"].startswith(f"{stem}-w0-") and new_w0["pid"] != w0["pid"]
        assert again[w1["name"]]["pid"] == w1["pid"]  # its sibling was not restarted
        assert f"worker-w0 (pid {w0['pid']}) exited with code -9" in log_path.read_text()
        everything.update(_descendants(up.pid))
    finally:
        api.close()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0, log_path.read_text()[-2000:]
    leftovers = [(pid, _cmdline(pid)) for pid in everything if _alive(pid)]
    assert not leftovers, leftovers


def _workers(api: httpx.Client, up: subprocess.Popen, count: int) -> dict[str, dict] | None:
    """The live workers the admin API lists, by name, once there are `count` of them (None before)."""
    assert up.poll() is None, f"mlxq up exited with code {up.returncode}"
    listed = {w["name"]: w for w in api.get("/v1/admin/workers").json()["data"]}
    return listed if len(listed) == count else None


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
