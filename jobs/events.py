"""The event protocol: every job has a numbered event stream, published live and kept in a replay log.

An event is a dict `{"id": int, "type": str, "data": dict}`. Types: `delta` (generated text),
`segment` (a finished transcript segment), `progress`, `heartbeat`, and exactly one terminal
event, `done` or `error`. Ids start at 1 and increase by one per event of that job.
"""

from __future__ import annotations

import json

import redis

from jobs import keys

DELTA = "delta"
SEGMENT = "segment"
PROGRESS = "progress"
HEARTBEAT = "heartbeat"
DONE = "done"
ERROR = "error"
TERMINAL = frozenset({DONE, ERROR})

# Assign the id, append to the capped log and publish in one atomic step, so the log's order is
# the id order and a terminal event can never be followed by another (a second one is dropped).
_PUBLISH_LUA = """
local seq_key, log_key, channel = KEYS[1], KEYS[2], KEYS[3]
local etype, data, ttl, cap = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('GET', seq_key .. ':ended') then return 0 end
local id = redis.call('INCR', seq_key)
local event = '{"id":' .. id .. ',"type":"' .. etype .. '","data":' .. data .. '}'
redis.call('RPUSH', log_key, event)
redis.call('LTRIM', log_key, -cap, -1)
redis.call('EXPIRE', log_key, ttl)
redis.call('EXPIRE', seq_key, ttl)
if etype == 'done' or etype == 'error' then redis.call('SET', seq_key .. ':ended', id, 'EX', ttl) end
redis.call('PUBLISH', channel, event)
return id
"""


class EventPublisher:
    """Publishes events for jobs (used by the worker, and by web to fail a job whose worker died)."""

    def __init__(self, connection: redis.Redis, ttl_s: int, log_max: int):
        self.connection = connection
        self.ttl_s = int(ttl_s)
        self.log_max = int(log_max)
        self._script = connection.register_script(_PUBLISH_LUA)

    def publish(self, job_id: str, event_type: str, data: dict | None = None) -> int:
        """Publish one event; return its id, or 0 when the job already ended (nothing published)."""
        payload = json.dumps(data or {}, separators=(",", ":"))
        job_keys = [keys.event_seq(job_id), keys.event_log(job_id), keys.event_channel(job_id)]
        return int(self._script(keys=job_keys, args=[event_type, payload, self.ttl_s, self.log_max]))

    def error(self, job_id: str, message: str, code: str = "internal_error", **extra) -> int:
        """Publish the terminal error event of a job."""
        return self.publish(job_id, ERROR, {"message": message, "code": code, **extra})


def decode(raw: bytes | str) -> dict:
    """Parse one event as stored in the log or sent on the channel."""
    return json.loads(raw)


def read_log(connection: redis.Redis, job_id: str, after_id: int = 0) -> list[dict]:
    """Return the job's logged events with id greater than `after_id`, oldest first."""
    events = [decode(raw) for raw in connection.lrange(keys.event_log(job_id), 0, -1)]
    return [e for e in events if e["id"] > after_id]


def has_ended(connection: redis.Redis, job_id: str) -> bool:
    """Whether the job's terminal event has been published."""
    return bool(connection.exists(keys.event_seq(job_id) + ":ended"))
