"""POST /v1/messages: Anthropic's Messages API, run as a chat job, with Anthropic's shapes and errors.

Requests become chat completion bodies (validated like one: web/schemas.py), answers a `message`
object or Anthropic's event stream (message_start ... message_stop). Errors on /v1/messages,
wherever they arise (auth, validation, the worker), leave in Anthropic's error shape.
"""

from __future__ import annotations

import json

from flask import Flask, jsonify, request
from marshmallow import EXCLUDE, Schema, fields, validate

from jobs import queues
from jobs.events import DELTA, DONE
from web import intake
from web import messages_tools as mt
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

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""The worker's finish reasons as Anthropic's stop reasons. A stop sequence reports end_turn: the worker
finishes "stop" for it and for the end of sequence alike, without saying which string matched."""

TOOL_BLOCKS = {"tool_use": "assistant", "tool_result": "user"}
"""Which role's messages carry each tool block."""


class MessagesRequestSchema(Schema):
    """POST /v1/messages body: Anthropic's fields, with client tools (`tools`: name, description,
    input_schema; `tool_choice`: auto, any, tool or none, disable_parallel_tool_use)."""

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
    tools = fields.Raw(load_default=None, allow_none=True)  # checked by web/messages_tools.py, naming the field
    tool_choice = fields.Raw(load_default=None, allow_none=True)


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
    system = _system_text(body["system"])
    messages = ([{"role": "system", "content": system}] if system else [])
    for i, message in enumerate(body["messages"]):
        messages += _messages_in(message, i)
    mt.check_pairs(body["messages"])
    tools = mt.tools_in(body["tools"])
    mode, parallel = mt.choice_in(body["tool_choice"])
    chat = load_chat({"model": body["model"], "messages": messages, "max_tokens": body["max_tokens"],
                      "temperature": body["temperature"], "top_p": body["top_p"], "top_k": body["top_k"],
                      "stop": body["stop_sequences"][:4] if body["stop_sequences"] else None,
                      "parallel_tool_calls": parallel}, {"stop": "stop_sequences"})
    # Already checked, in Messages' terms: intake takes them as they are (load_chat would drop them).
    return {**chat, "tool_list": tools, "tool_mode": mode}


def _system_text(system) -> str | None:
    """`system`: a string, or a list of text blocks (joined)."""
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise mt.bad("system", "must be a string or a list of text blocks")
    for k, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise mt.bad(f"system.{k}", "system blocks must be text blocks ({\"type\": \"text\", \"text\": ...})")
        if not isinstance(block.get("text"), str):
            raise mt.bad(f"system.{k}.text", "must be a string")
    return "".join(block["text"] for block in system)


def _messages_in(message, index: int) -> list[dict]:
    """One Messages message as chat messages: text and image blocks as content, an assistant's tool_use
    blocks as its tool calls, a user's tool_result blocks as `tool` messages (then the rest of the turn)."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise APIError(400, f"messages.{index}.role: must be 'user' or 'assistant'", "invalid_value",
                       f"messages.{index}.role")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise APIError(400, f"messages.{index}.content: must be a string or a list of blocks", "invalid_value",
                       f"messages.{index}.content")
    parts, calls, results = [], [], []
    for j, block in enumerate(content):
        param, kind = f"messages.{index}.content.{j}", _kind(block)
        if kind in TOOL_BLOCKS and TOOL_BLOCKS[kind] != role:
            raise mt.bad(param, f"`{kind}` blocks belong in {TOOL_BLOCKS[kind]} messages")
        if kind == "tool_use":
            calls.append(mt.tool_call_in(block, param))
        elif kind == "tool_result":
            results.append(mt.tool_result_in(block, param))
        else:
            parts.append(_block(block, param))
    if calls:
        return [{"role": "assistant", "content": parts or None, "tool_calls": calls}]
    if results:
        return results + ([{"role": "user", "content": parts}] if parts else [])
    return [{"role": role, "content": parts}]


def _kind(block) -> str | None:
    """A content block's type (None when it has no type that is a string)."""
    kind = block.get("type") if isinstance(block, dict) else None
    return kind if isinstance(kind, str) else None


def _block(block, param: str) -> dict:
    """A text or image block as a chat content part."""
    kind = _kind(block)
    if kind == "text":
        if not isinstance(block.get("text"), str):
            raise mt.bad(f"{param}.text", "must be a string")
        return {"type": "text", "text": block["text"]}
    if kind == "image":
        return {"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{param}.source")}}
    raise APIError(400, f"{param}: blocks of type {kind!r} are not supported (text, image, tool_use, tool_result)",
                   "invalid_value", param)


def _image_url(source, param: str) -> str:
    """An image block's `source` ({"type": "base64", "media_type", "data"} or {"type": "url", "url"}) as a URL."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind not in ("base64", "url"):
        raise mt.bad(param, "must be {\"type\": \"base64\", \"media_type\", \"data\"} or {\"type\": \"url\", "
                            "\"url\"}")
    fields = ("media_type", "data") if kind == "base64" else ("url",)
    for field in fields:
        if not isinstance(source.get(field), str) or not source[field]:
            raise mt.bad(f"{param}.{field}", "must be a non-empty string")
    return f"data:{source['media_type']};base64,{source['data']}" if kind == "base64" else source["url"]


def _message(message_id: str, model: str, done: dict) -> dict:
    """Anthropic's `message` object from a chat job's `done` data: its text, then a tool_use block per call."""
    choice = done["choices"][0]
    calls = mt.tool_use_blocks(choice.get("tool_calls"))
    # The markup cut out around calls leaves line breaks: blank text beside calls is no block.
    text = [{"type": "text", "text": choice["text"]}] if choice["text"].strip() or not calls else []
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": text + calls,
            "stop_reason": "stop_sequence" if choice.get("stop_sequence") and choice["finish_reason"] == "stop"
            else STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": choice.get("stop_sequence"),
            "usage": {"input_tokens": done["usage"]["prompt_tokens"], "output_tokens": done["usage"]["completion_tokens"]}}


def _event(kind: str, **data) -> str:
    """One frame of Anthropic's stream (its `event:` name is its type)."""
    return sse_data({"type": kind, **data}, event=kind)


class _Blocks:
    """A streamed message's content blocks, at consecutive indexes: a text block opens at the first text
    that is not blank (as in `_message`), each tool call is a block of its own, sent whole."""

    def __init__(self):
        self.index, self.open, self.blank, self.sent = 0, False, "", set()

    def text(self, text: str):
        """Frames for a piece of the answer's text."""
        if not self.open:
            self.blank += text
            if not self.blank.strip():
                return
            text, self.blank, self.open = self.blank, "", True
            yield _event("content_block_start", index=self.index, content_block={"type": "text", "text": ""})
        if text:
            yield _event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})

    def call(self, call: dict):
        """Frames for one complete tool call: its block, its input in one delta (once per call)."""
        if call["id"] in self.sent:
            return
        self.sent.add(call["id"])
        yield from self._stop()
        self.blank = ""
        block = mt.tool_use_blocks([call])[0]
        yield _event("content_block_start", index=self.index, content_block={**block, "input": {}})
        yield _event("content_block_delta", index=self.index,
                     delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
        yield _event("content_block_stop", index=self.index)
        self.index += 1

    def end(self):
        """Frames that close the content; an answer without blocks still has its text block, blank or empty."""
        if not self.open and not self.index:
            yield _event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            if self.blank:
                yield _event("content_block_delta", index=0, delta={"type": "text_delta", "text": self.blank})
            self.open = True
        yield from self._stop()

    def _stop(self):
        """Frames that close the open block, if one is."""
        if self.open:
            yield _event("content_block_stop", index=self.index)
            self.index, self.open = self.index + 1, False


def _events(message_id: str, model: str):
    """A renderer of a chat job's events as Anthropic's stream (message_start ... message_stop)."""
    started: list[bool] = []
    blocks = _Blocks()

    def frames(job_event: dict):
        if not started:
            started.append(True)
            yield _event("message_start", message={"id": message_id, "type": "message", "role": "assistant",
                                                   "model": model, "content": [], "stop_reason": None,
                                                   "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})
        data = job_event["data"]
        if job_event["type"] == DELTA:
            yield from blocks.text(data["text"])
            for call in data.get("tool_calls") or ():
                yield from blocks.call(call)
        elif job_event["type"] == DONE:
            for call in data["choices"][0].get("tool_calls") or ():  # any a delta did not carry
                yield from blocks.call(call)
            yield from blocks.end()
            final = _message(message_id, model, data)
            yield _event("message_delta", delta={"stop_reason": final["stop_reason"],
                                                 "stop_sequence": final["stop_sequence"]},
                         usage={"output_tokens": final["usage"]["output_tokens"],
                                "input_tokens": final["usage"]["input_tokens"]})
            yield _event("message_stop")

    return frames


def _error_event(error: dict) -> str:
    """The stream's `error` event for a job that failed, in Anthropic's shape."""
    status = int(error.get("status") or 500)
    return sse_data({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                "message": _naming(error)}}, event="error")


def _naming(error: dict) -> str:
    """An error's message, naming its field: Anthropic's errors have no `param`, so the message starts
    with it ("tools.0.input_schema: ...") unless it names it already."""
    message, param = error.get("message") or "", error.get("param")
    if not param or message.startswith(param) or f"'{param}'" in message:
        return message
    return f"{param}: {message}"


def register_error_shape(app: Flask) -> None:
    """Rewrite error answers on /v1/messages into Anthropic's shape (the request id header stays)."""

    @app.after_request
    def _anthropic_errors(response):
        if not request.path.startswith("/v1/messages") or response.status_code < 400 or not response.is_json:
            return response
        error = (response.get_json(silent=True) or {}).get("error") or {}
        body = {"type": "error", "error": {"type": ERROR_TYPES.get(response.status_code, "api_error"),
                                           "message": _naming(error)},
                "request_id": response.headers.get("X-Request-ID")}
        response.set_data(json.dumps(body))
        return response
