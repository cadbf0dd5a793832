"""The event protocol: every job has a numbered event stream, published live and kept in a replay log.

An event is a dict `{"id": int, "type": str, "data": dict}`. Types: `delta` (generated text),
`reasoning` (a reasoning model's thinking, before its answer's deltas),
`segment` (a finished transcript segment), `progress`, `heartbeat`, and exactly one terminal
event, `done` or `error`. Ids start at 1 and increase by one per event of that job.
"""

from __future__ import annotations

import json
import uuid

import redis

from jobs import keys

DELTA = "delta"
REASONING = "reasoning"
SEGMENT = "segment"
PROGRESS = "progress"
HEARTBEAT = "heartbeat"
DONE = "done"
ERROR = "error"
TERMINAL = frozenset({DONE, ERROR})

# Assign ids, append to the capped log and publish in one atomic step, so the log's order is the id
# order and a terminal event can never be followed by another (a later one is dropped). Once a
# cancel is asked for, only the terminal event goes out (nobody wants more of a canceled job's
# output). A publish whose token is the last one applied is not applied again: a worker resends a
# publish whose reply a dropped connection lost, and the events must not appear twice. Returns the
# last id (0: nothing applied) and whether the job's cancel flag is set, so a publishing worker
# learns of a cancel for free. ARGV[first..last]: a type and a JSON data per event.
_PUBLISH_JOB = """
local function publish_job(seq_key, log_key, channel, cancel_key, ttl, cap, token, first, last)
  local token_key = seq_key .. ':token'
  local canceled = redis.call('EXISTS', cancel_key)
  if redis.call('GET', token_key) == token then
    return tonumber(redis.call('GET', seq_key) or 0), canceled
  end
  local id = 0
  for i = first, last, 2 do
    if redis.call('GET', seq_key .. ':ended') then break end
    local etype, data = ARGV[i], ARGV[i + 1]
    local terminal = etype == 'done' or etype == 'error'
    if terminal or canceled == 0 then
      id = redis.call('INCR', seq_key)
      local event = '{"id":' .. id .. ',"type":"' .. etype .. '","data":' .. data .. '}'
      redis.call('RPUSH', log_key, event)
      if terminal then redis.call('SET', seq_key .. ':ended', id, 'EX', ttl) end
      redis.call('PUBLISH', channel, event)
    end
  end
  if id > 0 then
    redis.call('LTRIM', log_key, -cap, -1)
    redis.call('EXPIRE', log_key, ttl)
    redis.call('EXPIRE', seq_key, ttl)
    redis.call('SET', token_key, token, 'EX', ttl)
  end
  return id, canceled
end
"""

# One job's events: KEYS its four keys; ARGV ttl, cap, a token naming this publish, then the events.
_PUBLISH_LUA = _PUBLISH_JOB + """
local id, canceled = publish_job(KEYS[1], KEYS[2], KEYS[3], KEYS[4], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3],
                                 4, #ARGV)
return {id, canceled}
"""

# Several jobs' events in one call (a decode step's): KEYS four per job; ARGV ttl, cap, a token naming this publish,
# then per job its number of events and the events. Returns the id and the cancel flag of each job in turn. One call,
# not one per job in a pipeline: at 64 streams packing 64 calls and reading 64 replies took the publishing thread
# ~2.5 ms of Python a step on a 2-core EPYC (bench/NOTES.md), time Python's lock took from the decode loop.
_PUBLISH_ALL_LUA = _PUBLISH_JOB + """
local ttl, cap, token = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local out, at = {}, 4
for j = 1, #KEYS, 4 do
  local n = tonumber(ARGV[at])
  local id, canceled = publish_job(KEYS[j], KEYS[j + 1], KEYS[j + 2], KEYS[j + 3], ttl, cap, token, at + 1, at + 2 * n)
  out[#out + 1] = id
  out[#out + 1] = canceled
  at = at + 1 + 2 * n
end
return out
"""


class EventPublisher:
    """Publishes events for jobs (used by the worker, and by readers to fail a job whose worker died)."""

    def __init__(self, connection: redis.Redis, ttl_s: int, log_max: int):
        self.connection = connection
        self.ttl_s = int(ttl_s)
        self.log_max = int(log_max)
        self._script = connection.register_script(_PUBLISH_LUA)
        self._script_all = connection.register_script(_PUBLISH_ALL_LUA)

    def publish(self, job_id: str, event_type: str, data: dict | None = None) -> int:
        """Publish one event; return its id, or 0 when the job already ended (nothing published)."""
        return self.publish_many(job_id, [(event_type, data)])[0]

    def publish_many(self, job_id: str, events: list[tuple[str, dict | None]]) -> tuple[int, bool]:
        """Publish events in order in one round trip; return (the last id, 0 if the job had ended;
        whether a cancel of the job was requested)."""
        job_keys, args = self._keys_and_args(job_id, events)
        last_id, cancel_requested = self._script(keys=job_keys, args=args)
        return int(last_id), bool(cancel_requested)

    def _keys_and_args(self, job_id: str, events: list[tuple[str, dict | None]]) -> tuple[list, list]:
        """The publish script's keys and arguments (a fresh token names this publish)."""
        return _keys_of(job_id), [self.ttl_s, self.log_max, uuid.uuid4().hex, *_event_args(events)]

    def publish_pipelined(self, batches: list[tuple[str, list[tuple[str, dict | None]]]]) -> list[bool]:
        """Publish several jobs' events in one round trip; whether each job's cancel flag is set."""
        return [canceled for _, canceled in self.publish_all(batches)]

    def publish_all(self, batches: list[tuple[str, list[tuple[str, dict | None]]]]) -> list[tuple[int, bool]]:
        """Publish several jobs' events in one round trip (one script call); for each job, what `publish_many`
        returns."""
        if len(batches) == 1:
            return [self.publish_many(*batches[0])]
        # One token names the call and each job keeps it as its last: a job named twice would have its second
        # part taken for a resend, so each job's events go once, in order.
        merged: dict[str, list] = {}
        for job_id, events in batches:
            merged.setdefault(job_id, []).extend(events)
        job_keys: list = []
        args: list = [self.ttl_s, self.log_max, uuid.uuid4().hex]
        for job_id, events in merged.items():
            job_keys += _keys_of(job_id)
            args.append(len(events))
            args += _event_args(events)
        # EVALSHA through the registered script (it loads the script again into a restarted Redis that lost it;
        # the token makes sending it again safe).
        flat = self._script_all(keys=job_keys, args=args)
        replies = {job_id: (int(flat[2 * i]), bool(flat[2 * i + 1])) for i, job_id in enumerate(merged)}
        return [replies[job_id] for job_id, _ in batches]

    def error(self, job_id: str, data: dict) -> int:
        """Publish the terminal error event of a job (data: jobs.errors.error_data's shape)."""
        return self.publish(job_id, ERROR, data)


_compact = json.JSONEncoder(separators=(",", ":")).encode
"""JSON without spaces (one encoder: `json.dumps` with separators builds a new one each call)."""


def _keys_of(job_id: str) -> list[str]:
    """A job's keys, as the publish scripts take them."""
    return [keys.event_seq(job_id), keys.event_log(job_id), keys.event_channel(job_id), keys.cancel_flag(job_id)]


def _event_args(events: list[tuple[str, dict | None]]) -> list[str]:
    """Events as the publish scripts take them: a type and a JSON data each."""
    args = []
    for event_type, data in events:
        args += [event_type, _compact(data or {})]
    return args


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
