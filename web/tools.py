"""Tool calling: `tools` and `tool_choice` checked against the model, and what the worker needs of them.

Each API names tools its own way (chat: {"type": "function", "function": {...}}; Responses: flat;
Messages: `input_schema`); each converts them to `Tool`s and its choice to "auto", "none",
"required" or a function's name, and calls `plan`. The worker renders the tools with the model's
chat template and parses the calls out of the answer (workers/backends/toolcalls.py). `required`
and a named function are enforced while decoding: a grammar (llguidance) that admits only calls in
the model's tool-call markup, each call's arguments held to its function's JSON schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llguidance import LLMatcher

from jobs.model_files import TOOL_FORMATS
from jobs.store import ModelInfo
from web.errors import APIError
from web.structured import MAX_SCHEMA_BYTES, check_options, options_of, unenforceable

MAX_TOOLS = 128
"""The most tools one request may define (OpenAI's limit)."""
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOLS_MODEL = "smollm2-135m-tools"
"""The demo model whose template renders tools (workers/demo/tools_model.py): named in errors."""
CALL_MARKUP = {"json_tools": ("<tool_call>\n", "\n</tool_call>")}
"""How each tool-call format (jobs.model_files.TOOL_FORMATS) wraps one call's JSON, for the grammar."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None
    parameters: dict
    param: str  # where it came from in the body (errors name it), e.g. "tools[2].function"

    def for_template(self) -> dict:
        """OpenAI's shape, which chat templates render."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for the worker: the definitions to render (None: no tools, no
    parsing) and the grammar that holds the answer to calls (None: the model chooses)."""

    tools: list[dict] | None
    grammar: str | None


def tool(name, description, parameters, param: str) -> Tool:
    """A Tool from one API's fields, checked: a valid unique-able name, an object schema that compiles."""
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise APIError(400, "A function name must be 1-64 letters, digits, underscores or dashes.", "invalid_value",
                       f"{param}.name")
    if description is not None and not isinstance(description, str):
        raise APIError(400, "A function's description must be a string.", "invalid_value", f"{param}.description")
    schema = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise APIError(400, "A function's parameters must be a JSON schema of type 'object'.", "invalid_value",
                       f"{param}.parameters")
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise APIError(400, f"A function's parameters schema is larger than {MAX_SCHEMA_BYTES // 1024} KiB.",
                       "invalid_value", f"{param}.parameters")
    check_options(schema, f"{param}.parameters")
    error = unenforceable(_lark_json(schema))
    if error:
        raise APIError(400, f"The parameters schema cannot be enforced: {error}", "unsupported_schema",
                       f"{param}.parameters")
    return Tool(name, description, schema, param)


def chat_tools(items) -> list[Tool]:
    """Chat's `tools`: [{"type": "function", "function": {"name", "description", "parameters"}}]."""
    tools = []
    for i, item in enumerate(items or []):
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(function, dict):
            raise APIError(400, "Each tool must be {\"type\": \"function\", \"function\": {...}}.", "invalid_value",
                           f"tools[{i}]")
        tools.append(tool(function.get("name"), function.get("description"), function.get("parameters"),
                          f"tools[{i}].function"))
    return tools


def chat_choice(value) -> str:
    """Chat's `tool_choice`: "none", "auto", "required" or {"type": "function", "function": {"name"}}."""
    if value in (None, "none", "auto", "required"):
        return value or "auto"
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        name = value["function"].get("name")
        if isinstance(name, str):
            return named_choice(name)
    raise APIError(400, "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}.", "invalid_value", "tool_choice")


def named_choice(name: str) -> str:
    """A named function as a choice (a prefix no keyword has): what each API's "this tool" becomes."""
    return "function:" + name


def plan(tools: list[Tool], choice: str, parallel: bool, info: ModelInfo, answer_schema: dict | None = None,
         tools_param: str = "tools", choice_param: str = "tool_choice") -> ToolPlan:
    """Check tools and choice against each other and the model; the worker's part of them.

    `answer_schema` is the response format's JSON schema, if any: with `auto` the answer is then either
    calls or JSON that follows it."""
    if not tools:
        if choice not in ("auto", "none"):
            raise APIError(400, "A tool_choice that calls a tool needs 'tools'.", "invalid_value", choice_param)
        return ToolPlan(None, None)
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"At most {MAX_TOOLS} tools per request.", "invalid_value", tools_param)
    names = [t.name for t in tools]
    for i, t in enumerate(tools):
        if t.name in names[:i]:
            raise APIError(400, f"Two tools are named '{t.name}'.", "invalid_value", f"{t.param}.name")
    if "tools" not in info.capabilities:
        raise APIError(400, f"Model '{info.id}' cannot call tools: its chat template has no tool calls in a format "
                            f"mlxq parses (GET /v1/models lists each model's capabilities; the demo model "
                            f"'{TOOLS_MODEL}' can).", "tools_not_supported", tools_param)
    if choice == "none":
        return ToolPlan(None, None)
    if choice.startswith("function:"):
        name = choice.removeprefix("function:")
        if name not in names:
            raise APIError(400, f"tool_choice names '{name}', which is not one of the tools.", "invalid_value",
                           choice_param)
        return ToolPlan([t.for_template() for t in tools], _calls_grammar([tools[names.index(name)]], False))
    grammar = None
    if choice == "required":
        grammar = _calls_grammar(tools, parallel)
    elif answer_schema is not None:
        grammar = _calls_grammar(tools, parallel, answer_schema)
    return ToolPlan([t.for_template() for t in tools], grammar)


def _calls_grammar(tools: list[Tool], parallel: bool, answer_schema: dict | None = None) -> str:
    """An llguidance grammar: one call (or several, when parallel) of these tools in the json_tools
    markup; or, given `answer_schema`, that or a JSON answer following it."""
    start, end = CALL_MARKUP["json_tools"]
    bodies = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
               "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    calls = 'call ("\\n" call)*' if parallel else "call"
    lines = [f"calls: {calls}", f"call: {json.dumps(start)} body {json.dumps(end)}",
             "body: " + _json_rule({"anyOf": bodies})]
    if answer_schema is None:
        lines.insert(0, "start: calls")
    else:
        lines[:0] = ["start: calls | answer", "answer: " + _json_rule(answer_schema)]
    return LLMatcher.grammar_from_lark("\n".join(lines))


def _json_rule(schema: dict) -> str:
    """A lark rule body matching JSON that follows `schema` (compact, as structured output writes it)."""
    return "%json " + json.dumps({**schema, "x-guidance": options_of(schema)})


def _lark_json(schema: dict) -> str:
    """A grammar of just this schema, to check that it compiles."""
    return LLMatcher.grammar_from_lark("start: " + _json_rule(schema))


assert set(CALL_MARKUP) == set(TOOL_FORMATS), "a tool-call format without markup for its grammar"
