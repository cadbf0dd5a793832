"""Every Redis key mlxq writes besides RQ's own, in one place."""

PREFIX = "mlxq"


def event_channel(job_id: str) -> str:
    """Pub/sub channel on which a job's events are published live."""
    return f"{PREFIX}:events:{job_id}"


EVENT_PATTERN = f"{PREFIX}:events:*"
"""Pattern the web tier's single pub/sub connection listens on."""


def event_log(job_id: str) -> str:
    """List holding a job's capped replay log (JSON events, oldest first)."""
    return f"{PREFIX}:log:{job_id}"


def event_seq(job_id: str) -> str:
    """Counter giving a job's events their monotonically increasing ids."""
    return f"{PREFIX}:seq:{job_id}"


def cancel_flag(job_id: str) -> str:
    """Set when a client asked to cancel the job (or disconnected from its stream)."""
    return f"{PREFIX}:cancel:{job_id}"


def worker_alive(worker_name: str) -> str:
    """Liveness key the worker refreshes every heartbeat; it expires when the worker dies."""
    return f"{PREFIX}:worker:{worker_name}:alive"


WORKER_ALIVE_PATTERN = f"{PREFIX}:worker:*:alive"
"""Pattern matching every live worker's liveness key."""


def record_key(job_id: str) -> str:
    """Hash holding an async job's record (jobs.records)."""
    return f"{PREFIX}:jobrec:{job_id}"


def result_key(job_id: str) -> str:
    """String holding an async job's result (JSON), kept apart so reading a record stays cheap."""
    return f"{PREFIX}:jobresult:{job_id}"


def conversation_key(job_id: str) -> str:
    """String holding the conversation a stored response's job ran (JSON chat messages, its answer left out:
    that is its result), which `previous_response_id` continues; kept apart like the result."""
    return f"{PREFIX}:jobconv:{job_id}"


def checkpoint_key(job_id: str) -> str:
    """Hash of a long job's checkpoint (jobs.checkpoints): its state, what was published, its continuations."""
    return f"{PREFIX}:ckpt:{job_id}"


def checkpoint_segments(job_id: str) -> str:
    """Hash of a checkpointed job's items by id (JSON; a transcription's segments), kept across resumed runs."""
    return f"{PREFIX}:ckpt:{job_id}:segments"


def worker_state(worker_name: str) -> str:
    """JSON the worker writes every heartbeat: resident models, memory, the jobs in hand (jobs.workers)."""
    return f"{PREFIX}:worker:{worker_name}:state"


WORKER_STATE_PATTERN = f"{PREFIX}:worker:*:state"
"""Pattern matching every live worker's state key."""


JOBS_INDEX = f"{PREFIX}:jobs"
"""Sorted set of every listed job id, scored by creation time (/v1/jobs, newest first: jobs.records)."""


def owner_index(owner: str) -> str:
    """Sorted set of the job ids one owner created, scored like JOBS_INDEX (its listing)."""
    return f"{JOBS_INDEX}:owner:{owner or 'anonymous'}"


def metric_key(name: str) -> str:
    """Hash holding one metric kept in Redis (jobs.metrics): a field per label values."""
    return f"{PREFIX}:metrics:{name}"


KEY_LIMITS = f"{PREFIX}:limits"
"""Hash of per-key limits set through the admin API: a key's id (or `default`) -> JSON limits (jobs.limits)."""


def owner_requests(owner: str) -> str:
    """Sorted set of one key's requests in the last minute, scored by arrival (its requests-per-minute limit)."""
    return f"{PREFIX}:rate:{owner or 'anonymous'}:minute"


def owner_in_flight(owner: str) -> str:
    """Sorted set of one key's synchronous requests in flight, scored by when each is presumed gone (its
    concurrency limit: a web process that dies mid-request cannot leave its entries forever)."""
    return f"{PREFIX}:rate:{owner or 'anonymous'}:inflight"


def owner_queued(owner: str) -> str:
    """Sorted set of one key's async jobs not yet ended, scored by submission (its queued-jobs limit)."""
    return f"{PREFIX}:rate:{owner or 'anonymous'}:queued"


def usage(day: str, owner: str) -> str:
    """Hash of what one key used on one UTC day (YYYY-MM-DD): `<model>|<figure>` -> amount (jobs.usage)."""
    return f"{PREFIX}:usage:{day}:{owner or 'anonymous'}"


def usage_pattern(day: str) -> str:
    """Pattern matching every key's usage hash of one day."""
    return f"{PREFIX}:usage:{day}:*"


def worker_loads(queue_names: list[str]) -> str:
    """Hash of the text requests each worker taking from these queues holds: worker name -> "<count>:<unix time>"
    (workers/admission.py shares a burst out by it)."""
    return f"{PREFIX}:loads:{','.join(sorted(queue_names))}"
