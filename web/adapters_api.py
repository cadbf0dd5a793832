"""The adapter admin API (/v1/adapters, the admin key only: web/auth.py): the LoRA adapters in the store and
where they are mounted; mount and unmount through control jobs, which the worker runs between pieces of work
(never beside a forward pass). A request may name any adapter made for its model: the worker applies it at
its first use, as it loads a model; mounting applies it ahead of time."""

from __future__ import annotations

from flask import jsonify
from marshmallow import Schema, fields, validate

from jobs import queues, workers
from jobs.adapters import AdapterNotFound, adapter_entry, list_adapters
from jobs.contract import AdapterRef, ControlRequest
from jobs.lifecycle import any_worker_alive
from web import intake
from web.errors import APIError
from web.jobrun import submit, wait_for_result
from web.jsonbody import Blueprint
from web.response_schemas import AnyObjectSchema
from web.services import services

blp = Blueprint("adapters", __name__, url_prefix="/v1/adapters",
                description="Operators: LoRA adapters, mounted and unmounted on the workers")


CONTROL_TIMEOUT_S = 600
"""RQ timeout of a mount (it may load the adapter's base model first)."""


class AdapterListSchema(Schema):
    """The adapters in the store."""

    object = fields.String(dump_default="list")
    data = fields.List(fields.Dict())


class MountSchema(Schema):
    """Which adapter to mount (on its base model)."""

    adapter = fields.String(required=True, validate=validate.Length(min=1, max=128),
                            metadata={"description": "An adapter's name in the adapter store (GET /v1/adapters)"})


def mounted(states: list[dict]) -> dict[str, list[dict]]:
    """Adapter name -> [{"worker", "model"}] of the live workers that have it applied (from their heartbeats)."""
    found: dict[str, list[dict]] = {}
    for state in states:
        for model in state.get("models") or []:
            for adapter in model.get("adapters") or []:
                found.setdefault(adapter["name"], []).append({"worker": state["name"], "model": model["id"]})
    return found


@blp.route("", methods=["GET"])
@blp.response(200, AdapterListSchema)
def list_all():
    """The adapters in the store: base model, rank, size, and the live workers that have each mounted."""
    svc = services()
    where = mounted(workers.states(svc.redis))
    return {"object": "list", "data": [{**a.public(), "mounted_on": where.get(a.name, [])}
                                       for a in list_adapters(svc.settings)]}


@blp.route("", methods=["POST"])
@blp.arguments(MountSchema())
@blp.response(200, AnyObjectSchema, description="What the worker holds after mounting")
def mount(body):
    """Mount an adapter: the worker applies it to its base model (loading the model if needed) between pieces of
    work; answered once it has."""
    return _control("mount", body["adapter"])


@blp.route("/<name>", methods=["DELETE"])
@blp.response(200, AnyObjectSchema, description="What the worker holds after unmounting")
def unmount(name: str):
    """Unmount an adapter (409 adapter_in_use while requests decode with it); answered once the worker has."""
    return _control("unmount", name)


def _control(action: str, name: str):
    """Run a mount or unmount as a control job and answer with the worker's reply."""
    svc = services()
    entry = adapter_entry(svc.settings, name)
    if entry is None:
        raise APIError(404, AdapterNotFound(name).public_message, "adapter_not_found", "adapter")
    try:
        info = intake.resolve_model(entry.base, "text")
    except APIError as exc:
        raise APIError(409, f"Adapter '{name}' is made for model '{entry.base}', which the store no longer has.",
                       "model_not_found", "adapter") from exc
    if not any_worker_alive(svc.redis):
        raise APIError(503, "No MLX worker is running to do this.", "no_worker", headers={"Retry-After": "5"})
    request = ControlRequest(queues.new_job_id("admin"), intake.model_ref(info), action,
                             adapter=AdapterRef(entry.name, str(entry.path), entry.base))
    submit(request, queues.CONTROL, f"admin {action} adapter {name} on {info.id}", timeout_s=CONTROL_TIMEOUT_S)
    return jsonify(wait_for_result(request.id))
