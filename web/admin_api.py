"""The admin API (/v1/admin/, the admin key only: web/auth.py): the workers, the queues, and models
loaded, unloaded or pinned through control jobs, which the worker runs between requests."""

from __future__ import annotations

from flask import jsonify
from marshmallow import Schema, fields, validate

from jobs import queues, workers
from jobs.contract import ControlRequest
from jobs.lifecycle import any_worker_alive
from web import intake
from web.errors import APIError
from web.jobrun import submit, wait_for_result
from web.jsonbody import Blueprint
from web.response_schemas import AnyObjectSchema
from web.services import services

blp = Blueprint("admin", __name__, url_prefix="/v1/admin", description="Operators: workers, queues, models")

CONTROL_TIMEOUT_S = 600
"""RQ timeout of a control job (a large model's load)."""


class ModelActionSchema(Schema):
    """Which model to act on."""

    model = fields.String(required=True, validate=validate.Length(min=1, max=512),
                          metadata={"description": "A model id, alias or store name (GET /v1/models)"})


class ListSchema(Schema):
    """A list of objects."""

    object = fields.String(dump_default="list")
    data = fields.List(fields.Dict())


@blp.route("/workers", methods=["GET"])
@blp.response(200, ListSchema)
def list_workers():
    """Live MLX workers: host, device, memory budget and use, resident memory and MLX's (active, cached, peak),
    resident (and pinned) models, jobs in hand."""
    return {"object": "list", "data": workers.states(services().redis)}


@blp.route("/queues", methods=["GET"])
@blp.response(200, ListSchema)
def list_queues():
    """Each queue's waiting jobs and the age of the oldest, in seconds."""
    return {"object": "list", "data": queues.depths(services().redis)}


@blp.route("/models/<any(load, unload, pin, unpin):action>", methods=["POST"])
@blp.arguments(ModelActionSchema())
@blp.response(200, AnyObjectSchema, description="What the worker holds after the action")
def model_action(body, action: str):
    """Load, unload, pin (load and never evict) or unpin a model; answered once the worker has done it."""
    info = intake.resolve_model(body["model"], ("text", "vision", "speech", "embedding"))
    svc = services()
    if not any_worker_alive(svc.redis):
        raise APIError(503, "No MLX worker is running to do this.", "no_worker", headers={"Retry-After": "5"})
    request = ControlRequest(queues.new_job_id("admin"), intake.model_ref(info), action)
    submit(request, queues.CONTROL, f"admin {action} {info.id}", timeout_s=CONTROL_TIMEOUT_S)
    return jsonify(wait_for_result(request.id))  # a Response: flask-smorest sends it as it is
