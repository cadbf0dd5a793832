"""POST /v1/messages: Anthropic's Messages API, run as a chat job, with Anthropic's shapes and errors.

Requests become chat completion bodies (validated like one: web/schemas.py); answers are a `message`
object or Anthropic's event stream, and errors Anthropic's envelope (web/render/anthropic.py).
"""

from __future__ import annotations

from marshmallow import EXCLUDE, Schema, fields, validate

from jobs import queues
from web import intake
from web import messages_tools as mt
from web.errors import APIError
from web.jobrun import answer, stream_response, submit
from web.jsonbody import Blueprint
from web.media_parts import accepts_media_parts
from web.render.anthropic import Message
from web.response_schemas import SSE, AnyObjectSchema, ServerSentEventSchema
from web.schemas import NotYet, adapter_field, keep_alive_field, load_chat

blp = Blueprint("messages", __name__, url_prefix="/v1/messages", description="Anthropic's Messages API")

TOOL_BLOCKS = {"tool_use": "assistant", "tool_result": "user"}
THINKING_NAMES = {"enable_thinking": "thinking", "thinking_budget": "thinking.budget_tokens"}
"""Chat's thinking fields, as the Messages field they come from."""
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
    thinking = fields.Raw(load_default=None, allow_none=True)  # checked by _thinking_in, naming the field
    adapter = adapter_field()  # mlxq's own, as on chat
    keep_alive = keep_alive_field()  # Ollama's, as on chat
    # Anthropic's fields that would change the answer and that mlxq does not serve.
    container = NotYet("run code containers", passes=())
    mcp_servers = NotYet("call MCP servers", passes=([],))
    context_management = NotYet("edit the context", passes=())


@blp.route("", methods=["POST"])
@accepts_media_parts
@blp.arguments(MessagesRequestSchema())
@blp.response(200, AnyObjectSchema, description="A `message`; with `stream`, Anthropic's event stream")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def create_message(body):
    """Create a message (Anthropic's Messages API)."""
    chat = _as_chat(body)
    try:
        job = intake.chat_request(chat, queues.new_job_id("msg"))
    except APIError as exc:  # checked as a chat: name the Messages field
        exc.param = THINKING_NAMES.get(exc.param, exc.param)
        raise
    submit(job, intake.chat_func(job), f"message {job.model.id}")
    out = Message(job.id, job.model.id)
    return stream_response(job.id, out) if body["stream"] else answer(job.id, out)


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
                      "parallel_tool_calls": parallel, "adapter": body["adapter"], "keep_alive": body["keep_alive"],
                      **_thinking_in(body["thinking"], body["max_tokens"])},
                     {"stop": "stop_sequences", "thinking_budget": "thinking.budget_tokens",
                      "enable_thinking": "thinking"})
    # Already checked, in Messages' terms: intake takes them as they are (load_chat would drop them).
    return {**chat, "tool_list": tools, "tool_mode": mode}


def _thinking_in(thinking, max_tokens: int) -> dict:
    """`thinking` as chat's thinking control: {"type": "enabled", "budget_tokens": N} (fewer than max_tokens, as
    Anthropic asks) or {"type": "disabled"}; left out, a reasoning model thinks as its template decides."""
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind != "enabled":
        raise mt.bad("thinking.type" if isinstance(thinking, dict) else "thinking",
                     "must be {\"type\": \"enabled\", \"budget_tokens\": N} or {\"type\": \"disabled\"}")
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or not 1 <= budget < max_tokens:
        raise mt.bad("thinking.budget_tokens", f"must be an integer from 1 to max_tokens - 1 ({max_tokens - 1})")
    return {"enable_thinking": True, "thinking_budget": budget}


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
        if kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # an earlier turn's thinking, sent back: templates leave it out of the history
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
