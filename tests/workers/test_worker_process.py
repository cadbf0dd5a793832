"""The worker: requests run by its scheduler in this process, and the real `python -m workers.main` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest
from rq.job import JobStatus

from jobs import contract, keys
from jobs.events import read_log
from jobs.queues import (
    BATCH,
    CHAT_COMPLETION,
    INTERACTIVE,
    TEXT_COMPLETION,
    enqueue,
    fetch_job,
    get_queue,
    new_job_id,
)
from jobs.store import resolve
from tests.conftest import REPO, wait_until
from workers.recovery import recover
from workers.scheduler import Scheduler

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Write a very long story about a dragon who learns to bake bread."}]
LOGS = REPO / ".pytest_cache" / "worker-logs"


def model_ref(settings, name: str = MODEL) -> contract.ModelRef:
    """The catalog entry the web tier would resolve, as a request carries it."""
    info = resolve(name, settings)
    return contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


def chat_request(settings, messages, max_tokens=40, model=None, **sampling) -> contract.TextRequest:
    """A chat request as the web tier builds it (already validated)."""
    return contract.TextRequest(new_job_id("chatcmpl"), model or model_ref(settings),
                                contract.Sampling(max_tokens=max_tokens, temperature=0.0, **sampling),
                                messages=messages)


def submit(conn, settings, request, func=CHAT_COMPLETION, queue=INTERACTIVE, timeout_s=3600) -> str:
    """Enqueue a request the way the web tier does; return its id."""
    enqueue(conn, settings, queue, func, contract.to_payload(request), request.id, timeout_s=timeout_s)
    return request.id


def terminal(conn, job_id, timeout: float) -> dict:
    """Wait (bounded) for the job's terminal event and return it."""
    def ended():
        return next((e for e in read_log(conn, job_id) if e["type"] in ("done", "error")), None)
    return wait_until(ended, timeout, interval=0.1, what=f"the terminal event of {job_id}")


def deltas(conn, job_id) -> str:
    """The text of the job's delta events, joined."""
    return "".join(e["data"]["text"] for e in read_log(conn, job_id) if e["type"] == "delta")


@pytest.fixture(scope="module")
def demo_model(models_dir):
    """Fail (not skip) when the demo model is missing."""
    if not (models_dir / MODEL / "config.json").exists():
        pytest.fail(f"demo model missing in {models_dir}: run `mlxq models pull-demo` first")
    return models_dir


# --- requests run by the scheduler in this process, in burst mode ------------------------------------

@pytest.fixture(scope="module")
def worker_parts(demo_model, text_worker_parts):
    """The session's model manager and backends, shared by the in-process tests (the demo model stays loaded:
    not loaded again for this module)."""
    return text_worker_parts


def burst(conn, settings, worker_parts) -> Scheduler:
    """Run every queued job with the worker's scheduler, then return it."""
    models, backends = worker_parts
    scheduler = Scheduler(conn, settings, models, backends, f"test-{uuid.uuid4().hex[:6]}", burst=True)
    scheduler.run()
    return scheduler


def test_chat_job_publishes_deltas_then_done(worker_parts, redis_conn, settings):
    job_id = submit(redis_conn, settings, chat_request(settings, FRANCE))
    burst(redis_conn, settings, worker_parts)
    done = terminal(redis_conn, job_id, 5)
    assert done["type"] == "done", done
    data = done["data"]
    assert data["model"] == MODEL and isinstance(data["created"], int)
    [choice] = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop" and "Paris" in choice["text"]
    assert deltas(redis_conn, job_id) == choice["text"]
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    job = fetch_job(redis_conn, job_id)
    assert job.get_status() == JobStatus.FINISHED and job.return_value() == data


def test_text_completion_job_gives_one_choice_per_prompt(worker_parts, redis_conn, settings):
    # Seeded: at temperature 1 an unseeded draw ends a prompt with EOS inside 3 tokens now and then.
    request = contract.TextRequest(new_job_id("cmpl"), model_ref(settings), contract.Sampling(max_tokens=3, seed=3),
                                   prompts=["The sky is", "One, two,"])
    job_id = submit(redis_conn, settings, request, func=TEXT_COMPLETION)
    burst(redis_conn, settings, worker_parts)
    data = terminal(redis_conn, job_id, 5)["data"]
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in data["choices"])
    assert data["usage"]["completion_tokens"] == 6
    by_index = {i: "".join(e["data"]["text"] for e in read_log(redis_conn, job_id)
                           if e["type"] == "delta" and e["data"]["index"] == i) for i in (0, 1)}
    assert by_index == {c["index"]: c["text"] for c in data["choices"]}


@pytest.mark.parametrize("model, messages, status, code", [
    ("gone", FRANCE, 404, "model_not_found"),
    ("whisper-tiny.en", FRANCE, 400, "invalid_model"),
    (MODEL, [{"role": "user", "content": "word " * 9000}], 400, "context_length_exceeded"),
])
def test_failing_jobs_publish_an_error_and_fail(worker_parts, redis_conn, settings, model, messages, status, code):
    ref = (contract.ModelRef("gone", str(settings.models_dir / "gone"), "text") if model == "gone"
           else model_ref(settings, model))
    job_id = submit(redis_conn, settings, chat_request(settings, messages, model=ref))
    burst(redis_conn, settings, worker_parts)
    error = terminal(redis_conn, job_id, 5)
    assert error["type"] == "error"
    assert error["data"]["status"] == status and error["data"]["code"] == code
    assert "Traceback" not in error["data"]["message"] and str(settings.models_dir) not in error["data"]["message"]
    assert fetch_job(redis_conn, job_id).get_status() == JobStatus.FAILED


def test_an_unreadable_payload_fails_its_job(worker_parts, redis_conn, settings):
    enqueue(redis_conn, settings, INTERACTIVE, CHAT_COMPLETION, {"kind": "text", "id": "x"}, "chatcmpl-bad")
    burst(redis_conn, settings, worker_parts)
    error = terminal(redis_conn, "x", 5)
    assert error["data"]["code"] == "invalid_request" and error["data"]["status"] == 400
    assert fetch_job(redis_conn, "chatcmpl-bad").get_status() == JobStatus.FAILED



def test_canceled_job_stops_with_a_canceled_error(worker_parts, redis_conn, settings):
    job_id = submit(redis_conn, settings, chat_request(settings, LONG, max_tokens=500))
    redis_conn.set(keys.cancel_flag(job_id), 1)  # canceled before the worker got to it
    burst(redis_conn, settings, worker_parts)
    error = terminal(redis_conn, job_id, 5)
    assert (error["data"]["code"], error["data"]["status"]) == ("canceled", 499)
    assert deltas(redis_conn, job_id) == ""


def test_a_cancel_while_generating_stops_the_job_at_the_next_delta(worker_parts, redis_conn, settings):
    # Each delta's publish reports a cancel, and the worker reads that reply a step later (deltas are published on
    # a thread beside the decode loop: workers/backends/publishing.py): a few more deltas at most go out after it.
    job_id = submit(redis_conn, settings, chat_request(settings, LONG, max_tokens=500))
    last_id_before_flag = []

    def cancel_after_the_first_delta():
        wait_until(lambda: deltas(redis_conn, job_id), 120, 0.005, what="the first delta")
        last_id_before_flag.append(read_log(redis_conn, job_id)[-1]["id"])
        redis_conn.set(keys.cancel_flag(job_id), 1, ex=60)

    watcher = threading.Thread(target=cancel_after_the_first_delta, daemon=True)
    watcher.start()
    burst(redis_conn, settings, worker_parts)
    watcher.join(5)
    error = terminal(redis_conn, job_id, 5)
    assert (error["data"]["code"], error["data"]["status"]) == ("canceled", 499)
    after = [e for e in read_log(redis_conn, job_id) if e["type"] == "delta" and e["id"] > last_id_before_flag[0]]
    # one may race the flag, one more is handed over before the reply is read, and two may wait to be sent
    assert len(after) <= 4, f"{len(after)} deltas went out after the cancel"


def test_a_job_past_its_time_limit_ends_with_504_between_two_pieces(worker_parts, redis_conn, settings):
    job_id = submit(redis_conn, settings, chat_request(settings, LONG, max_tokens=2000), timeout_s=1)
    started = time.monotonic()
    burst(redis_conn, settings, worker_parts)
    error = terminal(redis_conn, job_id, 5)
    assert (error["data"]["code"], error["data"]["status"]) == ("job_timeout", 504)
    assert time.monotonic() - started < 30
    assert fetch_job(redis_conn, job_id).get_status() == JobStatus.FAILED


def test_interactive_jobs_are_taken_before_batch_jobs(worker_parts, redis_conn, settings):
    batch_id = submit(redis_conn, settings, chat_request(settings, FRANCE, max_tokens=2), queue=BATCH)
    now_id = submit(redis_conn, settings, chat_request(settings, FRANCE, max_tokens=2))
    burst(redis_conn, settings, worker_parts)
    assert fetch_job(redis_conn, now_id).started_at <= fetch_job(redis_conn, batch_id).started_at
    assert terminal(redis_conn, batch_id, 5)["type"] == terminal(redis_conn, now_id, 5)["type"] == "done"


def test_recovery_fails_the_call_a_dead_worker_was_generating(worker_parts, redis_conn, settings):
    # A worker dies mid-call, in process: its scheduler starts the call and streams, then is dropped without
    # ending it (it never had a liveness key: dead). A live worker's recovery fails the call for good, as
    # its caller waits now, not later: the error event, the RQ job failed and out of the started registry.
    # End to end (the process killed with -9, the web failing the waiting calls, the restarted worker's
    # recovery): tests/integration/test_faults.py.
    job_id = submit(redis_conn, settings, chat_request(settings, LONG, max_tokens=2000))
    models, backends = worker_parts
    dead = Scheduler(redis_conn, settings, models, backends, "test-dead-worker", burst=True)
    wait_until(lambda: dead.step() and deltas(redis_conn, job_id), 120, interval=0, what="the first delta")
    assert fetch_job(redis_conn, job_id).get_status() == JobStatus.STARTED
    assert recover(redis_conn, settings, own_name="a-live-worker") == [job_id]
    error = terminal(redis_conn, job_id, 5)
    assert error["type"] == "error" and error["data"]["code"] == "worker_died" and error["data"]["status"] == 500
    assert fetch_job(redis_conn, job_id).get_status() == JobStatus.FAILED
    assert job_id not in get_queue(INTERACTIVE, redis_conn).started_job_registry.get_job_ids(cleanup=False)
    for task in dead.active():  # what the dead process held goes with it
        dead.release(task)


# --- the real worker process --------------------------------------------------------------------------

class WorkerProcess:
    """`python -m workers.main` with a known name, its output in a log file."""

    def __init__(self, redis_url: str, models_dir):
        self.name = f"test-worker-{uuid.uuid4().hex[:8]}"
        self.env = {**os.environ, "REDIS_URL": redis_url, "MLXQ_REDIS_URL": redis_url,
                    "MLXQ_MODELS_DIR": str(models_dir), "PYTHONUNBUFFERED": "1"}
        LOGS.mkdir(parents=True, exist_ok=True)
        self.log_path = LOGS / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{self.name}.log"
        self.process: subprocess.Popen | None = None

    def start(self, conn, timeout: float = 180) -> "WorkerProcess":
        """Start it and wait until its liveness key appears (after the default model is warm)."""
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "workers.main", "--name", self.name], cwd=REPO,
                                            env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        wait_until(lambda: self._check_running() and conn.exists(self.alive_key), timeout, interval=0.1,
                   what=f"worker {self.name} to come alive")
        return self

    @property
    def alive_key(self) -> str:
        """The worker's liveness key."""
        return keys.worker_alive(self.name)

    def _check_running(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"worker exited with {self.process.returncode}:\n{self.tail()}")
        return True

    def stop(self) -> None:
        """Make sure the process is gone (tests end it themselves; this is the safety net)."""
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def tail(self, n: int = 40) -> str:
        """The end of its log."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


@pytest.fixture()
def spawn(redis_url, demo_model):
    """Start worker processes; every one is killed at the end of the test."""
    started = []

    def start(conn) -> WorkerProcess:
        worker = WorkerProcess(redis_url, demo_model)
        started.append(worker)
        return worker.start(conn)
    yield start
    for worker in started:
        worker.stop()


def first_delta(conn, job_id, timeout: float = 60) -> None:
    """Wait (bounded) until the job streams its first delta: it is running."""
    wait_until(lambda: any(e["type"] == "delta" for e in read_log(conn, job_id)), timeout, interval=0.05,
               what=f"the first delta of {job_id}")


def test_worker_process_answers_chat_jobs_and_sigterm_lets_the_running_ones_finish(spawn, redis_conn, settings):
    # One process for both stories (each start loads the model): two chats decode together, and a SIGTERM
    # while they run ends the process cleanly once both are answered.
    worker = spawn(redis_conn)
    france_id = submit(redis_conn, settings, chat_request(settings, FRANCE))
    # 16 tokens: the stop comes at the first, 15 are left to finish (30 only made the test wait for 14 more).
    long_id = submit(redis_conn, settings, chat_request(settings, LONG, max_tokens=16))
    first_delta(redis_conn, long_id)  # taken after the first (one queue, in order): both are running
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(120) == 0, worker.tail()

    done = terminal(redis_conn, france_id, 1)
    assert done["type"] == "done", worker.tail()
    assert "Paris" in done["data"]["choices"][0]["text"]
    assert deltas(redis_conn, france_id) == done["data"]["choices"][0]["text"]
    done = terminal(redis_conn, long_id, 1)
    assert done["type"] == "done" and done["data"]["choices"][0]["finish_reason"] == "length"
    assert deltas(redis_conn, long_id) == done["data"]["choices"][0]["text"]
    assert [fetch_job(redis_conn, i).get_status() for i in (france_id, long_id)] == [JobStatus.FINISHED] * 2
    assert not redis_conn.exists(worker.alive_key), "a clean exit removes the liveness key"
    log = worker.log_path.read_text()
    assert f"worker {worker.name} on queues interactive,batch" in log and "BLAS" in log and "budget" in log
    assert log.index("SIGTERM: warm stop") < log.index(f"finished {long_id}"), "the stop came while it ran"
