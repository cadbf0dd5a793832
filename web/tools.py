"""Tool calling: `tools` and `tool_choice` checked against the model, and what the worker needs of them.

Each API names tools its own way (chat: {"type": "function", "function": {...}}; Responses: flat;
Messages: `input_schema`); each converts them to `Tool`s and its choice to "auto", "none",
"required" or a function's name, and calls `plan`. The worker renders the tools with the model's
chat template and parses the calls out of the answer with mlx-lm's parser for the model's format
(workers/backends/toolcalls.py; jobs.model_files.tool_format_in says which). `required` and a named
function are enforced while decoding: a grammar (llguidance) that admits only calls in the model's
tool-call markup, each call's arguments held to its function's JSON schema. That grammar exists for the
formats of CALL_GRAMMARS; with another, the model's own calls are parsed (`auto`) and forcing one is a 400.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from llguidance import LLMatcher

from jobs.model_files import TOOL_PARSERS, chat_template_of, tool_format_in
from jobs.store import ModelInfo
from web.errors import APIError
from web.structured import MAX_SCHEMA_BYTES, check_options, options_of, unenforceable

MAX_TOOLS = 128
"""The most tools one request may define (OpenAI's limit)."""
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOLS_MODEL = "smollm2-135m-tools"
"""The demo model whose template renders tools (workers/demo/tools_model.py): named in errors."""


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
    rendered = [t.for_template() for t in tools]
    if choice.startswith("function:"):
        name = choice.removeprefix("function:")
        if name not in names:
            raise APIError(400, f"tool_choice names '{name}', which is not one of the tools.", "invalid_value",
                           choice_param)
        return ToolPlan(rendered, _forced([tools[names.index(name)]], False, info, None, choice_param))
    if choice == "required":
        return ToolPlan(rendered, _forced(tools, parallel, info, None, choice_param))
    if answer_schema is not None:
        return ToolPlan(rendered, _forced(tools, parallel, info, answer_schema, choice_param))
    return ToolPlan(rendered, None)


def _forced(tools: list[Tool], parallel: bool, info: ModelInfo, answer_schema: dict | None, choice_param: str) -> str:
    """The grammar that holds the answer to calls of `tools` in the model's markup (given `answer_schema`: to those
    or JSON following it); a 400 naming `choice_param` when the model's format has no grammar yet."""
    fmt = tool_format_in(info.path)
    build = CALL_GRAMMARS.get(fmt)
    if build is None:
        how = ("a response_format beside tools holds the answer to calls or JSON, which needs a grammar of the calls: "
               "leave the response_format out or send tool_choice 'none'" if answer_schema is not None else
               "send tool_choice 'auto' (the model chooses) or 'none'")
        raise APIError(400, f"Model '{info.id}' writes tool calls in mlx-lm's '{fmt}' format, which mlxq parses but "
                            f"cannot force yet (forced calls are served for the formats {', '.join(CALL_GRAMMARS)}): "
                            f"{how}.", "tool_choice_not_supported", choice_param)
    lines = build(tools, parallel, chat_template_of(info.path) or "")
    if answer_schema is None:
        return LLMatcher.grammar_from_lark("\n".join(["start: calls", *lines]))
    return LLMatcher.grammar_from_lark("\n".join(["start: calls | answer", "answer: " + _json_rule(answer_schema),
                                                  *lines]))


def _bodies(tools: list[Tool]) -> dict:
    """The JSON schema of one call object {"name": ..., "arguments": {...}} of any of `tools`."""
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}


def _json_tools_calls(tools: list[Tool], parallel: bool, template: str) -> list[str]:
    """json_tools: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, a line break between calls."""
    calls = 'call ("\\n" call)*' if parallel else "call"
    return [f"calls: {calls}", 'call: "<tool_call>\\n" body "\\n</tool_call>"', "body: " + _json_rule(_bodies(tools))]


def _mistral_calls(tools: list[Tool], parallel: bool, template: str) -> list[str]:
    """mistral (no end marker: the calls end the answer), in the form the model's template writes: a JSON list,
    `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (with the space after the marker where the template has
    one, as Mistral's v3 templates do), or `[TOOL_CALLS]name[ARGS]{...}` once per call (templates with [ARGS])."""
    if "[ARGS]" in template:
        lines = ["calls: call+" if parallel else "calls: call", "call: " + " | ".join(f"fn_{i}" for i in range(len(tools)))]
        for i, t in enumerate(tools):
            lines += [f"fn_{i}: {json.dumps('[TOOL_CALLS]' + t.name + '[ARGS]')} args_{i}",
                      f"args_{i}: " + _json_rule(t.parameters)]
        return lines
    opener = "[TOOL_CALLS] [" if "[TOOL_CALLS] [" in template else "[TOOL_CALLS]["
    more = ' (", " body)*' if parallel else ""
    return [f'calls: {json.dumps(opener)} body{more} "]"', "body: " + _json_rule(_bodies(tools))]


@dataclass(frozen=True)
class Tags:
    """How a format with one tag per argument writes a call (for its grammar): `open` name `named`, then per
    argument `key` name `keyed` value `value_end` `after`, then `close`; `between` two calls."""

    open: str
    named: str
    key: str
    keyed: str
    value_end: str
    after: str
    close: str
    between: str
    closer: str  # the element whose end tag the parser ends a value at
    raw: Callable[[dict], bool]  # whether the parser takes a property's value as raw text (else as JSON)
    text_rule: str  # a lexeme every raw value (with its value_end) matches besides the common rules
    text_ok: Callable[[str], bool]  # whether the parser gives a raw value back unchanged


QWEN3_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")
"""The property types mlx-lm's qwen3_coder parser converts faithfully (it reads a value by its property's type)."""
QWEN3_CODER = Tags(
    "<tool_call>\n<function=", ">\n", "<parameter=", ">\n", "\n</parameter>", "\n", "</function>\n</tool_call>", "\n",
    closer="parameter", raw=lambda prop: prop.get("type") == "string",
    text_rule=r"~/[nN][uU][lL][lL]\n<\/parameter>/",  # "null" in any case is read as None
    text_ok=lambda text: text.lower() != "null")
GLM47 = Tags(
    "<tool_call>", "", "<arg_key>", "</arg_key><arg_value>", "</arg_value>", "", "</tool_call>", "",
    closer="arg_value", raw=lambda prop: prop.get("type") == "string",
    # the parser strips a value: a raw one neither starts nor ends with white space (Python's, \x1c-\x1f included)
    text_rule=r"/([^\s\x1c-\x1f]([\s\S]*[^\s\x1c-\x1f])?)?<\/arg_value>/",
    text_ok=lambda text: text == text.strip())
RAW_STRING_KEYS = {"type", "description", "title", "enum", "const", "minLength", "maxLength", "default", "examples",
                   "$comment"}
"""What a raw-text string property may say: its length and values can be held to; a pattern or format cannot."""
MAX_COUNTED_LENGTH = 64
"""The largest minLength/maxLength a raw-text value is held to: counting its characters while watching for its end
tag grows llguidance's lexer past its limits at about a hundred (on SmolLM2's vocabulary)."""
ROOT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema", "$id",
             "$defs", "definitions", "$comment", "x-guidance", "default", "examples"}
KEY_RE = re.compile(r"^[^\s<>]+$")


def _tagged_calls(tags: Tags, fmt: str) -> Callable[[list[Tool], bool, str], list[str]]:
    """The grammar builder of a format with one tag per argument: raw text for strings, JSON for the rest."""

    def build(tools: list[Tool], parallel: bool, template: str) -> list[str]:
        """calls: one (or several, when parallel) of `tools`; each tool's rules checked on their own first."""
        between = f"({json.dumps(tags.between)} call)*" if tags.between else "call*"
        lines = [f"calls: call {between}" if parallel else "calls: call",
                 "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, t in enumerate(tools):
            rules = _tagged_call(tags, fmt, t, i)
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_lark("\n".join([f"start: call_{i}", *rules])))
            if error:
                _cannot(t, fmt, error.strip().splitlines()[0])
            lines += rules
        return lines

    return build


def _tagged_call(tags: Tags, fmt: str, t: Tool, i: int) -> list[str]:
    """The rules of one tool's call: its arguments in the schema's order, the required ones always."""
    schema = t.parameters
    extra = sorted(set(schema) - ROOT_KEYS)
    if extra:
        _cannot(t, fmt, f"'{extra[0]}' at the top of the schema")
    properties, required = schema.get("properties") or {}, schema.get("required") or []
    missing = [name for name in required if name not in properties]
    if missing:
        _cannot(t, fmt, f"the required property '{missing[0]}' has no schema")
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema} | {"x-guidance": options_of(schema)}
    parts, rules = [], []
    for j, (key, prop) in enumerate(properties.items()):
        if not KEY_RE.match(key):
            _cannot(t, fmt, f"the property name {key!r} (names with spaces, '<' or '>' do not fit the markup)")
        rules += _argument(tags, fmt, t, key, prop if isinstance(prop, dict) else {}, f"{i}_{j}", shared)
        parts.append(f"p_{i}_{j}" + ("" if key in required else "?"))
    opening = json.dumps(tags.open + t.name + tags.named)
    return [f"call_{i}: {opening} {' '.join(parts)} {json.dumps(tags.close)}", *rules]


def _argument(tags: Tags, fmt: str, t: Tool, key: str, prop: dict, at: str, shared: dict) -> list[str]:
    """The rules of one argument, `key` and its value: raw text for the parser's string properties, else JSON."""
    head = json.dumps(tags.key + key + tags.keyed)
    if fmt == "qwen3_coder" and prop.get("type") not in QWEN3_TYPES:
        _cannot(t, fmt, f"property '{key}' has no single JSON type (the parser reads each value by its type)")
    if not tags.raw(prop):
        if prop.get("type") == "integer" and fmt == "qwen3_coder":  # read through float(): exact to 2**53
            prop = {**prop, "minimum": max(prop.get("minimum", -SAFE_INT), -SAFE_INT),
                    "maximum": min(prop.get("maximum", SAFE_INT), SAFE_INT)}  # numbers: the schema compiled
        return [f"p_{at}: {head} j_{at} {json.dumps(tags.value_end + tags.after)}", f"j_{at}: %json " +
                json.dumps({**prop, **shared})]
    unfit = sorted(set(prop) - RAW_STRING_KEYS)
    if unfit:
        _cannot(t, fmt, f"'{unfit[0]}' of property '{key}' (its value is raw text here, held to its length and values "
                        "only)")
    after = f" {json.dumps(tags.after)}" if tags.after else ""
    return [f"p_{at}: {head} V_{at}{after}", f"V_{at}: " + _raw_text(tags, fmt, t, key, prop)]


def _raw_text(tags: Tags, fmt: str, t: Tool, key: str, prop: dict) -> str:
    """The lexeme of a raw string value and its end tag: no end tag (nor the calls' end) inside, the format's own
    rule, the property's length; or one of its values."""
    low, high = prop.get("minLength", 0), prop.get("maxLength")
    values = prop["enum"] if "enum" in prop else [prop["const"]] if "const" in prop else None
    if values is not None:
        fits = [v for v in values if isinstance(v, str) and low <= len(v) and (high is None or len(v) <= high)]
        for value in fits:
            if f"</{tags.closer}>" in value or "</tool_call>" in value or not tags.text_ok(value):
                _cannot(t, fmt, f"property '{key}' allows {value!r}, which the parser would not read back as it is")
        if not fits:
            _cannot(t, fmt, f"no value of property '{key}' is a string of its length")
        return "(" + " | ".join(json.dumps(v) for v in fits) + f") {json.dumps(tags.value_end)}"
    if max(low, high or 0) > MAX_COUNTED_LENGTH:
        _cannot(t, fmt, f"property '{key}' is raw text here, whose length can be held to at most "
                        f"{MAX_COUNTED_LENGTH} characters")
    tag = _regex_text(tags.value_end)
    rules = [rf"~/[\s\S]*<\/({tags.closer}|tool_call)>[\s\S]+/", tags.text_rule]
    if low or high is not None:
        rules.insert(0, f"/[\\s\\S]{{{int(low)},{'' if high is None else int(high)}}}{tag}/")
    elif tags.text_rule.startswith("~"):  # the lexeme needs a rule that it ends with the tag
        rules.insert(0, f"/[\\s\\S]*{tag}/")
    return " & ".join(rules)


def _regex_text(text: str) -> str:
    """`text` (a fixed tag of letters, '<', '/', '>', '_' and line breaks) inside a /regex/ lexeme."""
    return text.replace("\n", "\\n").replace("/", "\\/")


def _cannot(t: Tool, fmt: str, why: str):
    """Refuse a tool whose calls cannot be held to its schema in this format (400 naming the tool)."""
    raise APIError(400, f"The tool '{t.name}' cannot be forced in this model's tool-call format ({fmt}): {why}.",
                   "unsupported_schema", t.param)


SAFE_INT = 2 ** 53
"""qwen3_coder's parser reads an integer through float(): beyond this it would change the value."""
CALL_GRAMMARS: dict[str, Callable[[list[Tool], bool, str], list[str]]] = {
    "json_tools": _json_tools_calls,
    "mistral": _mistral_calls,
    "qwen3_coder": _tagged_calls(QWEN3_CODER, "qwen3_coder"),
    "glm47": _tagged_calls(GLM47, "glm47"),
    "laguna": _tagged_calls(GLM47, "laguna"),  # glm47's markup and parser under Poolside Laguna's name
}
"""The tool-call formats (mlx-lm parser names) whose calls `required` and a named function are held to, each
with the lark rules of its markup (`calls`). Calls in the other formats mlx-lm parses are only cut out of free
answers (tool_choice "auto")."""


def _json_rule(schema: dict) -> str:
    """A lark rule body matching JSON that follows `schema` (compact, as structured output writes it)."""
    return "%json " + json.dumps({**schema, "x-guidance": options_of(schema)})


def _lark_json(schema: dict) -> str:
    """A grammar of just this schema, to check that it compiles."""
    return LLMatcher.grammar_from_lark("start: " + _json_rule(schema))


assert set(CALL_GRAMMARS) <= TOOL_PARSERS, "a grammar for a format mlx-lm does not parse"
