"""Which queue a request goes to: its model's own queue when live workers are dedicated to the model
(`mlxq worker --models ...`), else the shared one; 503 when workers are live and none serves it.

With no live worker at all, a synchronous call is refused at once (503 `no_worker`: nobody would
answer it before its timeout), and an async job is queued on the shared queue (a worker that starts
later takes it). The live workers' declarations are read from their heartbeat state (jobs.workers)
at most once a ROUTES_TTL_S per web process.
"""

from __future__ import annotations

import time

from jobs import queues, workers
from web.errors import APIError
from web.services import Services, services

ROUTES_TTL_S = 1.0
"""How long a web process reuses the live workers' declarations (they heartbeat every second)."""


def queue_for(lane: str, model_id: str) -> str:
    """The queue of `lane` (interactive or batch) that a request for `model_id` goes to."""
    states = _live_states(services())
    if any(model_id in (s.get("serves") or ()) for s in states):
        return queues.model_queue(lane, model_id)
    if not states and lane != queues.BATCH:
        raise no_worker()
    if not states or any(not s.get("serves") for s in states):
        return lane
    served = sorted({m for s in states for m in s.get("serves") or ()})
    raise APIError(503, f"No live worker serves model '{model_id}'; the workers running serve: "
                        f"{', '.join(served)}. Start one with `mlxq worker --models {model_id}`.",
                   "model_not_served", "model", headers={"Retry-After": "5"})


def no_worker() -> APIError:
    """The 503 of a synchronous call that no live worker can take."""
    return APIError(503, "No MLX worker is running to answer this call; retry once one runs (`mlxq worker`, "
                         "or `mlxq up`). Async jobs (/v1/jobs) are accepted meanwhile and wait for one.",
                    "no_worker", headers={"Retry-After": "5"})


def any_worker_takes(svc: Services, queue: str) -> bool:
    """Whether a live worker takes jobs from `queue` (as of at most ROUTES_TTL_S ago)."""
    return any(queue in (s.get("queues") or ()) for s in _live_states(svc))


def any_worker_live(svc: Services) -> bool:
    """Whether any worker is live (as of at most ROUTES_TTL_S ago)."""
    return bool(_live_states(svc))


def _live_states(svc: Services) -> list[dict]:
    """The live workers' states, cached for ROUTES_TTL_S in this process (so a worker that has just
    started is seen within that; an empty answer is kept too: with no worker, every call would scan
    the keyspace for one)."""
    cached = getattr(svc, "_routes", None)
    if cached is None or time.monotonic() > cached[0]:
        cached = (time.monotonic() + ROUTES_TTL_S, workers.states(svc.redis))
        svc._routes = cached
    return cached[1]
