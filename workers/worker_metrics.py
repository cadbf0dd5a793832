"""What the worker adds to the metrics kept in Redis (jobs.metrics): queue waits, job ends with their
tokens or audio seconds, time to first token, model loads; each in one round trip after the answer."""

from __future__ import annotations

import time
from datetime import timezone

import redis

from jobs import metrics, usage
from jobs.errors import Canceled
from workers import rqjobs

TEXT_KINDS = frozenset({"text", "multimodal"})


def _enqueued_at(job) -> float | None:
    """When RQ enqueued the job (wall clock), if it says."""
    return job.enqueued_at.replace(tzinfo=timezone.utc).timestamp() if job.enqueued_at else None


def queue_wait_s(job) -> float | None:
    """How long a job that is starting now waited in its queue (recorded when it ends: no round trip
    before its work starts)."""
    enqueued = _enqueued_at(job)
    return None if enqueued is None else max(0.0, time.time() - enqueued)


def jobs_ended(conn: redis.Redis, ended: list[tuple[object, dict | None, BaseException | None]]) -> None:
    """Jobs ended at one step (each `done`: its answer, or `error`): their waits, durations, what they produced and
    their keys' usage, in one round trip."""
    used = [(owner, model, found) for task, done, _ in ended if done is not None
            for owner, model, found in [usage_of(task, done)] if found]

    def add_usage(pipe):
        day = usage.today()
        for owner, model, found in used:
            usage.add(pipe, owner, model, found, day)

    samples = [sample for task, done, error in ended for sample in samples_of_end(task, done, error)]
    samples += [(metrics.KEY_USAGE[name], (usage.key_label(owner), model), value)
                for owner, model, found in used for name, value in found.items()]
    metrics.record(conn, samples, add_usage if used else None)


def usage_of(task, done: dict) -> tuple[str, str, dict]:
    """Whose job it was, its model, and what it used (jobs/usage.py; nothing for an admin control job)."""
    kind = getattr(task.request, "kind", None) or "unknown"
    model = getattr(getattr(task.request, "model", None), "id", "unknown")
    found = {} if kind in ("control", "unknown") else usage.figures_of(kind, task.request, done)
    return rqjobs.owner_of(task.job), model, found


def samples_of_end(task, done: dict | None, error: BaseException | None) -> list:
    """The samples `jobs_ended` records for one job."""
    kind = getattr(task.request, "kind", None) or "unknown"
    outcome = "succeeded" if error is None else "canceled" if isinstance(error, Canceled) else "failed"
    samples = [(metrics.JOB_DURATION, (kind, outcome), time.monotonic() - task.started)]
    if task.waited_s is not None:
        samples.append((metrics.QUEUE_WAIT, (task.lane, kind), task.waited_s))
    model = getattr(getattr(task.request, "model", None), "id", "unknown")
    if done is not None and kind in TEXT_KINDS:
        samples.append((metrics.GENERATED_TOKENS, (model,), done.get("usage", {}).get("completion_tokens", 0)))
        enqueued = _enqueued_at(task.job)
        if enqueued is not None:
            first = task.run.first_output_at or time.time()  # an answer with no delta before it: now
            samples.append((metrics.TIME_TO_FIRST_TOKEN, (model,), max(0.0, first - enqueued)))
        for tier, hit, tokens in getattr(task, "cache_lookups", ()):
            samples.append((metrics.PROMPT_CACHE_LOOKUPS, (tier, "hit" if hit else "miss"), 1))
            if hit:
                samples.append((metrics.PROMPT_CACHE_TOKENS, (tier,), tokens))
    elif done is not None and kind == "transcription":
        samples.append((metrics.AUDIO_SECONDS, (model,), float((done.get("result") or {}).get("duration") or 0)))
    return samples


def model_loaded(conn: redis.Redis, resident) -> None:
    """A model was loaded: how long it took."""
    metrics.record(conn, [(metrics.MODEL_LOAD, (resident.info.id,), resident.load_s)])
