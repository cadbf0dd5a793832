"""A long job's checkpoints: what it produced so far and the state to go on from, kept between pieces.

A job run in pieces (a transcription, window by window) checkpoints after each one, so that a run
in another process (its worker died, or stopped) continues where it was. A checkpoint holds the
job's items by id (a transcription's segments: writing a piece again changes nothing), the backend's
state after its last piece (JSON, opaque here), how many items were published as events (they may
be stored and the worker die before they go out), and how many continuations the job has had.

Backends hand their state over through their `jobs.lifecycle.JobRun` and never write Redis; the
lifecycle deletes the checkpoint when the job ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import redis

from jobs import keys, records
from jobs.settings import Settings


@dataclass(frozen=True)
class Saved:
    """A checkpoint read back: the state to go on from, every item so far, and how many were published."""

    state: dict
    items: list[dict]
    published: int

    @property
    def unpublished(self) -> list[dict]:
        """The items stored but not yet published (the worker died between the two)."""
        return self.items[self.published:]


def load(conn: redis.Redis, job_id: str) -> Saved | None:
    """The job's last checkpoint (None before its first piece)."""
    raw = conn.hgetall(keys.checkpoint_key(job_id))
    if b"state" not in raw:
        return None
    return Saved(json.loads(raw[b"state"]), items(conn, job_id), int(raw.get(b"published", 0)))


def save(conn: redis.Redis, settings: Settings, job_id: str, new_items: list[dict], state: dict) -> int:
    """Checkpoint a piece: its items by id, then the state after it, in one transaction; return the items stored."""
    key, items_key, ttl = keys.checkpoint_key(job_id), keys.checkpoint_segments(job_id), ttl_s(settings)
    with conn.pipeline() as pipe:
        if new_items:
            pipe.hset(items_key, mapping={str(item["id"]): json.dumps(item) for item in new_items})
        pipe.hset(key, "state", json.dumps(state))
        pipe.expire(items_key, ttl)
        pipe.expire(key, ttl)
        pipe.hlen(items_key)
        return int(pipe.execute()[-1])


def mark_published(conn: redis.Redis, job_id: str, count: int) -> None:
    """Note that the first `count` items went out as events."""
    conn.hset(keys.checkpoint_key(job_id), "published", count)


def items(conn: redis.Redis, job_id: str) -> list[dict]:
    """Every item checkpointed so far, in order of id."""
    stored = conn.hgetall(keys.checkpoint_segments(job_id))
    return [json.loads(stored[k]) for k in sorted(stored, key=int)]


def restart(conn: redis.Redis, job_id: str) -> None:
    """Forget the state and items (a run from the beginning); the count of continuations stays."""
    with conn.pipeline() as pipe:
        pipe.hdel(keys.checkpoint_key(job_id), "state", "published")
        pipe.delete(keys.checkpoint_segments(job_id))
        pipe.execute()


def next_continuation(conn: redis.Redis, job_id: str) -> int:
    """Number the job's next continuation (1, 2, ...)."""
    return int(conn.hincrby(keys.checkpoint_key(job_id), "continuations", 1))


def discard(conn: redis.Redis, job_id: str) -> None:
    """Delete the job's checkpoint (it ended)."""
    discard_many(conn, [job_id])


def discard_many(conn: redis.Redis, job_ids: list[str]) -> None:
    """Delete these jobs' checkpoints (they ended), in one round trip."""
    conn.delete(*[key for job_id in job_ids for key in (keys.checkpoint_key(job_id), keys.checkpoint_segments(job_id))])


def ttl_s(settings: Settings) -> int:
    """Checkpoints live as long as a record that never ends (they are deleted when the job ends)."""
    return settings.result_ttl_s * records.PENDING_TTL_FACTOR
