"""One job's life, for synchronous calls and async jobs alike: start, events, end; cancel; a dead worker.

However a job ends (done, failed, canceled, timed out, its worker dead), `end` does the same four
things in the same order: the async job's record (result or error, final status), its webhook,
what the job no longer needs (its checkpoint and its spooled upload), and last the terminal event:
a client who sees it finds the record final and nothing of the job left on disk. The worker ends the jobs it
runs; readers (the web tier) and a starting worker end the jobs whose worker died.

A job run in pieces checkpoints through its `JobRun` (jobs/checkpoints.py) and goes on elsewhere in
one way, `continue_job`, whether its worker stopped or died.
"""

from __future__ import annotations

import json
import os
import socket
import time

import redis
from rq.job import JobStatus

from jobs import checkpoints, contract, keys, limits, queues, records, spool
from jobs.errors import Canceled, WorkerDied, error_data
from jobs.events import DELTA, DONE, ERROR, PROGRESS, EventPublisher, decode, has_ended
from jobs.queues import fetch_job
from jobs.settings import Settings
from jobs.webhooks import enqueue_delivery

CONTINUATION_TIMEOUT_S = 3600
"""RQ timeout of a continuation when the interrupted job's own timeout is unknown."""


def publisher_for(conn: redis.Redis, settings: Settings) -> EventPublisher:
    """An event publisher with the settings' log TTL and cap."""
    return EventPublisher(conn, settings.result_ttl_s, settings.event_log_max)


def end(conn: redis.Redis, settings: Settings, job_id: str, *, result: dict | None = None,
        error: dict | None = None, done: dict | None = None, before: list | None = None,
        has_record: bool = True) -> bool:
    """End a job: record, webhook, cleanup, then the terminal event (`done`, else `error`); False if it had ended.

    `result`: what an async job's record keeps (defaults to `done`); `before`: events to publish just
    before the terminal one, in the same round trip; `has_record`: False for a synchronous call (it
    has none), which saves looking.
    """
    status = records.SUCCEEDED if error is None else records.status_of_error(error)
    if has_record:
        _record_end(conn, settings, job_id, status, result if result is not None else done, error)
    terminal = (DONE, done or {}) if error is None else (ERROR, error)
    return _close(conn, settings, [(job_id, [*(before or []), terminal])])[0]


def end_calls(conn: redis.Redis, settings: Settings, answers: list[tuple[str, dict, list | None]]) -> None:
    """End several synchronous calls (no record) with their answers, each (job id, `done`, the events `before` it),
    as `end` does, in two round trips however many: 64 chats ending at one step took two each, one after another,
    and the last client's answer waited for all of them."""
    _close(conn, settings, [(job_id, [*(before or []), (DONE, done or {})]) for job_id, done, before in answers])


def _close(conn: redis.Redis, settings: Settings, ends: list[tuple[str, list]]) -> list[bool]:
    """Drop ended jobs' checkpoints and spooled files, then publish each one's last events, its terminal one last
    (two round trips however many); whether each was published (not when another party had ended it first: its
    record then follows the logged terminal event)."""
    if not ends:
        return []
    checkpoints.discard_many(conn, [job_id for job_id, _ in ends])
    for job_id, _ in ends:
        spool.discard(settings.spool_dir, job_id)
    published = [bool(last_id) for last_id, _ in publisher_for(conn, settings).publish_all(ends)]
    for (job_id, _), ok in zip(ends, published, strict=True):
        if not ok:
            settle(conn, settings, job_id, force=True)
    return published


def _record_end(conn: redis.Redis, settings: Settings, job_id: str, status: str, result: dict | None,
                error: dict | None) -> None:
    """Put an async job's record (if it has one) in its final status and enqueue its webhook once."""
    record = records.load(conn, job_id)
    if record is None:
        return
    limits.job_ended(conn, record.get("owner") or "", job_id)
    if result is not None and status == records.SUCCEEDED:
        records.set_result(conn, settings, job_id, result)
    records.set_status(conn, settings, job_id, status, error=error)
    if record.get("webhook_url"):
        enqueue_delivery(conn, settings, job_id)


class JobRun:
    """The worker's handle on the job it runs: its events, progress and end."""

    def __init__(self, conn: redis.Redis, settings: Settings, job_id: str, rq_job_id: str | None = None,
                 has_record: bool = True):
        self.conn, self.settings, self.job_id = conn, settings, job_id
        self.rq_job_id = rq_job_id or job_id
        self.has_record = has_record  # an async job's; a synchronous call has none
        self.publisher = publisher_for(conn, settings)
        self.ended = False
        self.first_output_at: float | None = None  # wall clock of its first delta (time to first token)

    def start(self, attempts: int | None = None) -> None:
        """Mark an async job's record running (and which RQ job runs it)."""
        if not self.has_record or records.load(self.conn, self.job_id) is None:
            return
        records.set_status(self.conn, self.settings, self.job_id, records.RUNNING)
        fields = {"rq_job_id": self.rq_job_id, **({"attempts": attempts} if attempts else {})}
        records.update(self.conn, self.job_id, **fields)

    def publish(self, events: list[tuple[str, dict]]) -> None:
        """Publish events in one round trip; raise Canceled if the client asked to cancel the job."""
        if self.first_output_at is None and any(kind == DELTA for kind, _ in events):
            self.first_output_at = time.time()
        if events and self.publisher.publish_many(self.job_id, events)[1]:
            raise Canceled("the job was canceled")

    def progress(self, data: dict) -> None:
        """Publish a progress event and keep it in the record."""
        self.publish([(PROGRESS, data)])
        records.update(self.conn, self.job_id, progress=data)

    def check_cancel(self) -> None:
        """Raise Canceled if the client asked to cancel the job."""
        if self.conn.exists(keys.cancel_flag(self.job_id)):
            raise Canceled("the job was canceled")

    def restore(self, resume: bool) -> checkpoints.Saved | None:
        """The checkpoint a resumed job goes on from (None: it starts from the beginning, and any old state goes)."""
        saved = checkpoints.load(self.conn, self.job_id) if resume else None
        if saved is None:
            checkpoints.restart(self.conn, self.job_id)
        return saved

    def checkpoint(self, state: dict, items: list[dict], events: list[tuple[str, dict]]) -> None:
        """Keep a piece's items and the state after it, then publish the piece's events (Canceled as `publish`)."""
        stored = checkpoints.save(self.conn, self.settings, self.job_id, items, state)
        self.publish(events)
        checkpoints.mark_published(self.conn, self.job_id, stored)

    def checkpointed(self) -> list[dict]:
        """Every item checkpointed so far, in order, across the runs of a resumed job."""
        return checkpoints.items(self.conn, self.job_id)

    def finish(self, done: dict, result: dict | None = None, before: list | None = None) -> None:
        """End the job with `done` (an async record keeps `result`, by default `done`)."""
        self.ended = True
        end(self.conn, self.settings, self.job_id, done=done, result=result, before=before,
            has_record=self.has_record)

    def fail(self, exc: BaseException) -> dict:
        """End the job with the error `exc` means to a client; return the error event's data."""
        self.ended = True
        data = error_data(exc)
        end(self.conn, self.settings, self.job_id, error=data, has_record=self.has_record)
        return data


def continue_job(conn: redis.Redis, settings: Settings, request: contract.TranscriptionRequest, *, queue: str | None,
                 func: str | None, timeout_s: float | None, attempts: int | None = None, owner: str = "") -> str:
    """Go on with an accepted job from its checkpoint, in a continuation "<id>_<n>" at the front of its batch
    queue (`queue` if it is one, a model's own, else the shared one); return the continuation's RQ id.

    The one way a job resumes: handed back by a worker that stops (or lost Redis), or restarted after its
    worker died (`attempts` then counts the new start).
    """
    attempts = attempts or request.attempts
    number = checkpoints.next_continuation(conn, request.id)
    rq_id, func = f"{request.id}_{number}", func or queues.TRANSCRIPTION
    lane_queue = queue if queue and queues.lane_of(queue) == queues.BATCH else queues.BATCH
    payload = {**contract.to_payload(request), "resume": True, "attempts": attempts}
    # Work already accepted: the queue's length limit is for new work.
    queues.enqueue(conn, settings, lane_queue, func, payload, rq_id, limited=False, at_front=True,
                   description=f"{func} {request.id} (continuation {number})",
                   timeout_s=int(timeout_s or CONTINUATION_TIMEOUT_S),
                   meta={"job_id": request.id, "continuation": number, "owner": owner})
    records.update(conn, request.id, attempts=attempts, rq_job_id=rq_id)
    return rq_id


def request_cancel(conn: redis.Redis, job_id: str, ttl_s: int) -> None:
    """Ask for a job to stop: flag it for the worker, and drop it from its queue if not started."""
    conn.set(keys.cancel_flag(job_id), 1, ex=ttl_s)
    job = fetch_job(conn, job_id)
    if job is not None and job.get_status() in (JobStatus.QUEUED, JobStatus.DEFERRED, JobStatus.SCHEDULED):
        job.cancel()


def cancel_queued(conn: redis.Redis, settings: Settings, job_id: str) -> bool:
    """Cancel a job: True if it never started and is now ended (else its worker stops it)."""
    request_cancel(conn, job_id, settings.result_ttl_s)
    job = fetch_job(conn, job_id)
    if job is not None and job.get_status() != JobStatus.CANCELED:
        return False
    end(conn, settings, job_id, error=Canceled("Canceled by the client.").as_data())
    return True


def fail_if_orphaned(conn: redis.Redis, settings: Settings, job_id: str) -> bool:
    """End a job whose worker died (or that vanished) with an error event; True if so.

    Safe to call from many readers at once: only the first terminal event of a job is kept.
    """
    if has_ended(conn, job_id):
        return False
    job = fetch_job(conn, job_id)
    if job is None:
        reason = {"message": "The job no longer exists (expired or deleted).", "code": "job_lost", "status": 500}
    elif job.get_status(refresh=False) == JobStatus.STARTED and worker_is_dead(conn, job.worker_name):
        reason = WorkerDied("The worker died while running this job.").as_data()
    elif job.get_status(refresh=False) in (JobStatus.FAILED, JobStatus.STOPPED):
        reason = {"message": "The job failed in the worker.", "code": "job_failed", "status": 500}
    elif job.get_status(refresh=False) == JobStatus.CANCELED:
        reason = Canceled("The job was canceled.").as_data()
    else:
        return False
    end(conn, settings, job_id, error=reason)
    return True


def settle(conn: redis.Redis, settings: Settings, job_id: str, force: bool = False) -> bool:
    """Make an async job's record match its logged terminal event; True when it changed the record.

    For a job ended by someone other than its worker (a reader noticing a dead worker). `force`
    rewrites a record already final (its worker finished it just after another party ended it).
    """
    record = records.get(conn, job_id)
    if record is None or not has_ended(conn, job_id) or (record["status"] in records.TERMINAL and not force):
        return False
    raw = conn.lindex(keys.event_log(job_id), -1)  # the terminal event is always the last one
    terminal = decode(raw) if raw else {"type": ERROR, "data": {"message": "The job's events expired."}}
    data = terminal["data"]
    if terminal["type"] == DONE:
        _record_end(conn, settings, job_id, records.SUCCEEDED, data.get("result", data), None)
    else:
        _record_end(conn, settings, job_id, records.status_of_error(data), None, data)
    return True


# --- liveness ------------------------------------------------------------------------------------

def host_identity() -> str:
    """This host and PID namespace: a PID is only meaningful within both."""
    try:
        return f"{socket.gethostname()}|{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def liveness_value(worker_name: str) -> str:
    """What a worker stores in its liveness key: where it runs, so a local reader can check its PID."""
    return json.dumps({"host": host_identity(), "pid": os.getpid(), "name": worker_name})


def worker_is_dead(conn: redis.Redis, worker_name: str | None) -> bool:
    """Dead: its liveness key expired, or it ran on this host and its process is gone (no need to wait)."""
    raw = conn.get(keys.worker_alive(worker_name or ""))
    if raw is None:
        return True
    try:
        alive = json.loads(raw)
    except ValueError:
        return False
    pid = alive.get("pid") if isinstance(alive, dict) and alive.get("host") == host_identity() else None
    # Our own PID under another worker's name: that worker died and its PID was reused (containers).
    return isinstance(pid, int) and (pid == os.getpid() or not _pid_running(pid))


def any_worker_alive(conn: redis.Redis) -> bool:
    """Whether at least one mlxq worker is alive."""
    return next(conn.scan_iter(match=keys.WORKER_ALIVE_PATTERN, count=100), None) is not None


def _pid_running(pid: int) -> bool:
    """Whether a process with this PID exists here."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
