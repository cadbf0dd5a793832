"""Queue names, the JSON serializer, the GPU worker's doorbell, and enqueueing with explicit ids and TTLs."""

from __future__ import annotations

import uuid

import redis
from rq import Queue
from rq import job as rq_job
from rq.exceptions import DequeueTimeout
from rq.serializers import JSONSerializer
from rq.utils import as_text, backend_class

from jobs import keys
from jobs.settings import Settings

INTERACTIVE = "interactive"
"""Synchronous OpenAI-style calls and admin control; the worker always drains it first."""

BATCH = "batch"
"""Async jobs (long transcriptions, async chat)."""

WEBHOOKS = "webhooks"
"""Webhook deliveries, drained by a plain RQ worker, never the GPU worker."""

WORKER_QUEUES = (INTERACTIVE, BATCH)
"""The GPU worker's queues, in priority order."""

# Job functions by dotted name: web enqueues by name so it never imports the worker (or MLX).
CHAT_COMPLETION = "workers.tasks.chat_completion"
TEXT_COMPLETION = "workers.tasks.text_completion"
TRANSCRIPTION = "workers.speech_tasks.transcribe"


class QueueFull(Exception):
    """The queue holds more jobs than settings.max_queued allows."""


def new_job_id(kind: str) -> str:
    """Return a fresh, explicit, URL-safe job id such as `chatcmpl-3f2a...`."""
    return f"{kind}-{uuid.uuid4().hex}"


DOORBELL_POLL_S = 1
"""Longest a worker blocks on the doorbell before it looks at the queues anyway (for jobs that rang
nothing)."""

# Claim the first job of the first non-empty queue, with what the worker reads before running it,
# in one atomic step. KEYS: the doorbell, then the queues in priority order. ARGV: RQ's job-key
# prefix, the cancel-flag prefix. Returns {queue key, job id, the job's hash as a flat list, its
# cancel flag} or nil. Ids whose job is gone are dropped, as RQ's dequeue does. Whenever jobs are
# left, the doorbell is left non-empty (jobs that rang nothing are then taken without a poll's
# wait); when none is left, every token in it is stale and it is emptied.
_CLAIM_LUA = """
local doorbell = KEYS[1]
for i = 2, #KEYS do
  local job_id = redis.call('LPOP', KEYS[i])
  while job_id do
    local job = redis.call('HGETALL', ARGV[1] .. job_id)
    if #job > 0 then
      local left = 0
      for j = i, #KEYS do left = left + redis.call('LLEN', KEYS[j]) end
      if left > 0 and redis.call('LLEN', doorbell) == 0 then redis.call('RPUSH', doorbell, 1) end
      return {KEYS[i], job_id, job, redis.call('EXISTS', ARGV[2] .. job_id)}
    end
    job_id = redis.call('LPOP', KEYS[i])
  end
end
redis.call('DEL', doorbell)
return false
"""


class DoorbellQueue(Queue):
    """RQ's Queue with a doorbell: the GPU worker wakes up to a reply that carries the job itself.

    Blocked on the queues (RQ's BLPOP), a worker is woken with a job's id only and must fetch the
    job in a second round trip, on a synchronous call's latency. So every job pushed on a GPU
    worker queue also pushes a token on the doorbell, in the same pipeline, after the job; and
    the worker sends, in one write, a BLPOP on the doorbell and the claim script, which Redis runs
    as soon as the BLPOP returns. Jobs pushed by others (rq-dashboard's requeue) ring nothing: the
    BLPOP times out after DOORBELL_POLL_S and the claim finds them.
    """

    def push_job_id(self, job_id: str, pipeline=None, at_front: bool = False):
        """Push the job's id (RQ), then a doorbell token when this is a GPU worker queue."""
        super().push_job_id(job_id, pipeline=pipeline, at_front=at_front)
        if self.name in WORKER_QUEUES:
            (self.connection if pipeline is None else pipeline).rpush(keys.WORKER_DOORBELL, 1)

    @classmethod
    def dequeue_any(cls, queues, timeout, connection, job_class=None, serializer=None, death_penalty_class=None):
        """RQ's dequeue (the first job of the first non-empty queue), in one round trip.

        With a timeout it waits on the doorbell for at most DOORBELL_POLL_S, then raises RQ's
        DequeueTimeout if nothing was claimed (RQ's worker loop heartbeats and waits again).
        The job's `cancel_flag_when_fetched` says whether a cancel had been asked for.
        """
        queue_keys = [queue.key for queue in queues]
        # EVAL with the script's text, not redis-py's Script (EVALSHA): in a pipeline, that first
        # asks SCRIPT EXISTS in a round trip of its own, the very round trip this saves.
        claim = (_CLAIM_LUA, 1 + len(queue_keys), keys.WORKER_DOORBELL, *queue_keys,
                 rq_job.Job.redis_job_namespace_prefix, keys.cancel_flag(""))
        if timeout is None:
            claimed = connection.eval(*claim)
        else:
            with connection.pipeline(transaction=False) as pipe:
                pipe.blpop([keys.WORKER_DOORBELL], min(timeout, DOORBELL_POLL_S))
                pipe.eval(*claim)
                claimed = pipe.execute()[1]
        if not claimed:
            if timeout is None:
                return None
            raise DequeueTimeout(timeout, queue_keys)
        queue_key, job_id, fields, canceled = claimed
        job_cls = backend_class(cls, "job_class", override=job_class)
        queue = cls.from_queue_key(as_text(queue_key), connection=connection, job_class=job_cls,
                                   serializer=serializer, death_penalty_class=death_penalty_class)
        job = job_cls(as_text(job_id), connection=connection, serializer=serializer)
        try:
            job.restore(dict(zip(fields[::2], fields[1::2], strict=True)))
        except Exception as exc:  # as RQ's dequeue: say which job and queue could not be read
            exc.job_id, exc.queue = job.id, queue
            raise
        job.cancel_flag_when_fetched = bool(canceled)
        return job, queue


def get_queue(name: str, connection: redis.Redis) -> Queue:
    """Return the RQ queue `name` using the JSON serializer (nothing in Redis is unpickled)."""
    return DoorbellQueue(name, connection=connection, serializer=JSONSerializer)


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
):
    """Enqueue `func(payload)` with an explicit id and TTLs; raise QueueFull when over the limit."""
    queue = get_queue(queue_name, connection)
    # One transaction: RQ alone would register the queue and then save and push the job in two round
    # trips, and the limit would need a third; every round trip is on a synchronous call's latency.
    # So the job goes in first and the length after it decides; a job over the limit is taken back.
    with connection.pipeline() as pipe:
        job = queue.enqueue(
            func,
            payload,
            job_id=job_id,
            description=description or func.rsplit(".", 1)[-1],
            job_timeout=timeout_s,
            result_ttl=settings.result_ttl_s,
            failure_ttl=settings.result_ttl_s,
            ttl=settings.result_ttl_s,
            at_front=at_front,
            meta=meta or {},
            pipeline=pipe,
        )
        pipe.llen(queue.key)
        queued = pipe.execute()[-1]
    if queued > settings.max_queued and _take_back(connection, queue, job):
        raise QueueFull(f"queue {queue_name!r} holds {queued - 1} jobs (limit {settings.max_queued})")
    return job


def _take_back(connection: redis.Redis, queue: Queue, job) -> bool:
    """Remove a just-enqueued job from its queue and Redis; False if a worker already took it (it runs)."""
    if not connection.lrem(queue.key, 1, job.id):
        return False
    job.delete(remove_from_queue=False)
    return True
