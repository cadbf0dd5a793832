"""Which queue a request goes to: its model's own queue when live workers are dedicated to the model
(`mlxq worker --models ...`), else the shared one; 503 when workers are live and none serves it.

With no live worker at all the request is queued on the shared queue as before: a worker that is
starting or restarting takes it (nothing accepted is lost). The live workers' declarations are
read from their heartbeat state (jobs.workers) at most once a ROUTES_TTL_S per web process.
"""

from __future__ import annotations

import time

from jobs import queues, workers
from web.errors import APIError
from web.services import services

ROUTES_TTL_S = 1.0
"""How long a web process reuses the live workers' declarations (they heartbeat every second)."""


def queue_for(lane: str, model_id: str) -> str:
    """The queue of `lane` (interactive or batch) that a request for `model_id` goes to."""
    states = _live_states()
    if any(model_id in (s.get("serves") or ()) for s in states):
        return queues.model_queue(lane, model_id)
    if not states or any(not s.get("serves") for s in states):
        return lane
    served = sorted({m for s in states for m in s.get("serves") or ()})
    raise APIError(503, f"No live worker serves model '{model_id}'; the workers running serve: "
                        f"{', '.join(served)}. Start one with `mlxq worker --models {model_id}`.",
                   "model_not_served", "model", headers={"Retry-After": "5"})


def _live_states() -> list[dict]:
    """The live workers' states, cached for ROUTES_TTL_S in this process."""
    svc = services()
    cached = getattr(svc, "_routes", None)
    if cached is None or time.monotonic() > cached[0]:
        cached = (time.monotonic() + ROUTES_TTL_S, workers.states(svc.redis))
        svc._routes = cached
    return cached[1]
