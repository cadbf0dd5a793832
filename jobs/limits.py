"""Per-key limits: requests per minute, concurrent requests, queued async jobs, tokens and audio seconds per day.

Where a key's limits come from, first found wins: the admin API's entry for the key, the file's
(MLXQ_KEY_LIMITS) entry for it, the admin API's `default`, the file's `default`; none: no limit. The
admin key is never limited (web/ratelimit.py). The file is JSON, an object of entries, each named by
a key's id (what `mlxq admin usage` lists: `web.auth.owner_of`), by the key itself (turned into its id
when read, so the file may hold either), or `default`:

    {"default": {"requests_per_minute": 60, "tokens_per_day": 1000000},
     "3f2a...": {"requests_per_minute": 600, "concurrent": 8, "queued": 100, "audio_seconds_per_day": 36000}}

Every check and what it records happens in one Lua script, so two web processes can never both let
through the request that crosses a limit. The daily ones read the key's usage of the day
(jobs/usage.py), which grows when a job ends: the request that crosses a daily limit still completes,
the next one is refused until the UTC day ends.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import redis

from jobs import keys, usage

FIELDS = ("requests_per_minute", "concurrent", "queued", "tokens_per_day", "audio_seconds_per_day", "share")
"""What an entry may set: the limits (each a number >= 0, or null: no limit) and `share`, the key's weight in the
worker's fair share (> 0; null: 1): a key of share 3 takes three places for each one of a key of share 1 while
both have jobs waiting (workers/admission.py `fair_order`)."""

MIN_SHARE, MAX_SHARE = 0.01, 1000.0
"""The weights a key's `share` may take."""

DEFAULT = "default"
"""The entry that applies to every key without one of its own."""

KEY_ID = re.compile(r"^[0-9a-f]{24}$")
"""What a key's id looks like (`web.auth.owner_of`)."""

IN_FLIGHT_HOLD_S = 3600
"""Longest a synchronous request counts as in flight when its web process died before it could say it ended."""

TOKENS, AUDIO = "tokens", "audio"
"""Which daily limit a request is held to: text (prompt + completion tokens) or audio seconds."""


class LimitsFileError(ValueError):
    """MLXQ_KEY_LIMITS names a file that cannot be read as limits."""


@dataclass(frozen=True)
class Limits:
    """One key's limits; None: not limited in that way."""

    requests_per_minute: int | None = None
    concurrent: int | None = None
    queued: int | None = None
    tokens_per_day: int | None = None
    audio_seconds_per_day: float | None = None
    share: float | None = None  # the key's weight in fair share (None: 1)

    def as_dict(self) -> dict:
        """The limits as JSON-ready data (every field, None where unlimited)."""
        return asdict(self)

    def any(self) -> bool:
        """Whether any limit is set."""
        return any(value is not None for value in asdict(self).values())


def parse_entry(data, where: str = "limits") -> Limits:
    """An entry's limits from JSON-like data; ValueError naming the field that is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: an entry is an object of limits ({', '.join(FIELDS)})")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown limit {unknown[0]!r} (known: {', '.join(FIELDS)})")
    values = {}
    for name, value in data.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}.{name}: a number >= 0, or null for no limit")
        if name == "share" and not MIN_SHARE <= value <= MAX_SHARE:
            raise ValueError(f"{where}.share: a weight from {MIN_SHARE:g} to {MAX_SHARE:g}, or null for 1")
        values[name] = float(value) if name in ("audio_seconds_per_day", "share") else int(value)
    return Limits(**values)


def entry_name(name: str) -> str:
    """The stored name of an entry: `default`, a key's id as given, or the id of a key given itself."""
    if name == DEFAULT or KEY_ID.match(name):
        return name
    return hashlib.sha256(name.encode()).hexdigest()[:24]


def load_file(path: str) -> dict[str, Limits]:
    """The limits of MLXQ_KEY_LIMITS ("" : none); LimitsFileError says what is wrong with it."""
    if not path:
        return {}
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except OSError as exc:
        raise LimitsFileError(f"MLXQ_KEY_LIMITS={path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise LimitsFileError(f"MLXQ_KEY_LIMITS={path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise LimitsFileError(f"MLXQ_KEY_LIMITS={path}: an object of entries (a key's id, or default)")
    try:
        return {entry_name(name): parse_entry(entry, name) for name, entry in data.items()}
    except ValueError as exc:
        raise LimitsFileError(f"MLXQ_KEY_LIMITS={path}: {exc}") from None


def set_override(conn: redis.Redis, name: str, limits: Limits) -> str:
    """Set an entry through the admin API (it wins over the file's); return its stored name."""
    name = entry_name(name)
    conn.hset(keys.KEY_LIMITS, name, json.dumps(limits.as_dict()))
    return name


def clear_override(conn: redis.Redis, name: str) -> bool:
    """Remove an admin API entry (the file's, if any, applies again); False if there was none."""
    return bool(conn.hdel(keys.KEY_LIMITS, entry_name(name)))


def overrides(conn: redis.Redis) -> dict[str, Limits]:
    """The admin API's entries."""
    return {(n.decode() if isinstance(n, bytes) else n): parse_entry(json.loads(v))
            for n, v in conn.hgetall(keys.KEY_LIMITS).items()}


def effective(conn: redis.Redis, file: dict[str, Limits], owner: str) -> tuple[Limits, str]:
    """A key's limits and where they come from (`admin`, `file`, `admin default`, `file default`, `none`)."""
    mine, fallback = conn.hmget(keys.KEY_LIMITS, [owner, DEFAULT])
    if mine is not None:
        return parse_entry(json.loads(mine)), "admin"
    if owner in file:
        return file[owner], "file"
    if fallback is not None:
        return parse_entry(json.loads(fallback)), "admin default"
    if DEFAULT in file:
        return file[DEFAULT], "file default"
    return Limits(), "none"


@dataclass(frozen=True)
class Verdict:
    """What a check said: `refused` names the limit passed (None: let through), with the figures for headers."""

    refused: str | None
    limits: Limits
    retry_after_s: float = 0.0
    requests_left: int | None = None  # of the minute's requests, after this one
    requests_reset_s: float = 0.0  # until the oldest of the minute's requests leaves the window
    used_today: float = 0.0  # tokens or audio seconds, by the request's daily limit


# The limits that apply to a key, as JSON (nil: none): the admin API's entry (KEYS[1]) for the key, the file's
# (ARGV[2]), the admin default, the file's default (ARGV[3]). The start of both scripts below.
_RESOLVE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw and ARGV[2] ~= '' then raw = ARGV[2] end
if not raw then raw = redis.call('HGET', KEYS[1], 'default') end
if not raw and ARGV[3] ~= '' then raw = ARGV[3] end
"""

# Checks a request against its key's limits and, if it is let through, records it (the minute's requests,
# the ones in flight), in one step. Replies JSON (Lua numbers would come back as integers).
_ADMIT = _RESOLVE + """
if not raw then return cjson.encode({none = true}) end
local lim = cjson.decode(raw)
local function limit(name)
  local v = lim[name]
  if v == nil or v == cjson.null then return nil end
  return tonumber(v)
end
local out = {limits = raw}
local rpm = limit('requests_per_minute')
if rpm then
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 60)
  local n = redis.call('ZCARD', KEYS[2])
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  out.reset = oldest[2] and (tonumber(oldest[2]) + 60 - now) or 60
  if n >= rpm then
    out.refused = 'requests_per_minute'; out.retry = out.reset; out.left = 0
    return cjson.encode(out)
  end
  out.left = rpm - n - 1
end
local conc = limit('concurrent')
if conc and ARGV[5] == '1' then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then
    out.refused = 'concurrent'; out.retry = 1
    return cjson.encode(out)
  end
end
local daily = ARGV[6] == 'tokens' and limit('tokens_per_day') or (ARGV[6] == 'audio' and limit('audio_seconds_per_day'))
if daily then
  local used = 0
  local fields = ARGV[6] == 'tokens' and {'*|prompt_tokens', '*|completion_tokens'} or {'*|audio_seconds'}
  for _, v in ipairs(redis.call('HMGET', KEYS[4], unpack(fields))) do
    if v then used = used + tonumber(v) end
  end
  out.used = used
  if used >= daily then
    out.refused = ARGV[6] == 'tokens' and 'tokens_per_day' or 'audio_seconds_per_day'
    out.retry = tonumber(ARGV[7])
    return cjson.encode(out)
  end
end
if rpm then
  redis.call('ZADD', KEYS[2], now, ARGV[4])
  redis.call('EXPIRE', KEYS[2], 61)
end
if conc and ARGV[5] == '1' then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[8]), ARGV[4])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[8]) + 60)
end
return cjson.encode(out)
"""

# Admits an async job against its key's `queued` limit, adding it to the key's jobs not yet ended (which
# jobs.lifecycle takes it out of when it ends); entries older than ARGV[5] seconds are dropped (expired jobs).
_QUEUE = _RESOLVE + """
local lim = raw and cjson.decode(raw) or {}
local q = lim['queued']
if q == cjson.null then q = nil end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[5]))
local n = redis.call('ZCARD', KEYS[2])
if q and n >= tonumber(q) then return cjson.encode({refused = 'queued', limits = raw}) end
redis.call('ZADD', KEYS[2], now, ARGV[4])
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[5]))
return cjson.encode({limits = raw})
"""


def _file_args(file: dict[str, Limits], owner: str) -> list[str]:
    mine, fallback = file.get(owner), file.get(DEFAULT)
    return [json.dumps(mine.as_dict()) if mine else "", json.dumps(fallback.as_dict()) if fallback else ""]


def admit(conn: redis.Redis, file: dict[str, Limits], owner: str, token: str, *, synchronous: bool,
          daily: str | None) -> Verdict:
    """Check a request of `owner` against its limits and, let through, count it (`token`: its unique id, which
    `release` takes out of the requests in flight once a `synchronous` one ends). `daily`: TOKENS, AUDIO or None."""
    script = conn.register_script(_ADMIT)
    raw = script(keys=[keys.KEY_LIMITS, keys.owner_requests(owner), keys.owner_in_flight(owner),
                       keys.usage(usage.today(), owner)],
                 args=[owner, *_file_args(file, owner), token, "1" if synchronous else "0", daily or "",
                       f"{usage.seconds_to_midnight():.3f}", IN_FLIGHT_HOLD_S])
    out = json.loads(raw)
    if out.get("none"):
        return Verdict(None, Limits())
    return Verdict(out.get("refused"), parse_entry(json.loads(out["limits"])), float(out.get("retry") or 0.0),
                   out.get("left"), float(out.get("reset") or 0.0), float(out.get("used") or 0.0))


def release(conn: redis.Redis, owner: str, token: str) -> None:
    """A synchronous request let through by `admit` ended: it no longer counts as in flight."""
    conn.zrem(keys.owner_in_flight(owner), token)


def admit_queued(conn: redis.Redis, file: dict[str, Limits], owner: str, job_id: str, keep_s: int) -> Verdict:
    """Count an async job among its key's jobs not yet ended, unless that passes its `queued` limit
    (`keep_s`: how long an entry may stay at most, the jobs' own lifetime)."""
    script = conn.register_script(_QUEUE)
    out = json.loads(script(keys=[keys.KEY_LIMITS, keys.owner_queued(owner)],
                            args=[owner, *_file_args(file, owner), job_id, keep_s]))
    limits = parse_entry(json.loads(out["limits"])) if out.get("limits") else Limits()
    return Verdict(out.get("refused"), limits, 5.0 if out.get("refused") else 0.0)


def job_ended(conn, owner: str, job_id: str) -> None:
    """An async job ended (or was never queued): it no longer counts against its key's `queued` limit
    (`conn`: a connection or a pipeline)."""
    conn.zrem(keys.owner_queued(owner), job_id)
