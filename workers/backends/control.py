"""The admin API's control jobs: load, unload, pin or unpin a model in this worker; mount or unmount a LoRA
adapter on one (workers/models.py applies it).

They come through the interactive queue like any request, so they run between the pieces of other
work on the scheduler's thread and never race a generation; a model that requests are using is
not unloaded (409 model_in_use).
"""

from __future__ import annotations

from collections.abc import Iterator

from jobs.contract import ControlRequest
from workers.backends.base import Outcome


class ControlBackend:
    """Control requests behind the backend interface (workers/backends/base.py)."""

    model_kind = None  # loads nothing itself: the model manager loads with the model's own backend
    model_kinds = frozenset({"text", "vision", "speech", "embedding"})
    resumable = False

    def run(self, request: ControlRequest, job, models) -> Iterator[Outcome | None]:
        """Do the action in one piece; answer with what the worker holds afterwards."""
        path = request.model.path
        if request.action == "load":
            changed = not models.holds(path)
            models.load(request.model)
        elif request.action == "pin":
            changed = models.pin(request.model)
        elif request.action == "unpin":
            changed = models.unpin(path)
        elif request.action == "mount":
            changed = models.mount(request.model, request.adapter)
        elif request.action == "unmount":
            changed = models.unmount(path, request.adapter.name)
        else:
            changed = models.unload(path)
        adapter = {"adapter": request.adapter.name} if request.adapter else {}
        yield Outcome({"object": "admin.model_action", "action": request.action, "model": request.model.id,
                       **adapter, "changed": changed, "resident": public_models(models.snapshot),
                       "used_bytes": models.used_bytes(), "budget_bytes": models.budget_bytes})


def public_models(snapshot: list[dict]) -> list[dict]:
    """Resident models as operators see them: no server paths."""
    return [{k: v for k, v in m.items() if k != "path"} for m in snapshot]
