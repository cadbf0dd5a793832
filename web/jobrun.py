"""Running a synchronous call as a job: enqueue it, then wait for its result or stream its events.

A call that no live worker can take is refused (503 `no_worker`, web/routing.py), and one whose
workers all went away while it waited in the queue is taken out of it and answered the same way.
A short Redis outage is ridden out (jobs/subscriber.py replays what was published meanwhile); a
longer one ends the wait with 503 `queue_unavailable`, an error event in a stream.
"""

from __future__ import annotations

import logging
import select
import socket
import time
from typing import Iterator

import redis
from flask import Response, g, request
from rq.job import JobStatus

from jobs import limits, queues, records, spool
from jobs.contract import Request, to_payload
from jobs.events import DONE, ERROR
from jobs.lifecycle import end, fail_if_orphaned, request_cancel
from jobs.queues import fetch_job
from jobs.subscriber import IDLE, REDIS_DOWN, follow
from web import ratelimit
from web.auth import caller
from web.errors import APIError
from web.render.base import Renderer
from web.render.sse import event_stream, sse_comment
from web.routing import any_worker_live, any_worker_takes, no_worker, queue_for
from web.services import Services, services

log = logging.getLogger(__name__)

KEEPALIVE_S = 5.0
"""Seconds between SSE comments while nothing happens (also how a gone client is noticed)."""

CLIENT_CHECK_S = 1.0
"""How often a non-streamed call looks whether its client is still connected."""

RETRY_AFTER_S = 5
"""The Retry-After of a 503 (no worker, Redis away, the worker shutting down)."""

NO_WORKER_NOTE = "No MLX worker is running now: the job waits in the queue until one starts."
"""What an async job's answer says when it was queued with no live worker."""

QUEUE_UNAVAILABLE = {"status": 503, "code": "queue_unavailable",
                     "message": "The queue (Redis) became unreachable while this call waited; retry later."}
"""The error event of a stream whose wait outlasted a Redis outage (jobs.subscriber.OUTAGE_S)."""


def submit(request: Request, func: str, description: str, queue: str = queues.INTERACTIVE,
           timeout_s: int | None = None, meta: dict | None = None) -> str:
    """Enqueue a request under its id (a synchronous call's by default: on `interactive`, or that lane's
    queue for the model's dedicated workers: web/routing.py); return the id."""
    svc = services()
    timeout_s = timeout_s or int(svc.settings.sync_timeout_s) + 60
    try:
        queue = queue_for(queue, request.model.id)
        queues.enqueue(svc.redis, svc.settings, queue, func, to_payload(request), request.id,
                       description=description, timeout_s=timeout_s,
                       meta={"request_id": g.request_id, "owner": caller().owner, **ratelimit.share_meta(),
                             **(meta or {})})
    except BaseException:
        spool.discard(svc.settings.spool_dir, request.id)  # never enqueued: nothing else will remove it
        raise
    return request.id


def submit_recorded(request: Request, kind: str, fields: dict, func: str, description: str,
                    queue: str = queues.INTERACTIVE, timeout_s: int | None = None, meta: dict | None = None,
                    listed: bool = True, conversation: list[dict] | None = None) -> None:
    """A job that keeps a record (owned by the caller; `listed` by /v1/jobs), which its lifecycle ends:
    create the record, then enqueue the job; the record says failed if that is refused."""
    svc = services()
    records.create(svc.redis, svc.settings, request.id, kind, {**fields, "owner": caller().owner}, listed=listed,
                   conversation=conversation)
    try:
        submit(request, func, description, queue=queue, timeout_s=timeout_s, meta=meta)
    except Exception as exc:
        records.set_status(svc.redis, svc.settings, request.id, "failed",
                           error={"message": f"Not enqueued: {exc}", "code": "not_enqueued", "status": 503})
        raise


def submit_async(request: Request, kind: str, fields: dict, func: str, description: str, timeout_s: int,
                 meta: dict, conversation: list[dict] | None = None) -> str | None:
    """An async job: its record, then the job on `batch` (or the model's own batch queue). Returns a note
    for the client when no worker is live to take it (it waits for one), else None. A key at its `queued`
    limit (jobs/limits.py) is answered 429."""
    svc, who = services(), caller()
    if not who.admin:
        ratelimit.admit_async(svc, who.owner, request.id)
    try:
        submit_recorded(request, kind, fields, func, description, queues.BATCH, timeout_s, meta,
                        conversation=conversation)
    except Exception:
        limits.job_ended(svc.redis, who.owner, request.id)  # never queued: it does not count
        raise
    return None if any_worker_live(svc) else NO_WORKER_NOTE


def _events(svc: Services, job_id: str, deadline: float) -> Iterator[dict]:
    """Follow the job's events, failing it when its worker died or no worker is left to take it; IDLE
    past the deadline raises 504."""

    def on_idle():
        if not fail_if_orphaned(svc.redis, svc.settings, job_id):
            fail_if_unserved(svc, job_id)

    for event in follow(svc.hub, job_id, on_idle=on_idle):
        if event is IDLE and time.monotonic() > deadline:
            raise APIError(504, f"The job {job_id} did not finish within {svc.settings.sync_timeout_s:g}s; "
                           "it keeps running in the background.", "timeout", job_id=job_id)
        yield event


def fail_if_unserved(svc: Services, job_id: str) -> bool:
    """End a call still queued that no live worker takes (503 `no_worker`); True if so.

    It is taken out of its queue too: a worker that starts later must not spend itself on an
    answer nobody waits for.
    """
    job = fetch_job(svc.redis, job_id)
    if job is None or job.get_status(refresh=False) != JobStatus.QUEUED or any_worker_takes(svc, job.origin):
        return False
    log.info("no live worker takes %s from %s; ending it", job_id, job.origin)
    request_cancel(svc.redis, job_id, svc.settings.result_ttl_s)
    gone = no_worker()
    # A call may keep a record (a stored response): it ends too.
    return end(svc.redis, svc.settings, job_id, error={"message": gone.message, "code": gone.code,
                                                        "status": gone.status})


def error_from_event(data: dict) -> APIError:
    """Turn a worker's error event into the APIError the client sees (a 503 says when to retry)."""
    status = int(data.get("status") or 500)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return APIError(status, data.get("message", "The job failed."), data.get("code"), data.get("param"),
                    headers=headers)


def wait_for_result(job_id: str) -> dict:
    """Block until the job's terminal event; return the `done` data or raise its error.

    Every CLIENT_CHECK_S it looks whether the client is still there; if it hung up, the job is
    canceled (nobody would read its answer) and a 499 ends the request.
    """
    svc = services()
    deadline = time.monotonic() + svc.settings.sync_timeout_s
    next_check = time.monotonic() + CLIENT_CHECK_S
    for event in _events(svc, job_id, deadline):
        if event["type"] == DONE:
            return event["data"]
        if event["type"] == ERROR:
            raise error_from_event(event["data"])
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + CLIENT_CHECK_S
            if client_gone():
                log.info("client of %s hung up; canceling it", job_id)
                request_cancel(svc.redis, job_id, svc.settings.result_ttl_s)
                raise APIError(499, "The client closed the connection; the job was canceled.", "canceled")
    raise APIError(500, "The event stream ended without a result.", "internal_error")


def client_gone() -> bool:
    """Whether the client of this request closed its connection (gunicorn only; never blocks)."""
    sock = request.environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        # Readable with nothing to read is the end of the stream: the client closed its side.
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed
        return True


def _cancel_quietly(svc: Services, job_id: str) -> None:
    """Ask for the job to stop; with Redis away nothing can be asked (it expires with its timeout)."""
    try:
        request_cancel(svc.redis, job_id, svc.settings.result_ttl_s)
    except redis.RedisError as exc:
        log.warning("could not cancel %s: %s", job_id, exc)


def answer(job_id: str, renderer: Renderer) -> Response:
    """The whole answer, once the job is done, in the renderer's API's shape."""
    return renderer.answer(wait_for_result(job_id))


def stream_response(job_id: str, renderer: Renderer) -> Response:
    """An SSE response: `renderer` frames each worker event; a disconnect cancels the job."""
    svc = services()
    deadline = time.monotonic() + svc.settings.sync_timeout_s

    def generate():
        finished = False
        last_write = time.monotonic()
        try:
            for event in _events(svc, job_id, deadline):
                if event is IDLE:
                    if time.monotonic() - last_write >= KEEPALIVE_S:
                        last_write = time.monotonic()
                        yield sse_comment()
                    continue
                if event["type"] == ERROR:
                    finished = True
                    yield renderer.error_frame(event["data"])
                    break
                for chunk in renderer.frames(event):
                    last_write = time.monotonic()
                    yield chunk
                if event["type"] == DONE:
                    finished = True
        except APIError as exc:
            finished = True
            yield renderer.error_frame({"status": exc.status, "message": exc.message, "code": exc.code, **exc.extra})
        except REDIS_DOWN as exc:  # away past follow's bound: say so, and end the stream properly
            log.warning("stream of %s: Redis unreachable (%s)", job_id, exc)
            yield renderer.error_frame(QUEUE_UNAVAILABLE)
        finally:
            if not finished:  # the client went away (or Redis did): stop spending the GPU on it
                log.info("stream of %s ended early; canceling it", job_id)
                _cancel_quietly(svc, job_id)
        yield from renderer.closing()

    return event_stream(generate())
