"""POST /v1/responses, GET /v1/responses/{id} and its cancel: OpenAI's Responses API, run as chat jobs
(web/responses.py), answered by web/render/responses.py."""

from __future__ import annotations

from flask import jsonify
from marshmallow import EXCLUDE, Schema, ValidationError, fields, validate, validates_schema

from jobs import queues, records
from jobs.lifecycle import cancel_queued, request_cancel, settle
from web import intake
from web import responses as rs
from web import responses_tools as tools
from web.auth import caller
from web.errors import APIError
from web.jobrun import answer, stream_response, submit, submit_async, submit_recorded
from web.jsonbody import Blueprint
from web.media_parts import accepts_media_parts
from web.render.responses import Responses, echo, from_record
from web.response_schemas import SSE, AnyObjectSchema, ServerSentEventSchema
from web.schemas import (
    PENALTY_FIELDS,
    REASONING_EFFORTS,
    NotYet,
    PenaltiesSchema,
    adapter_field,
    keep_alive_field,
    load_chat,
)
from web.services import services

blp = Blueprint("responses", __name__, url_prefix="/v1/responses", description="OpenAI's Responses API")

CHAT_TIMEOUT_S = 3600
"""RQ timeout of a background response's job."""

CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format",
               "reasoning_effort": "reasoning.effort"}
"""The chat fields a Responses request becomes, and the fields an error about them names."""


class ReasoningSchema(Schema):
    """`reasoning`: how much a reasoning model thinks (`effort`, as chat's reasoning_effort) and its summary, which
    is the whole reasoning (an open model's thinking is not hidden): 'auto' and 'detailed' give it, 'concise'
    would need a summarizer mlxq does not have."""

    class Meta:
        unknown = EXCLUDE

    effort = fields.String(load_default=None, allow_none=True, validate=validate.OneOf(REASONING_EFFORTS))
    summary = fields.String(load_default=None, allow_none=True, validate=validate.OneOf(
        ("auto", "detailed"), error="must be 'auto' or 'detailed' (mlxq gives the whole reasoning; it does not "
                                    "shorten it)"))
    generate_summary = fields.String(load_default=None, allow_none=True, validate=validate.OneOf(
        ("auto", "detailed"), error="must be 'auto' or 'detailed' (mlxq gives the whole reasoning)"))


class ResponsesRequestSchema(PenaltiesSchema):
    """POST /v1/responses body (the subset mlxq serves; of tools, function tools), plus chat's penalties and
    logit_bias: not fields of OpenAI's Responses API, so mlxq's own here, honoured as on chat."""

    class Meta:
        unknown = EXCLUDE

    model = fields.String(load_default=None, allow_none=True)
    input = fields.Raw(required=True, metadata={"description": "A string, or a list of message items"})
    instructions = fields.String(load_default=None, allow_none=True)
    max_output_tokens = fields.Integer(strict=True, load_default=None, allow_none=True, validate=validate.Range(min=1))
    temperature = fields.Float(load_default=None, allow_none=True)
    top_p = fields.Float(load_default=None, allow_none=True)
    stream = fields.Boolean(load_default=False, allow_none=True)
    store = fields.Boolean(load_default=True, allow_none=True)
    previous_response_id = fields.String(load_default=None, allow_none=True)
    text = fields.Dict(load_default=None, allow_none=True)
    metadata = fields.Dict(load_default=None, allow_none=True)
    background = fields.Boolean(load_default=False, allow_none=True)
    # Each tool and the choice are checked by web/responses_tools.py, whose 400s name them (tools[2].type).
    tools = fields.List(fields.Raw(), load_default=None, allow_none=True)
    tool_choice = fields.Raw(load_default=None, allow_none=True)
    parallel_tool_calls = fields.Boolean(load_default=True, allow_none=True)
    reasoning = fields.Nested(ReasoningSchema, load_default=None, allow_none=True)
    adapter = adapter_field()  # mlxq's own, as on chat
    keep_alive = keep_alive_field()  # Ollama's, as on chat
    # OpenAI's Responses fields that would change the answer and that mlxq does not serve.
    conversation = NotYet("keep conversations objects; continue with `previous_response_id`", passes=())
    include = NotYet("add included outputs to a response", passes=([],))
    top_logprobs = NotYet("give logprobs on Responses; chat completions do", passes=(0,))
    prompt = NotYet("keep prompt templates", passes=())
    max_tool_calls = NotYet("limit tool calls", passes=())
    truncation = NotYet("truncate a conversation to fit (a prompt too long is refused)", passes=("disabled",))

    @validates_schema
    def _check_input(self, data, **kwargs):
        """`input` is a string or a list of items, not empty."""
        if not isinstance(data.get("input"), (str, list)) or not data["input"]:
            raise ValidationError("must be a non-empty string or list of items", field_name="input")


@blp.route("", methods=["POST"])
@accepts_media_parts
@blp.arguments(ResponsesRequestSchema())
@blp.response(200, AnyObjectSchema, description="A `response` object; with `stream`, the Responses event "
              "sequence (response.created ... response.completed)")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def create_response(body):
    """Create a model response (plain JSON, or its stream of events)."""
    previous = _previous(body["previous_response_id"]) if body["previous_response_id"] else None
    body["model"] = body["model"] or (previous[0]["model"] if previous else None)
    messages = rs.to_messages(body, previous[1] if previous else None)
    keep = bool(body["store"]) and rs.storable(messages)
    try:  # a stored response keeps a record, which its job's end completes (as an async job's)
        request = intake.chat_request(_as_chat(body, messages), queues.new_job_id("resp"), is_async=keep)
    except APIError as exc:  # checked as a chat: name the Responses field
        exc.param = _responses_param(exc.param)
        raise
    body["model"] = request.model.id
    # The response repeats what the answer was made with: the model's defaults for what the request left out.
    body["temperature"], body["top_p"] = request.sampling.temperature, request.sampling.top_p
    body["max_output_tokens"] = request.sampling.max_tokens
    out = Responses(request.id, echo(body, rs.now()))
    fields = {"model": request.model.id, "metadata": body.get("metadata") or {}, "response": out.echoed}
    if body["background"]:
        return jsonify(_background(request, body, keep, fields, messages, out))
    if keep:
        submit_recorded(request, "chat", fields, intake.chat_func(request), f"response {request.model.id}",
                        listed=False, conversation=messages)
    else:
        submit(request, intake.chat_func(request), f"response {request.model.id}")
    return stream_response(request.id, out) if body["stream"] else answer(request.id, out)


def _background(request, body: dict, keep: bool, fields: dict, messages: list[dict], out: Responses) -> dict:
    """Queue a background response: a plain async chat job (/v1/jobs lists it) whose record is the stored
    response; return it `queued`."""
    if body["stream"] or not body["store"]:
        raise APIError(400, "A background response is stored and fetched later: it takes neither `stream` nor "
                            "`store: false`.", "invalid_value", "background")
    if not keep:
        raise APIError(400, f"A background response is stored, and this conversation is over the store's "
                            f"{rs.MAX_STORED_BYTES} bytes.", "invalid_value", "background")
    submit_async(request, "chat", fields, intake.chat_func(request), f"response {request.model.id} (background)",
                 CHAT_TIMEOUT_S, {"kind": "chat", "model": request.model.id}, conversation=messages)
    return out.pending("queued")


@blp.route("/<response_id>", methods=["GET"])
@blp.response(200, AnyObjectSchema)
def get_response(response_id: str):
    """A stored response (its creator's key, or the admin key), as its job stands now."""
    return jsonify(_current(response_id))


@blp.route("/<response_id>/cancel", methods=["POST"])
@blp.response(200, AnyObjectSchema)
def cancel_response(response_id: str):
    """Cancel a background response: at once while queued, at its next piece while running."""
    svc, response = services(), _current(response_id)
    if not response["background"]:
        raise APIError(400, "Only a background response can be canceled.", "invalid_value", "id")
    if response["status"] in ("queued", "in_progress") and not cancel_queued(svc.redis, svc.settings, response_id):
        request_cancel(svc.redis, response_id, svc.settings.result_ttl_s)
    current = _current(response_id)
    if current["status"] == "queued":  # a worker took it off the queue and has not marked it started yet:
        current = {**current, "status": "in_progress"}  # it stops at its first piece, as a running one does
    return jsonify(current)


def _current(response_id: str, missing: str = "response_not_found", param: str = "id") -> dict:
    """A stored response as its job's record stands now (a job whose worker died ends now, not at the
    next sweep); 404 naming `param` when there is none."""
    svc = services()
    record = rs.stored(svc.redis, response_id, caller())
    if record is None:
        raise APIError(404, f"No stored response '{response_id}' (it may have expired).", missing, param)
    if record["status"] not in records.TERMINAL and settle(svc.redis, svc.settings, response_id):
        record = records.load(svc.redis, response_id) or record
    return from_record(record, records.get_result(svc.redis, response_id))


def _previous(response_id: str) -> tuple[dict, list[dict]]:
    """The response `previous_response_id` names, and the conversation it continues (400 unless completed)."""
    response = _current(response_id, "previous_response_not_found", "previous_response_id")
    if response["status"] not in ("completed", "incomplete"):
        raise APIError(400, f"Response '{response_id}' has not completed.", "invalid_value", "previous_response_id")
    svc = services()
    messages = rs.conversation(svc.redis, response_id, records.get_result(svc.redis, response_id))
    if messages is None:
        raise APIError(404, f"No stored response '{response_id}' (it may have expired).",
                       "previous_response_not_found", "previous_response_id")
    return response, messages


def _as_chat(body: dict, messages: list[dict]) -> dict:
    """The chat completion body a Responses request runs as, validated like one (400s name the Responses field)."""
    fmt = ((body.get("text") or {}).get("format")) or {"type": "text"}
    if not isinstance(fmt, dict):
        raise APIError(400, "'text.format' must be an object such as {\"type\": \"json_schema\", \"name\", "
                            "\"schema\"}.", "invalid_value", "text.format")
    response_format = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}} \
        if fmt.get("type") == "json_schema" else fmt
    chat = load_chat({"model": body["model"], "messages": messages, "max_tokens": body["max_output_tokens"],
                      "temperature": body["temperature"], "top_p": body["top_p"],
                      "response_format": response_format,
                      "reasoning_effort": (body.get("reasoning") or {}).get("effort"),
                      "adapter": body["adapter"], "keep_alive": body["keep_alive"]}, CHAT_FIELDS)
    # Checked already (tools here, the penalties by the schema, whose logit_bias keys are ints now, which
    # chat's schema cannot load again): added after loading, under chat's names, which are the same.
    return {**chat, **tools.chat_fields(body), **{name: body[name] for name in PENALTY_FIELDS}}


def _responses_param(param: str | None) -> str | None:
    """A chat field's name in an error as the Responses field it came from."""
    for chat, responses in {**CHAT_FIELDS, "response_format.json_schema": "text.format"}.items():
        if param and (param == chat or param.startswith(chat + ".")):
            return responses + param[len(chat):]
    return param
