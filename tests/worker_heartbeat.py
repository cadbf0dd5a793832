"""A worker's heartbeat with no worker behind it, for web-tier tests of calls that wait in a queue.

It is what a live worker writes each beat (its liveness key and its state: jobs.workers), so the web
tier takes the calls it is sent as it would with a worker running; nothing drains the queues.
"""

from __future__ import annotations

import json

import redis

from jobs import keys, queues, workers

NAME = "mlxq-test-heartbeat"


def beat(conn: redis.Redis, ttl_s: float = 60.0, name: str = NAME) -> str:
    """Write one heartbeat of a worker on the shared queues, alive for `ttl_s`; return its name."""
    # Another host's PID: a local one would be checked (and found not to be a worker).
    alive = json.dumps({"host": "elsewhere", "pid": 1, "name": name})
    conn.set(keys.worker_alive(name), alive, px=int(ttl_s * 1000))
    workers.write_state(conn, name, {"serves": None, "queues": list(queues.WORKER_QUEUES)}, ttl_s)
    return name
