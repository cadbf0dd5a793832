"""Function calling in the Responses API, on chat's tool machinery (web/tools.py): the flat `tools`
and `tool_choice` as the chat body's checked tools, and `function_call` / `function_call_output` input
items as chat messages (the worker's calls are answered as `function_call` items: web/render/responses.py).
"""

from __future__ import annotations

import json

from web.errors import APIError
from web.tools import Tool, named_choice, tool

CHOICES = ("auto", "none", "required")


def chat_fields(body: dict) -> dict:
    """The tool fields of the chat body a Responses request runs as (web.intake.tool_plan reads them)."""
    tools = [_tool(item, f"tools[{i}]") for i, item in enumerate(body.get("tools") or [])]
    return {"tool_list": tools, "tool_mode": _mode(body.get("tool_choice")),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False}


def _tool(item, param: str) -> Tool:
    """One Responses tool: {"type": "function", "name", "description"?, "parameters", "strict"?}."""
    if not isinstance(item, dict):
        raise APIError(400, "Each tool must be an object.", "invalid_value", param)
    if item.get("type") != "function":
        raise APIError(400, f"Tools of type {item.get('type')!r} are not served: only function tools "
                            "({\"type\": \"function\", \"name\", \"parameters\"}).", "invalid_value", f"{param}.type")
    if item.get("strict") not in (None, True, False):
        raise APIError(400, "'strict' must be a boolean.", "invalid_value", f"{param}.strict")
    # `strict` is accepted and changes nothing: a forced call is held to the schema by a grammar anyway.
    return tool(item.get("name"), item.get("description"), item.get("parameters"), param)


def _mode(value) -> str:
    """`tool_choice` as web.tools takes it: "auto", "none", "required" or "function:<name>"."""
    if value is None or value in CHOICES:
        return value or "auto"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return named_choice(value["name"])
    raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                        "\"name\": ...}.", "invalid_value", "tool_choice")


def add_call(messages: list[dict], item: dict, param: str, merge: bool) -> None:
    """Append a `function_call` input item to the conversation: to the assistant message just before it
    when `merge` (calls and the text beside them are one assistant turn in chat), else as a new one."""
    call = _call(item, param)
    last = messages[-1] if messages else None
    if merge and last is not None and last["role"] == "assistant":
        messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _call(item: dict, param: str) -> dict:
    """A `function_call` item {"call_id", "name", "arguments"} as a chat tool call."""
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str) or (field != "arguments" and not item[field]):
            raise APIError(400, f"A function_call item needs '{field}' as a string.", "invalid_value",
                           f"{param}.{field}")
    try:
        arguments = json.loads(item["arguments"] or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, "A function call's arguments must be a JSON object encoded as a string.",
                       "invalid_value", f"{param}.arguments")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def output_message(messages: list[dict], item: dict, param: str) -> dict:
    """A `function_call_output` item as a chat tool message; it must answer a call made before it."""
    call_id = item.get("call_id")
    made = {call["id"] for m in messages for call in m.get("tool_calls") or []}
    if not isinstance(call_id, str) or call_id not in made:
        raise APIError(400, f"No function call with call_id {call_id!r} comes before this output (in 'input' or "
                            "the previous response).", "invalid_value", f"{param}.call_id")
    return {"role": "tool", "tool_call_id": call_id, "content": _output_text(item.get("output"), f"{param}.output")}


def _output_text(output, param: str) -> str:
    """A call's output: a string, or input_text parts (joined)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text"
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(p["text"] for p in output)
    raise APIError(400, "A function call's output must be a string or a list of input_text parts.",
                   "invalid_value", param)
