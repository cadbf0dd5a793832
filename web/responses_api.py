"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API, run as chat jobs (web/responses.py)."""

from __future__ import annotations

from flask import jsonify
from marshmallow import EXCLUDE, Schema, ValidationError, fields, validate, validates_schema

from jobs import queues
from jobs.events import DELTA, DONE
from web import intake
from web import responses as rs
from web import responses_background as background
from web import responses_tools as tools
from web.auth import caller
from web.errors import APIError
from web.jobrun import stream_response, submit, wait_for_result
from web.jsonbody import Blueprint
from web.media_parts import accepts_media_parts
from web.response_schemas import SSE, AnyObjectSchema, ServerSentEventSchema
from web.schemas import load_chat
from web.services import services
from web.sse import sse_data

blp = Blueprint("responses", __name__, url_prefix="/v1/responses", description="OpenAI's Responses API")

CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}
"""The chat fields a Responses request becomes, and the fields an error about them names."""


class ResponsesRequestSchema(Schema):
    """POST /v1/responses body (the subset mlxq serves; of tools, function tools)."""

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
    svc, who = services(), caller()
    previous = None
    if body["previous_response_id"]:
        previous = rs.load_stored(svc.redis, body["previous_response_id"], who.owner, who.admin)
        if previous is None:
            raise APIError(404, f"No stored response '{body['previous_response_id']}' (it may have expired).",
                           "previous_response_not_found", "previous_response_id")
        if background.refresh(svc, previous)["status"] not in ("completed", "incomplete"):
            raise APIError(400, f"Response '{body['previous_response_id']}' has not completed.", "invalid_value",
                           "previous_response_id")
        previous = rs.load_stored(svc.redis, body["previous_response_id"], who.owner, who.admin)
    body["model"] = body["model"] or (previous["response"]["model"] if previous else None)
    messages = rs.to_messages(body, previous)
    try:
        request = intake.chat_request(_as_chat(body, messages), queues.new_job_id("resp"),
                                      is_async=bool(body["background"]))
    except APIError as exc:  # checked as a chat: name the Responses field
        exc.param = _responses_param(exc.param)
        raise
    body["model"] = request.model.id
    created, ttl = rs.now(), svc.settings.result_ttl_s
    if body["background"]:
        return jsonify(background.start(svc, request, body, messages, who.owner, created))
    submit(request, intake.chat_func(request), f"response {request.model.id}")
    keep = (svc.redis, who.owner, ttl) if body["store"] else None
    if body["stream"]:
        return stream_response(request.id, _events(request.id, body, created, messages, keep),
                               lambda error: _error_event(error), trailer=None)
    done = wait_for_result(request.id)
    response = rs.response_object(request.id, body, created, "completed", done)
    if keep:
        rs.store(keep[0], response, messages + [rs.answer(done)], keep[1], keep[2])
    return jsonify(response)


@blp.route("/<response_id>", methods=["GET"])
@blp.response(200, AnyObjectSchema)
def get_response(response_id: str):
    """A stored response (its creator's key, or the admin key); a background one as its job stands now."""
    return jsonify(background.refresh(services(), _stored_or_404(response_id)))


@blp.route("/<response_id>/cancel", methods=["POST"])
@blp.response(200, AnyObjectSchema)
def cancel_response(response_id: str):
    """Cancel a background response: at once while queued, at its next piece while running."""
    return jsonify(background.cancel(services(), _stored_or_404(response_id)))


def _stored_or_404(response_id: str) -> dict:
    who = caller()
    stored = rs.load_stored(services().redis, response_id, who.owner, who.admin)
    if stored is None:
        raise APIError(404, f"No stored response '{response_id}' (it may have expired).", "response_not_found", "id")
    return stored


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
                      "response_format": response_format}, CHAT_FIELDS)
    return {**chat, **tools.chat_fields(body)}  # checked tools: not chat's fields, so added after loading


def _responses_param(param: str | None) -> str | None:
    """A chat field's name in an error as the Responses field it came from."""
    for chat, responses in {**CHAT_FIELDS, "response_format.json_schema": "text.format"}.items():
        if param and (param == chat or param.startswith(chat + ".")):
            return responses + param[len(chat):]
    return param


def _events(response_id: str, body: dict, created: int, messages: list[dict], keep):
    """A renderer of a chat job's events as the Responses stream (response.created ... response.completed).

    The message item opens at the first text that is not whitespace (an answer that only calls a tool
    has none: its output is the calls alone, as in the plain response). The calls follow it as
    function_call items once the answer is done: they come after the message, which holds all the text
    (a forced call ends the answer anyway)."""
    sequence = iter(range(1 << 62))
    item_id = rs.message_item(response_id, "")["id"]
    state = {"started": False, "open": False, "held": ""}  # held: leading whitespace, sent once the item opens

    def event(kind: str, **data) -> str:
        return sse_data({"type": kind, "sequence_number": next(sequence), **data}, event=kind)

    def open_message():
        state["open"], held = True, state["held"]
        state["held"] = ""
        yield event("response.output_item.added", output_index=0,
                    item={**rs.message_item(response_id, "", "in_progress"), "content": []})
        yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": []})
        if held:
            yield text_delta(held)

    def text_delta(delta: str) -> str:
        return event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0, delta=delta,
                     logprobs=[])

    def on_text(piece: str):
        if state["open"]:
            if piece:  # a delta that only completed a call has no text
                yield text_delta(piece)
        elif (state["held"] + piece).strip():
            state["held"] += piece
            yield from open_message()
        else:
            state["held"] += piece

    def on_done(done: dict):
        response = rs.response_object(response_id, body, created, "completed", done)
        output = response["output"]
        if output and output[0]["type"] == "message":
            if not state["open"]:  # an answer of whitespace alone, without calls: still a message
                yield from open_message()
            final = done["choices"][0]["text"]
            yield event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=final,
                        logprobs=[])
            yield event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                        part={"type": "output_text", "text": final, "annotations": []})
            yield event("response.output_item.done", output_index=0, item=output[0])
        for index, item in enumerate(output):
            if item["type"] == "function_call":
                yield from tools.call_events(event, item, index)
        if keep:
            rs.store(keep[0], response, messages + [rs.answer(done)], keep[1], keep[2])
        yield event("response.completed", response=response)

    def frames(job_event: dict):
        if not state["started"]:
            state["started"] = True
            yield event("response.created", response=rs.response_object(response_id, body, created, "in_progress"))
            yield event("response.in_progress", response=rs.response_object(response_id, body, created, "in_progress"))
        if job_event["type"] == DELTA:  # its tool_calls wait for the done event (see above)
            yield from on_text(job_event["data"]["text"])
        elif job_event["type"] == DONE:
            yield from on_done(job_event["data"])

    return frames


def _error_event(error: dict) -> str:
    """The stream's `error` event for a job that failed."""
    return sse_data({"type": "error", "code": error.get("code"), "message": error.get("message"), "param": None,
                     "sequence_number": 0}, event="error")
