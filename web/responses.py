"""OpenAI's Responses API on mlxq's chat machinery: turning a request into chat messages, the stored
responses that `previous_response_id` continues, and the `response` object and its stream events.

A response runs as a chat job (the same validation, batching, structured output and images); what
a stored response keeps is its conversation (messages, the answer included), under the job TTL and
a byte cap, and the `response` object itself.
"""

from __future__ import annotations

import json
import time

from jobs import keys
from web import responses_tools as tools
from web.errors import APIError
from web.render import chat_message

MAX_STORED_BYTES = 1024 * 1024
"""The largest stored response (its conversation and object, as JSON); a larger one is not stored."""

PART_TYPES = {"input_text": "text", "output_text": "text", "input_image": "image_url"}


def stored_key(response_id: str) -> str:
    """Redis key of a stored response."""
    return f"{keys.PREFIX}:response:{response_id}"


def load_stored(conn, response_id: str, owner: str, admin: bool) -> dict | None:
    """A stored response its caller may see ({"messages", "response", "owner"}), or None."""
    raw = conn.get(stored_key(response_id))
    stored = json.loads(raw) if raw else None
    if stored is None or not (admin or stored.get("owner", "") == owner):
        return None
    return stored


def store(conn, response: dict, messages: list[dict], owner: str, ttl_s: int) -> bool:
    """Keep a finished response for `previous_response_id` and GET; False when over MAX_STORED_BYTES."""
    blob = json.dumps({"messages": messages, "response": response, "owner": owner})
    if len(blob) > MAX_STORED_BYTES:
        return False
    conn.set(stored_key(response["id"]), blob, ex=ttl_s)
    return True


def to_messages(body: dict, previous: dict | None) -> list[dict]:
    """The chat conversation of a Responses request: instructions, the previous response's turns, input."""
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    if previous is not None:
        messages += [m for m in previous["messages"] if m["role"] != "system"]
    items = body["input"]
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    start = len(messages)
    for index, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "function_call":  # joins the assistant turn just before it, if this input has one
            tools.add_call(messages, item, f"input[{index}]", merge=len(messages) > start)
        elif kind == "function_call_output":
            messages.append(tools.output_message(messages, item, f"input[{index}]"))
        else:
            messages.append(_message(item, index))
    return messages


def _message(item, index: int) -> dict:
    """One input item (a message: EasyInputMessage or a `message` item) as a chat message."""
    param = f"input[{index}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise APIError(400, f"Input items of type {kind!r} are not supported; send messages, function_call and "
                            "function_call_output items.", "invalid_value", param)
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise APIError(400, "An input message's role must be user, assistant, system or developer.",
                       "invalid_value", f"{param}.role")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(400, "An input message's content must be a string or a list of parts.", "invalid_value",
                       f"{param}.content")
    return {"role": role, "content": [_part(part, f"{param}.content[{i}]") for i, part in enumerate(content)]}


def _part(part, param: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in PART_TYPES:
        raise APIError(400, f"Content parts of type {kind!r} are not supported (input_text, input_image).",
                       "invalid_value", param)
    if PART_TYPES[kind] == "text":
        return {"type": "text", "text": part.get("text", "")}
    return {"type": "image_url", "image_url": {"url": part.get("image_url") or "", "detail": part.get("detail") or "auto"}}


def response_object(response_id: str, body: dict, created: int, status: str, done: dict | None = None) -> dict:
    """The `response` object: queued or in progress (no `done` yet), or completed from a chat job's `done`."""
    response = {"id": response_id, "object": "response", "created_at": created, "status": status,
                "model": body["model"], "instructions": body.get("instructions"), "output": [],
                "error": None, "incomplete_details": None, "previous_response_id": body.get("previous_response_id"),
                "max_output_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
                "top_p": body.get("top_p"), "text": body.get("text") or {"format": {"type": "text"}},
                "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
                "parallel_tool_calls": body.get("parallel_tool_calls") is not False, "store": body.get("store", True),
                "metadata": body.get("metadata") or {}, "usage": None, "background": bool(body.get("background"))}
    return finished(response, done, status) if done is not None else response


def finished(response: dict, done: dict | None, status: str, error: dict | None = None) -> dict:
    """The response once its job ended: its output and usage from `done`, or its error."""
    if done is None:
        failure = {"code": (error or {}).get("code") or "failed", "message": (error or {}).get("message") or ""}
        return {**response, "status": status, "error": failure if status == "failed" else None}
    choice = done["choices"][0]
    status = "incomplete" if choice["finish_reason"] == "length" else status
    usage = {"input_tokens": done["usage"]["prompt_tokens"],
             "input_tokens_details": {"cached_tokens": done["usage"]["prompt_tokens_details"]["cached_tokens"]},
             "output_tokens": done["usage"]["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": done["usage"]["total_tokens"]}
    return {**response, "status": status, "output": output_items(response["id"], choice), "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}


def output_items(response_id: str, choice: dict) -> list[dict]:
    """A choice's output: the message (left out when the answer only calls), then one item per call."""
    calls = choice.get("tool_calls") or []
    message = [message_item(response_id, choice["text"])] if choice["text"].strip() or not calls else []
    return message + [tools.call_item(call) for call in calls]


def answer(done: dict) -> dict:
    """The answer as the conversation's assistant turn (its calls as tool_calls), for stored responses."""
    return chat_message(done["choices"][0])


def message_item(response_id: str, text: str, status: str = "completed") -> dict:
    """The assistant message output item."""
    return {"type": "message", "id": f"msg_{response_id.removeprefix('resp_')}", "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}


def now() -> int:
    """Unix seconds (`created_at`)."""
    return int(time.time())
