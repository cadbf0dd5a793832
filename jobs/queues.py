"""Queue names, the JSON serializer, and enqueueing a request with an explicit id, TTLs and a length limit."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

import redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from jobs.settings import Settings

INTERACTIVE = "interactive"
"""Synchronous OpenAI-style calls and admin control; the worker always serves it first."""

BATCH = "batch"
"""Async jobs (long transcriptions, async chat)."""

WEBHOOKS = "webhooks"
"""Webhook deliveries, drained by a plain RQ worker, never the GPU worker."""

WORKER_QUEUES = (INTERACTIVE, BATCH)
"""The GPU worker's queues, in priority order (a worker that serves any model)."""

MODEL_SEPARATOR = "@"
"""A worker that serves only some models (`mlxq worker --models a,b`) takes jobs from each one's
own queues, `interactive@a`, `batch@a`...; the web routes a model's jobs there (web/routing.py)."""

# What an RQ job on the worker's queues names as its function: the kind of request it carries. The
# worker's scheduler runs requests itself (workers/scheduler.py); RQ never imports these.
CHAT_COMPLETION = "chat_completion"
TEXT_COMPLETION = "text_completion"
TRANSCRIPTION = "transcription"
MULTIMODAL_CHAT = "multimodal_chat"  # audio in it: runs alone, never batched
VISION_CHAT = "vision_chat"  # a chat on a vision model, images or not, no audio: joins the model's text batch if it can
EMBEDDING = "embedding"  # inputs to embed: encoded together with other embedding requests' inputs
CONTROL = "control"  # the admin API's load / unload / pin: runs alone, between requests


class QueueFull(Exception):
    """The queue holds more jobs than settings.max_queued allows."""


def lane_of(queue_name: str) -> str:
    """`interactive` or `batch`: which of the two a queue is, whatever model it is for."""
    return queue_name.split(MODEL_SEPARATOR, 1)[0]


def model_queue(lane: str, model_id: str | None) -> str:
    """The queue of `lane` for one model's dedicated workers (model_id None: the shared queue)."""
    return lane if model_id is None else f"{lane}{MODEL_SEPARATOR}{model_id}"


def worker_queue_names(models: list[str] | tuple[str, ...] | None) -> list[str]:
    """The queues a worker takes jobs from, interactive ones first: the shared two, or its models' own."""
    if not models:
        return list(WORKER_QUEUES)
    return [model_queue(lane, model) for lane in WORKER_QUEUES for model in models]


def known_worker_queues(connection: redis.Redis) -> list[str]:
    """Every worker queue RQ knows of (the shared two first, then the models' own, by name)."""
    names = {q.name for q in Queue.all(connection=connection, serializer=JSONSerializer)}
    dedicated = sorted(n for n in names if lane_of(n) in WORKER_QUEUES and n not in WORKER_QUEUES)
    return [*WORKER_QUEUES, *dedicated]


def new_job_id(kind: str) -> str:
    """Return a fresh, explicit, URL-safe job id such as `chatcmpl-3f2a...`."""
    return f"{kind}-{uuid.uuid4().hex}"


def fetch_job(connection: redis.Redis, job_id: str) -> Job | None:
    """Return the RQ job `job_id`, or None when it does not exist (or expired)."""
    try:
        return Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
    except NoSuchJobError:
        return None


def get_queue(name: str, connection: redis.Redis) -> Queue:
    """Return the RQ queue `name` using the JSON serializer (nothing in Redis is unpickled)."""
    return Queue(name, connection=connection, serializer=JSONSerializer)


def enqueue(
    connection: redis.Redis,
    settings: Settings,
    queue_name: str,
    func: str,
    payload: dict,
    job_id: str,
    description: str | None = None,
    timeout_s: int = 3600,
    at_front: bool = False,
    meta: dict | None = None,
    limited: bool = True,
):
    """Enqueue `func(payload)` with an explicit id and TTLs; raise QueueFull when over the limit.

    `limited=False` for work already accepted (a continuation): the limit keeps out new work only.
    """
    queue = get_queue(queue_name, connection)
    # The limit is checked in the same transaction as the push (no window between a check and the
    # push for other submitters): the job goes in first, the length after it decides, and a job over
    # the limit is taken back out.
    with connection.pipeline() as pipe:
        job = queue.enqueue(
            func, payload, job_id=job_id, description=description or func, job_timeout=timeout_s,
            result_ttl=settings.result_ttl_s, failure_ttl=settings.result_ttl_s, ttl=settings.result_ttl_s,
            at_front=at_front, meta=meta or {}, pipeline=pipe,
        )
        pipe.llen(queue.key)
        queued = pipe.execute()[-1]
    if limited and queued > settings.max_queued and _take_back(connection, queue, job):
        raise QueueFull(f"queue {queue_name!r} holds {queued - 1} jobs (limit {settings.max_queued})")
    return job


def _take_back(connection: redis.Redis, queue: Queue, job) -> bool:
    """Remove a just-enqueued job from its queue and Redis; False if a worker already took it (it runs)."""
    if not connection.lrem(queue.key, 1, job.id):
        return False
    job.delete(remove_from_queue=False)
    return True


def depths(connection: redis.Redis) -> list[dict]:
    """Each queue's waiting jobs and the oldest one's age in seconds (0 when empty), worker queues first."""
    rows = []
    for name in (*known_worker_queues(connection), WEBHOOKS):
        queue = get_queue(name, connection)
        oldest = next(iter(queue.get_job_ids(0, 1)), None)
        job = fetch_job(connection, oldest) if oldest else None
        age = (datetime.now(timezone.utc) - job.enqueued_at.replace(tzinfo=timezone.utc)).total_seconds() \
            if job is not None and job.enqueued_at else 0.0
        rows.append({"queue": name, "depth": queue.count, "oldest_age_s": round(max(0.0, age), 3)})
    return rows
