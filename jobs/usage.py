"""What each API key used, per model and per UTC day: the figures a shared service charges back and limits by.

The worker adds a job's figures when it ends with an answer (jobs ended by an error or a cancel count
nothing: their client got no answer to bill), in the same MULTI/EXEC as the job's metrics
(workers/worker_metrics.py). One hash per key and day (`keys.usage`): a field `<model>|<figure>` per
model, and `*|<figure>` the key's total of the day, which the daily limits read (jobs/limits.py).
A key is named by its id (`web.auth.owner_of`: a digest, never the key), `anonymous` on an open server.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone

import redis

from jobs import keys

FIGURES = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "audio_seconds", "images",
           "embedding_inputs")
"""What is counted: answered requests; text tokens in and out (cached: prompt tokens resumed from the prompt
cache, part of prompt_tokens); seconds of audio transcribed or translated; images in chats; inputs embedded."""

TOTAL = "*"
"""The model name of a key's total of the day."""

RETENTION_DAYS = 400
"""How long a day's usage is kept (a year and a month: last year's same month stays comparable)."""

MAX_DAYS = 366
"""The longest range one usage query covers."""

ANONYMOUS = "anonymous"
"""How the callers of an open server (no keys) are named in usage and metrics."""


def today() -> str:
    """Today's UTC date, YYYY-MM-DD (usage days are UTC days)."""
    return datetime.now(timezone.utc).date().isoformat()


def seconds_to_midnight() -> float:
    """Seconds until the next UTC day starts (when the daily limits reset)."""
    now = datetime.now(timezone.utc)
    midnight = datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=timezone.utc)
    return (midnight - now).total_seconds()


def key_label(owner: str) -> str:
    """A key's name in usage and metrics."""
    return owner or ANONYMOUS


def figures_of(kind: str, request, done: dict) -> dict[str, float]:
    """What a job that ended with the answer `done` used (only the figures that are not zero)."""
    found: dict[str, float] = {"requests": 1}
    usage = done.get("usage") or {}
    if kind in ("text", "multimodal", "embedding"):
        found["prompt_tokens"] = int(usage.get("prompt_tokens") or 0)
        found["completion_tokens"] = int(usage.get("completion_tokens") or 0)
        found["cached_tokens"] = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        found["images"] = len(getattr(request, "images", None) or ())
    if kind == "embedding":
        found["embedding_inputs"] = len(done.get("embeddings") or ())
    if kind == "transcription":
        found["audio_seconds"] = round(float((done.get("result") or {}).get("duration") or 0.0), 3)
    return {name: value for name, value in found.items() if value}


def add(pipe, owner: str, model: str, figures: dict[str, float], day: str | None = None) -> None:
    """Queue on `pipe` the commands that add `figures` to a key's usage of `day` (today), per model and in total."""
    key = keys.usage(day or today(), owner)
    for name, value in figures.items():
        for field in (f"{model}|{name}", f"{TOTAL}|{name}"):
            if isinstance(value, float):
                pipe.hincrbyfloat(key, field, value)
            else:
                pipe.hincrby(key, field, value)
    pipe.expire(key, RETENTION_DAYS * 86400)


def days_between(start: str, end: str) -> list[str]:
    """Every UTC day from `start` to `end` (YYYY-MM-DD, both included); ValueError if not dates, reversed or
    longer than MAX_DAYS."""
    first, last = date.fromisoformat(start), date.fromisoformat(end)
    if last < first:
        raise ValueError(f"the range ends ({end}) before it starts ({start})")
    if (last - first).days >= MAX_DAYS:
        raise ValueError(f"a usage query covers at most {MAX_DAYS} days")
    return [(first + timedelta(days=n)).isoformat() for n in range((last - first).days + 1)]


def read(conn: redis.Redis, days: list[str], owner: str | None = None) -> list[dict]:
    """Usage rows, one per day, key and model (the key's day total as model `*`), sorted by day, key, model:
    {"day", "key", "model", <figure>: amount...}; `owner` picks one key."""
    names = []
    for day in days:
        if owner is not None:
            names.append((day, keys.usage(day, owner)))
        else:
            names.extend((day, name.decode() if isinstance(name, bytes) else name)
                         for name in conn.scan_iter(match=keys.usage_pattern(day), count=1000))
    with conn.pipeline(transaction=False) as pipe:
        for _, name in names:
            pipe.hgetall(name)
        hashes = pipe.execute()
    rows: dict[tuple[str, str, str], dict] = {}
    for (day, name), fields in zip(names, hashes, strict=True):
        label = name.rsplit(":", 1)[1]
        for raw, value in fields.items():
            model, _, figure = (raw.decode() if isinstance(raw, bytes) else raw).rpartition("|")
            row = rows.setdefault((day, label, model), {"day": day, "key": label, "model": model})
            amount = float(value)
            row[figure] = round(amount, 3) if figure == "audio_seconds" else int(amount)
    return [{**{name: 0 for name in FIGURES}, **rows[k]} for k in sorted(rows)]


def used_today(conn: redis.Redis, owner: str) -> dict[str, float]:
    """A key's totals of today: every figure, 0 where nothing was used."""
    values = conn.hmget(keys.usage(today(), owner), [f"{TOTAL}|{name}" for name in FIGURES])
    return {name: float(value or 0) for name, value in zip(FIGURES, values, strict=True)}
