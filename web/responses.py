"""OpenAI's Responses API on mlxq's chat machinery: a request as a chat conversation, and the stored
responses that `previous_response_id` continues and GET /v1/responses/{id} fetches.

A response runs as a chat job (the same validation, batching, structured output and images). A
stored one is a job with a record (jobs/records.py): its settings and conversation kept when it is
created, its answer when its job ends (jobs/lifecycle.py), under the job TTL; web/render/responses.py
shows it as a `response` object. Its conversation is capped in bytes: a larger one is not stored.
"""

from __future__ import annotations

import json
import time

from jobs import records
from web import responses_tools as tools
from web.auth import Caller
from web.errors import APIError
from web.render.openai import chat_message

MAX_STORED_BYTES = 1024 * 1024
"""The largest conversation a stored response keeps (as JSON); a larger one is not stored."""

PART_TYPES = {"input_text": "text", "output_text": "text", "input_image": "image_url"}


def storable(messages: list[dict]) -> bool:
    """Whether a conversation is small enough to be stored (MAX_STORED_BYTES)."""
    return len(json.dumps(messages)) <= MAX_STORED_BYTES


def stored(conn, response_id: str, who: Caller) -> dict | None:
    """The job record of a stored response its caller may see, or None (a job of another API is none)."""
    record = records.load(conn, response_id)
    if record is None or "response" not in record or not who.may_see(record):
        return None
    return record


def conversation(conn, response_id: str, result: dict | None) -> list[dict] | None:
    """A stored response's conversation with its answer (its calls too: a later request may answer them),
    as the next turn continues it; None once expired."""
    messages = records.get_conversation(conn, response_id)
    if messages is None:
        return None
    return messages + ([answer(result)] if result else [])


def to_messages(body: dict, previous: list[dict] | None) -> list[dict]:
    """The chat conversation of a Responses request: instructions, the previous response's turns, input."""
    messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    if previous is not None:
        messages += [m for m in previous if m["role"] != "system"]
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
        elif kind == "reasoning":  # an earlier turn's thinking, sent back: templates leave it out of the history
            continue
        else:
            messages.append(_message(item, index))
    return messages


def _message(item, index: int) -> dict:
    """One input item (a message: EasyInputMessage or a `message` item) as a chat message."""
    param = f"input[{index}]"
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise APIError(400, f"Input items of type {kind!r} are not supported; send messages, function_call, "
                            "function_call_output and reasoning items.", "invalid_value", param)
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


def answer(done: dict) -> dict:
    """The answer as the conversation's assistant turn (its calls as tool_calls; its reasoning left out, as
    reasoning models' templates leave earlier turns' thinking out)."""
    message = chat_message(done["choices"][0])
    message.pop("reasoning_content", None)
    message.pop("reasoning", None)
    return message


def now() -> int:
    """Unix seconds (`created_at`)."""
    return int(time.time())
