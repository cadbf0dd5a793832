"""The whole service for integration tests: real Redis, the real worker, gunicorn with gevent."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from jobs import workers
from mlxq.cli import gunicorn_argv
from tests.conftest import REPO, free_port, wait_until

LOGS = REPO / ".pytest_cache" / "service-logs"


def service_env(redis_url: str, models_dir: Path, spool_dir: Path, **extra) -> dict:
    """Environment for the service's processes under test, spooling uploads in `spool_dir`."""
    # A spool of its own: the default one (~/.cache/mlxq/spool) is shared with every other mlxq on the
    # machine, whose uploads would come and go under the tests that check theirs are removed.
    env = {**os.environ, "REDIS_URL": redis_url, "MLXQ_REDIS_URL": redis_url, "MLXQ_MODELS_DIR": str(models_dir),
           "MLXQ_SPOOL_DIR": str(spool_dir), "PYTHONUNBUFFERED": "1"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Proc:
    """A service process with its output in a log file (shown when a test fails)."""

    def __init__(self, name: str, argv: list[str], env: dict):
        self.name, self.argv, self.env = name, argv, env
        self.process: subprocess.Popen | None = None
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log_path = LOGS / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{name}.log"

    def start(self) -> "Proc":
        """Start the process (appending to its log)."""
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        return self

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process is not None and self.process.poll() is None

    def kill9(self) -> None:
        """SIGKILL the process (and its group) and reap it."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, wait, SIGKILL if needed; return the exit code."""
        if not self.alive():
            return self.process.returncode if self.process else 0
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return -9

    def tail(self, n: int = 60) -> str:
        """The last lines of the process's log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def stop_all(procs: list[Proc]) -> None:
    """Stop the processes at once, each waiting for its own exit (one after the other, their waits add up)."""
    with ThreadPoolExecutor(max_workers=len(procs)) as pool:
        list(pool.map(Proc.stop, procs))


class Service:
    """Worker + web on one Redis and a private spool; `base_url` is the API's address."""

    def __init__(self, redis_url: str, models_dir: Path, **extra_env):
        self.redis_url = redis_url
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.spool_dir = Path(tempfile.mkdtemp(prefix="mlxq-test-spool-"))
        self.env = env = service_env(redis_url, models_dir, self.spool_dir, **extra_env)
        self.worker = Proc("worker", [sys.executable, "-m", "workers.main"], env)
        self.web = Proc("web", gunicorn_argv("127.0.0.1", self.port, 1), env)

    def start(self) -> "Service":
        """Start both processes and wait until /ready says a worker is alive."""
        self.worker.start()
        self.web.start()
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 180) -> None:
        """Wait until the API answers /ready with 200 and this worker beats (alive, model warm).

        /ready alone is not enough after a kill -9: the dead worker's liveness key outlives it by up
        to 6 s, and a call sent then would be refused (no_worker) once that key expires.
        """
        conn = redis.Redis.from_url(self.redis_url)

        def ready():
            if not self.worker.alive() or not self.web.alive():
                raise AssertionError(f"service died:\n{self.worker.tail()}\n{self.web.tail()}")
            if not any(s.get("pid") == self.worker.process.pid for s in workers.states(conn)):
                return False
            try:
                return httpx.get(self.base_url + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, timeout, interval=0.2, what="the service to become ready")

    def wait_web(self, timeout: float = 60) -> None:
        """Wait until the web tier answers /health (fails at once if it died)."""
        def up() -> bool:
            if not self.web.alive():
                raise AssertionError(f"the web tier died:\n{self.web.tail()}")
            try:
                return httpx.get(self.base_url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, timeout, interval=0.1, what="the web tier")

    def restart_worker(self) -> None:
        """Start a fresh worker after a test stopped or killed it."""
        self.worker.stop()
        self.worker.start()
        self.wait_ready()

    def stop(self) -> None:
        """Stop web and worker at once; remove the spool."""
        stop_all([self.web, self.worker])
        shutil.rmtree(self.spool_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def service(redis_url, models_dir):
    """The running service, shared by the integration tests (tests that kill the worker restart it)."""
    if not (models_dir / "smollm2-135m").exists():
        pytest.fail(f"demo model missing in {models_dir}: run `make test` or `mlxq models pull-demo` first")
    # Database 1: the running worker must never take the jobs other tests enqueue on database 0.
    service_url = redis_url.rsplit("/", 1)[0] + "/1"
    redis.Redis.from_url(service_url).flushdb()
    svc = Service(service_url, models_dir, MLXQ_WEBHOOK_ALLOW_PRIVATE=1, MLXQ_WEBHOOK_SECRET="test-secret",
                  MLXQ_BODY_TIMEOUT_S=3, MLXQ_IMAGE_FETCH_ALLOW_PRIVATE=1, MLXQ_IMAGE_FETCH_TIMEOUT_S=3,
                  MLXQ_AUDIO_FETCH_ALLOW_PRIVATE=1,
                  MLXQ_SPEECH_BATCH=2).start()  # a minute of speech makes two batches: a checkpoint between them
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def web_only(redis_url, models_dir):
    """The web tier alone, no worker, on a Redis database of its own (no worker's heartbeat in it)."""
    url = redis_url.rsplit("/", 1)[0] + "/8"
    redis.Redis.from_url(url).flushdb()
    svc = Service(url, models_dir)
    svc.web.start()
    svc.wait_web()
    yield svc
    svc.stop()


@pytest.fixture()
def api(service):
    """An httpx client on the running API."""
    with httpx.Client(base_url=service.base_url, timeout=120) as client:
        yield client


@pytest.fixture()
def openai_client(service):
    """The official openai client pointed at the running service."""
    import openai

    return openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def pytest_collection_modifyitems(items):
    """Schemathesis names its items by operation but gives them all one node id; pytest-xdist schedules by
    node id, so it ran one operation of 22. Each gets the operation in its id."""
    for item in items:
        label = getattr(item, "operation_label", None)
        if label and not item.nodeid.endswith(f"[{label}]"):
            if hasattr(item, "_id"):  # pytest 9: a structured id
                from _pytest.nodes import coerce_node_id

                item._id = coerce_node_id(f"{item.nodeid}[{label}]")
            else:
                item._nodeid = f"{item.nodeid}[{label}]"
