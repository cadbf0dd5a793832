"""The admin API (/v1/admin/, the admin key only: web/auth.py): the workers, the queues, models loaded,
unloaded or pinned through control jobs (which the worker runs between requests), each key's usage and limits."""

from __future__ import annotations

from datetime import date

from flask import jsonify
from marshmallow import Schema, fields, validate

from jobs import limits, queues, usage, workers
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


class UsageQuerySchema(Schema):
    """Which days and which key."""

    start = fields.Date(load_default=None, metadata={"description": "First UTC day, YYYY-MM-DD (default: end)"})
    end = fields.Date(load_default=None, metadata={"description": "Last UTC day, YYYY-MM-DD (default: today)"})
    key = fields.String(load_default=None, validate=validate.Length(min=1, max=256),
                        metadata={"description": "One key: its id (as listed here), or the key itself"})


@blp.route("/usage", methods=["GET"])
@blp.arguments(UsageQuerySchema(), location="query")
@blp.response(200, ListSchema)
def usage_report(query):
    """What each key used per model and UTC day (model `*`: the key's day total): requests answered, prompt,
    completion and cached tokens, audio seconds, images, embedding inputs. Keys are named by their ids."""
    end = (query["end"] or date.fromisoformat(usage.today())).isoformat()
    start = query["start"].isoformat() if query["start"] else end
    try:
        days = usage.days_between(start, end)
    except ValueError as exc:
        raise APIError(400, f"Bad usage range: {exc}.", "invalid_value", "start") from None
    owner = None if query["key"] is None else _owner(query["key"])
    return {"object": "list", "data": usage.read(services().redis, days, owner)}


def _owner(name: str) -> str:
    """A key's id, from the id or the key itself (`anonymous`: an open server's callers)."""
    return "" if name == usage.ANONYMOUS else limits.entry_name(name)


class LimitsSchema(Schema):
    """One key's limits: each a number >= 0, or null (no limit), and its fair-share weight; a field left out is null."""

    requests_per_minute = fields.Integer(allow_none=True, load_default=None, validate=validate.Range(min=0))
    concurrent = fields.Integer(allow_none=True, load_default=None, validate=validate.Range(min=0),
                                metadata={"description": "Synchronous requests in flight at once"})
    queued = fields.Integer(allow_none=True, load_default=None, validate=validate.Range(min=0),
                            metadata={"description": "Async jobs queued or running at once"})
    tokens_per_day = fields.Integer(allow_none=True, load_default=None, validate=validate.Range(min=0),
                                    metadata={"description": "Prompt + completion tokens per UTC day"})
    audio_seconds_per_day = fields.Float(allow_none=True, load_default=None, validate=validate.Range(min=0))
    share = fields.Float(allow_none=True, load_default=None,
                         validate=validate.Range(min=limits.MIN_SHARE, max=limits.MAX_SHARE),
                         metadata={"description": "The key's weight in the worker's fair share (null: 1)"})


class KeyLimitsSchema(LimitsSchema):
    """The limits of one key (or of `default`), and where they come from."""

    key = fields.String(metadata={"description": "The key's id (or `default`)"})
    source = fields.String(metadata={"description": "admin, file, admin default, file default or none"})


class DeletedLimitsSchema(Schema):
    """An admin API entry removed."""

    key = fields.String()
    deleted = fields.Boolean()


class AllLimitsSchema(Schema):
    """Every entry, by key id or `default`: the file's and the admin API's."""

    file = fields.Dict(keys=fields.String(), values=fields.Dict())
    admin = fields.Dict(keys=fields.String(), values=fields.Dict())


@blp.route("/limits", methods=["GET"])
@blp.response(200, AllLimitsSchema)
def list_limits():
    """Every entry of per-key limits: the file's (MLXQ_KEY_LIMITS) and the admin API's (which win), by key id
    or `default`."""
    svc = services()
    return {"file": {name: entry.as_dict() for name, entry in svc.key_limits.items()},
            "admin": {name: entry.as_dict() for name, entry in limits.overrides(svc.redis).items()}}


@blp.route("/limits/<name>", methods=["GET"])
@blp.response(200, KeyLimitsSchema)
def get_limits(name: str):
    """The limits that apply to a key (its id, the key itself, or `default`), and where they come from."""
    svc = services()
    owner = limits.entry_name(name)
    found, source = limits.effective(svc.redis, svc.key_limits, owner)
    return {"key": owner, "source": source, **found.as_dict()}


@blp.route("/limits/<name>", methods=["PUT"])
@blp.arguments(LimitsSchema())
@blp.response(200, KeyLimitsSchema)
def put_limits(body, name: str):
    """Set a key's limits (its id, the key itself, or `default`), over the file's; at once on every web process."""
    stored = limits.set_override(services().redis, name, limits.Limits(**body))
    return {"key": stored, "source": "admin", **body}


@blp.route("/limits/<name>", methods=["DELETE"])
@blp.response(200, DeletedLimitsSchema)
def delete_limits(name: str):
    """Remove a key's admin API limits (the file's entry, if any, applies again)."""
    svc = services()
    if not limits.clear_override(svc.redis, name):
        raise APIError(404, f"No admin API limits for {limits.entry_name(name)}.", "not_found")
    return {"key": limits.entry_name(name), "deleted": True}
