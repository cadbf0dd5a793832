"""Async job records: status, progress, result and timestamps of a job, readable by its id.

A record is independent of RQ's job ids because a long job runs as several RQ jobs (a first run,
then continuations after it yielded to interactive work or after a worker crash); the record
names the current one in `rq_job_id`. Every field of the hash holds a JSON value.
"""

from __future__ import annotations

import base64
import json
import time

import redis

from jobs.keys import (  # noqa: F401  (checkpoint_key: part of this API)
    JOBS_INDEX,
    checkpoint_key,
    conversation_key,
    owner_index,
    record_key,
    result_key,
)
from jobs.queues import BATCH
from jobs.settings import Settings

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELED = "queued", "running", "succeeded", "failed", "canceled"
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELED)
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELED})


PENDING_TTL_FACTOR = 7
"""A record that never ends (its queue was lost) still expires after this many result TTLs."""

_PUBLIC = ("id", "kind", "status", "model", "filename", "created_at", "started_at", "finished_at",
           "progress", "error", "metadata", "webhook_url", "attempts")
_SCAN_PAGE = 100


def status_of_error(error: dict) -> str:
    """The terminal status of a job that ended with this error event's data: canceled or failed."""
    return CANCELED if error.get("code") == "canceled" else FAILED


def create(conn: redis.Redis, settings: Settings, job_id: str, kind: str, fields: dict, listed: bool = True,
           conversation: list[dict] | None = None) -> dict:
    """Create the record of a newly queued job and index it (unless not `listed`); return its public view.

    `fields`: model, filename, params (dict), webhook_url, metadata (dict), duration_s, owner (who may
    see the job: web.auth), and any internal extra (audio_path, rq_job_id: defaults to `job_id`,
    response: a stored response's settings). `conversation`: the messages a stored response ran, kept
    beside the record under the same TTLs (`get_conversation`).
    """
    now = time.time()
    record = {"id": job_id, "kind": kind, "status": QUEUED, "created_at": now, "started_at": None,
              "finished_at": None, "progress": None, "error": None, "metadata": {}, "webhook_url": None,
              "attempts": 0, "rq_job_id": job_id, "params": {}, "owner": "", **fields}
    pipe = conn.pipeline()
    pipe.hset(record_key(job_id), mapping=_encode(record))
    pipe.expire(record_key(job_id), settings.result_ttl_s * PENDING_TTL_FACTOR)
    if conversation is not None:
        pipe.set(conversation_key(job_id), json.dumps(conversation), ex=settings.result_ttl_s * PENDING_TTL_FACTOR)
    if listed:  # a stored synchronous response is no async job: /v1/jobs does not list it
        pipe.zadd(JOBS_INDEX, {job_id: now})
        pipe.zadd(owner_index(record["owner"]), {job_id: now})
    pipe.execute()
    return _public(record)


def load(conn: redis.Redis, job_id: str) -> dict | None:
    """Return every field of the record (internal ones too: rq_job_id, params, audio_path...)."""
    raw = conn.hgetall(record_key(job_id))
    return {k.decode(): json.loads(v) for k, v in raw.items()} if raw else None


def get(conn: redis.Redis, job_id: str) -> dict | None:
    """Return the public view of the job's record, or None when it does not exist (or expired)."""
    record = load(conn, job_id)
    return _public(record) if record else None


def update(conn: redis.Redis, job_id: str, **fields) -> None:
    """Set fields of an existing record (a missing or expired record is left alone)."""
    if fields and conn.exists(record_key(job_id)):
        conn.hset(record_key(job_id), mapping=_encode(fields))


def incr(conn: redis.Redis, job_id: str, field: str, amount: int = 1) -> int:
    """Atomically add `amount` to an integer field of the record; return the new value."""
    return int(conn.hincrby(record_key(job_id), field, amount))


def set_status(conn: redis.Redis, settings: Settings, job_id: str, status: str, error=None) -> None:
    """Move the job to `status`, stamping times; a terminal status starts the result TTL."""
    if status not in STATUSES:
        raise ValueError(f"unknown job status {status!r}")
    record = load(conn, job_id)
    if record is None:
        return
    fields: dict = {"status": status}
    if status == RUNNING and record.get("started_at") is None:
        fields["started_at"] = time.time()
    if status in TERMINAL:
        fields["finished_at"] = time.time()
        if error is not None:
            fields["error"] = error if isinstance(error, dict) else {"message": str(error), "code": status}
    pipe = conn.pipeline()
    pipe.hset(record_key(job_id), mapping=_encode(fields))
    ttl = settings.result_ttl_s if status in TERMINAL else settings.result_ttl_s * PENDING_TTL_FACTOR
    for key in (record_key(job_id), result_key(job_id), conversation_key(job_id), checkpoint_key(job_id)):
        pipe.expire(key, ttl)
    pipe.execute()


def set_result(conn: redis.Redis, settings: Settings, job_id: str, result: dict) -> None:
    """Store the job's result (JSON) with the result TTL."""
    conn.set(result_key(job_id), json.dumps(result), ex=settings.result_ttl_s)


def get_result(conn: redis.Redis, job_id: str) -> dict | None:
    """Return the job's result, or None when there is none (yet, or any more)."""
    raw = conn.get(result_key(job_id))
    return json.loads(raw) if raw else None


def get_conversation(conn: redis.Redis, job_id: str) -> list[dict] | None:
    """The conversation a stored response's job ran (its answer not included), or None."""
    raw = conn.get(conversation_key(job_id))
    return json.loads(raw) if raw else None


def queue_position(conn: redis.Redis, job_id: str) -> int | None:
    """0-based position of the job's current RQ job in its queue, None when it is not waiting there."""
    record = load(conn, job_id)
    if record is None:
        return None
    rq_job_id = record.get("rq_job_id") or job_id
    queue = conn.hget(f"rq:job:{rq_job_id}", "origin")  # `batch`, or its model's own batch queue
    position = conn.lpos(f"rq:queue:{(queue or BATCH.encode()).decode()}", rq_job_id)
    return None if position is None else int(position)


def list_jobs(conn: redis.Redis, status: str | None, limit: int, cursor: str | None,
              owner: str | None = None) -> tuple[list[dict], str | None]:
    """Return up to `limit` jobs newest first (optionally of one status, of one owner: None for every
    owner's) and the next page's cursor."""
    after = _decode_cursor(cursor)
    index = JOBS_INDEX if owner is None else owner_index(owner)
    page: list[tuple[dict, float]] = []
    stale: list[str] = []
    for job_id, score in _iter_index(conn, index, after):
        record = get(conn, job_id)
        if record is None:
            stale.append(job_id)  # the record expired: its index entry goes too
        elif status is None or record["status"] == status:
            page.append((record, score))
            if len(page) > limit:  # one more than asked: proof that a next page exists
                break
    if stale:
        conn.zrem(index, *stale)
    jobs = [record for record, _ in page[:limit]]
    if len(page) <= limit or not jobs:
        return jobs, None
    last_record, last_score = page[limit - 1]
    return jobs, _encode_cursor(last_score, last_record["id"])


def _iter_index(conn: redis.Redis, index: str, after: tuple[float, str] | None):
    """Yield (job id, score) of an index newest first, strictly after the cursor position."""
    max_score = "+inf" if after is None else repr(after[0])
    offset = 0
    while True:
        rows = conn.zrevrangebyscore(index, max_score, "-inf", start=offset, num=_SCAN_PAGE,
                                     withscores=True)
        if not rows:
            return
        offset += len(rows)
        for member, score in rows:
            job_id = member.decode()
            # Equal scores come in reverse lexicographic order: skip those at or before the cursor.
            if after is not None and score == after[0] and job_id >= after[1]:
                continue
            yield job_id, score


def _encode_cursor(score: float, job_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps([score, job_id]).encode()).decode().rstrip("=")


def _decode_cursor(cursor: str | None) -> tuple[float, str] | None:
    """Parse a cursor made by `_encode_cursor`; raise ValueError for anything else."""
    if not cursor:
        return None
    try:
        score, job_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        return float(score), str(job_id)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid cursor {cursor!r}") from exc


def _encode(fields: dict) -> dict:
    return {k: json.dumps(v) for k, v in fields.items()}


def _public(record: dict) -> dict:
    """The client-facing view: fixed keys, integer unix times, `object: job`."""
    view = {key: record.get(key) for key in _PUBLIC}
    view["object"] = "job"
    for key in ("created_at", "started_at", "finished_at"):
        if view[key] is not None:
            view[key] = int(view[key])
    view["metadata"] = view["metadata"] or {}
    view["attempts"] = int(view["attempts"] or 0)
    return view
