"""Anthropic tool use for POST /v1/messages: `tools` and `tool_choice` as web.tools' Tools and mode,
`tool_use` / `tool_result` blocks as chat tool calls and tool messages (the calls answered as `tool_use`
blocks: web/render/anthropic.py).

Errors are 400s whose `param` is Anthropic's dotted path (`tools.0.input_schema`,
`messages.2.content.0.tool_use_id`); Anthropic's envelope puts it in front of the message.
"""

from __future__ import annotations

import json

from web.errors import APIError
from web.tools import Tool, named_choice, tool

CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's tool_choice types as web.tools' modes ("tool" names a function: "function:<name>")."""


def bad(param: str, message: str) -> APIError:
    """A 400 about the Messages field `param`."""
    return APIError(400, message, "invalid_value", param)


def tools_in(items) -> list[Tool]:
    """Anthropic's `tools`: [{"name", "description"?, "input_schema": an object JSON schema}]."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise bad("tools", "must be a list of tools")
    return [_tool(item, f"tools.{i}") for i, item in enumerate(items)]


def _tool(item, param: str) -> Tool:
    """One client tool, checked by web.tools (its errors renamed: `parameters` is `input_schema` here)."""
    if not isinstance(item, dict):
        raise bad(param, "must be an object")
    if item.get("type", "custom") != "custom":  # Anthropic's server tools (web search, bash...) run nowhere here
        raise bad(f"{param}.type", f"tools of type {item['type']!r} are not supported (only client tools)")
    schema = item.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise bad(f"{param}.input_schema", "must be a JSON schema with \"type\": \"object\"")
    try:
        return tool(item.get("name"), item.get("description"), schema, param)
    except APIError as exc:
        where = (exc.param or param).replace(f"{param}.parameters", f"{param}.input_schema", 1)
        raise APIError(exc.status, exc.message, exc.code, where) from None


def choice_in(value) -> tuple[str, bool]:
    """Anthropic's `tool_choice` as (web.tools' mode, whether parallel calls are allowed)."""
    if value is None:
        return "auto", True
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in (*CHOICES, "tool"):
        raise bad("tool_choice", "must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"tool\", "
                                 "\"name\": ...} or {\"type\": \"none\"}")
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "must be a boolean")
    if kind != "tool":
        return CHOICES[kind], not disable
    if not isinstance(value.get("name"), str) or not value["name"]:
        raise bad("tool_choice.name", "a tool_choice of type 'tool' needs the tool's name")
    return named_choice(value["name"]), not disable


def tool_call_in(block: dict, param: str) -> dict:
    """An assistant's `tool_use` block as a chat tool call (arguments: its input as a JSON string)."""
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise bad(f"{param}.{key}", "must be a non-empty string")
    if not isinstance(block.get("input"), dict):
        raise bad(f"{param}.input", "must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def tool_result_in(block: dict, param: str) -> dict:
    """A user's `tool_result` block as a chat `tool` message (its content as text)."""
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise bad(f"{param}.tool_use_id", "must be a non-empty string")
    content = block.get("content", "")
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}.content.{k}", "tool results must be text (a string or text blocks): "
                                                  "images and documents in tool results are not supported")
        content = "".join(part["text"] for part in content)
    elif not isinstance(content, str):
        raise bad(f"{param}.content", "must be a string or a list of text blocks")
    if block.get("is_error"):  # chat templates have no error flag: the model reads it in the text
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def check_pairs(messages: list) -> None:
    """Anthropic's rule: the message after an assistant's `tool_use` blocks answers each with a
    `tool_result`, and a `tool_result` answers a `tool_use` of the message just before it."""
    asked: set[str] = set()
    for i, message in enumerate(messages):
        answered = _ids(message, "tool_result", "tool_use_id")
        for j, tool_use_id in answered.items():
            if tool_use_id not in asked:
                raise bad(f"messages.{i}.content.{j}", f"unexpected `tool_use_id` found in `tool_result` blocks: "
                          f"{tool_use_id}. Each `tool_result` block must have a corresponding `tool_use` block "
                          "in the previous message.")
        missing = sorted(asked - set(answered.values()))
        if missing:
            raise bad(f"messages.{i - 1}", f"`tool_use` ids were found without `tool_result` blocks immediately "
                      f"after: {', '.join(missing)}. Each `tool_use` block must have a corresponding "
                      "`tool_result` block in the next message.")
        asked = set(_ids(message, "tool_use", "id").values())


def _ids(message, kind: str, key: str) -> dict[int, str]:
    """The ids that a message's blocks of `kind` carry, by block index (the blocks' shape is checked later)."""
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, list):
        return {}
    return {j: block.get(key) for j, block in enumerate(content)
            if isinstance(block, dict) and block.get("type") == kind}
