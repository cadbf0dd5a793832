"""POST /v1/messages: Anthropic's Messages API, run as a chat job, with Anthropic's shapes and errors.

Requests become chat completion bodies (validated like one: web/schemas.py), answers a `message`
object or Anthropic's event stream (message_start ... message_stop). Errors on /v1/messages,
wherever they arise (auth, validation, the worker), leave in Anthropic's error shape.
"""

from __future__ import annotations

import json

from flask import Flask, jsonify, request
from marshmallow import EXCLUDE, Schema, ValidationError, fields, validate, validates_schema

from jobs import queues
from jobs.events import DELTA, DONE
from web import intake
from web.errors import APIError
from web.jobrun import stream_response, submit, wait_for_result
from web.jsonbody import Blueprint
from web.media_parts import accepts_media_parts
from web.response_schemas import SSE, AnyObjectSchema, ServerSentEventSchema
from web.schemas import load_chat
from web.sse import sse_data

blp = Blueprint("messages", __name__, url_prefix="/v1/messages", description="Anthropic's Messages API")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error type for each status (others: api_error)."""

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


class MessagesRequestSchema(Schema):
    """POST /v1/messages body (tools are refused)."""

    class Meta:
        unknown = EXCLUDE

    model = fields.String(required=True)
    max_tokens = fields.Integer(strict=True, required=True, validate=validate.Range(min=1))
    messages = fields.List(fields.Dict(), required=True, validate=validate.Length(min=1))
    system = fields.Raw(load_default=None, allow_none=True)
    stop_sequences = fields.List(fields.String(), load_default=None, allow_none=True)
    temperature = fields.Float(load_default=None, allow_none=True, validate=validate.Range(min=0, max=1))
    top_p = fields.Float(load_default=None, allow_none=True)
    top_k = fields.Integer(strict=True, load_default=None, allow_none=True)
    stream = fields.Boolean(load_default=False, allow_none=True)
    metadata = fields.Dict(load_default=None, allow_none=True)
    tools = fields.List(fields.Dict(), load_default=None, allow_none=True)

    @validates_schema
    def _refuse_tools(self, data, **kwargs):
        if data.get("tools"):
            raise ValidationError("tool use is not supported by this server", field_name="tools")


@blp.route("", methods=["POST"])
@accepts_media_parts
@blp.arguments(MessagesRequestSchema())
@blp.response(200, AnyObjectSchema, description="A `message`; with `stream`, Anthropic's event stream")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def create_message(body):
    """Create a message (Anthropic's Messages API)."""
    chat = _as_chat(body)
    job = intake.chat_request(chat, queues.new_job_id("msg"))
    submit(job, intake.chat_func(job), f"message {job.model.id}")
    if body["stream"]:
        return stream_response(job.id, _events(job.id, job.model.id), _error_event, trailer=None)
    return jsonify(_message(job.id, job.model.id, wait_for_result(job.id)))


def _as_chat(body: dict) -> dict:
    """The chat completion body a Messages request runs as (400s name the Messages field)."""
    system = body["system"]
    if isinstance(system, list):
        system = "".join(block.get("text", "") for block in system if isinstance(block, dict))
    messages = ([{"role": "system", "content": system}] if system else [])
    messages += [_message_in(m, i) for i, m in enumerate(body["messages"])]
    return load_chat({"model": body["model"], "messages": messages, "max_tokens": body["max_tokens"],
                      "temperature": body["temperature"], "top_p": body["top_p"], "top_k": body["top_k"],
                      "stop": body["stop_sequences"][:4] if body["stop_sequences"] else None},
                     {"stop": "stop_sequences"})


def _message_in(message, index: int) -> dict:
    """One Messages message as a chat message (text and image blocks)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise APIError(400, f"messages.{index}.role: must be 'user' or 'assistant'", "invalid_value",
                       f"messages.{index}.role")
    content = message.get("content")
    if isinstance(content, str):
        return {"role": message["role"], "content": content}
    if not isinstance(content, list):
        raise APIError(400, f"messages.{index}.content: must be a string or a list of blocks", "invalid_value",
                       f"messages.{index}.content")
    return {"role": message["role"], "content": [_block(b, f"messages.{index}.content.{j}") for j, b in enumerate(content)]}


def _block(block, param: str) -> dict:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
        return {"type": "text", "text": block.get("text", "")}
    if kind == "image":
        source = block.get("source") or {}
        if source.get("type") == "base64":
            url = f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
        else:
            url = source.get("url") or ""
        return {"type": "image_url", "image_url": {"url": url}}
    raise APIError(400, f"{param}: blocks of type {kind!r} are not supported (text, image)", "invalid_value", param)


def _message(message_id: str, model: str, done: dict, text: str | None = None) -> dict:
    """Anthropic's `message` object from a chat job's `done` data."""
    choice = done["choices"][0]
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": choice["text"] if text is None else text}],
            "stop_reason": STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": done["usage"]["prompt_tokens"], "output_tokens": done["usage"]["completion_tokens"]}}


def _events(message_id: str, model: str):
    """A renderer of a chat job's events as Anthropic's stream."""
    started: list[bool] = []

    def event(kind: str, **data) -> str:
        return sse_data({"type": kind, **data}, event=kind)

    def frames(job_event: dict):
        if not started:
            started.append(True)
            yield event("message_start", message={"id": message_id, "type": "message", "role": "assistant",
                                                  "model": model, "content": [], "stop_reason": None,
                                                  "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})
            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        if job_event["type"] == DELTA:
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": job_event["data"]["text"]})
        elif job_event["type"] == DONE:
            final = _message(message_id, model, job_event["data"])
            yield event("content_block_stop", index=0)
            yield event("message_delta", delta={"stop_reason": final["stop_reason"], "stop_sequence": None},
                        usage={"output_tokens": final["usage"]["output_tokens"],
                               "input_tokens": final["usage"]["input_tokens"]})
            yield event("message_stop")

    return frames


def _error_event(error: dict) -> str:
    status = int(error.get("status") or 500)
    return sse_data({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                "message": error.get("message", "")}}, event="error")


def register_error_shape(app: Flask) -> None:
    """Rewrite error answers on /v1/messages into Anthropic's shape (the request id header stays)."""

    @app.after_request
    def _anthropic_errors(response):
        if not request.path.startswith("/v1/messages") or response.status_code < 400 or not response.is_json:
            return response
        error = (response.get_json(silent=True) or {}).get("error") or {}
        body = {"type": "error", "error": {"type": ERROR_TYPES.get(response.status_code, "api_error"),
                                           "message": error.get("message", "")},
                "request_id": response.headers.get("X-Request-ID")}
        response.set_data(json.dumps(body))
        return response
