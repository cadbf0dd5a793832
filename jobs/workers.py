"""What each live MLX worker holds and does, as its heartbeat writes it (read by the admin API and /metrics).

A worker's state key expires with its liveness key (settings.worker_dead_after_s), so only live
workers are listed.
"""

from __future__ import annotations

import json

import redis

from jobs import keys


def write_state(conn: redis.Redis, name: str, state: dict, ttl_s: float) -> None:
    """Store a worker's state (a JSON-safe dict) until its next heartbeat, or until it would be called dead."""
    conn.set(keys.worker_state(name), json.dumps({"name": name, **state}), px=int(ttl_s * 1000))


def states(conn: redis.Redis) -> list[dict]:
    """Every live worker's state, by name."""
    names = sorted(conn.scan_iter(match=keys.WORKER_STATE_PATTERN, count=500))
    values = conn.mget(names) if names else []
    return [json.loads(v) for v in values if v is not None]
