"""The grammars that force tool calls (web/tools.py) against the parsers that read them back (mlx-lm's, through
workers/backends/toolcalls.py): every answer a format's grammar admits is parsed into exactly the calls it spells,
and what the parser would read otherwise (a raw string "null", a stripped space, an end tag inside a value) is
never admitted. Texts are checked byte by byte on llguidance's matcher, as the worker's sampler would meet them."""

from __future__ import annotations

import importlib
import json

import pytest
from llguidance import LLMatcher

from jobs.model_files import TOOL_PARSERS
from jobs.store import ModelInfo
from web.errors import APIError
from web.structured import _byte_tokenizer
from web.tools import CALL_GRAMMARS, plan, tool
from workers.backends.toolcalls import ToolCalls
from workers.demo.tools_model import CHAT_TEMPLATE, MISTRAL_CHAT_TEMPLATE

WEATHER = tool("get_weather", None, {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1},
    "unit": {"type": "string", "enum": ["c", "f"]}, "detail": {"type": "object", "properties": {
        "wind": {"type": "boolean"}}, "required": ["wind"], "additionalProperties": False}},
    "required": ["city"], "additionalProperties": False}, "tools[0].function")
TIME = tool("get_time", None, None, "tools[1].function")
TOOLS = [WEATHER, TIME]

TEMPLATES = {  # a model directory's tokenizer_config.json changes, by the format (and form) it writes
    "json_tools": {"chat_template": CHAT_TEMPLATE},
    "mistral": {"chat_template": MISTRAL_CHAT_TEMPLATE},
    "mistral-v3": {"chat_template": "[AVAILABLE_TOOLS] {{ tools }}[TOOL_CALLS] [{{ calls }}]"},
    "mistral-args": {"chat_template": "{{ tools }}[TOOL_CALLS]{{ name }}[ARGS]{{ arguments }}"},
    "qwen3_coder": {"chat_template": "{{ tools }}<tool_call>\\n<function={{ name }}>"},
    "glm47": {"chat_template": "{{ tools }}<tool_call>{{ name }}<arg_key>"},
    "laguna": {"chat_template": "{{ tools }}", "tool_parser_type": "laguna"},
}
PARIS = ("get_weather", {"city": "Paris"})
FULL = ("get_weather", {"city": "Paris", "days": 3, "unit": "c", "detail": {"wind": True}})
TIME_CALL = ("get_time", {})
ACCEPTED = {  # format: [(answer, the calls it holds)]
    "json_tools": [
        ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>', [PARIS]),
        ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>', [PARIS, TIME_CALL])],
    "mistral": [
        ('[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}]', [PARIS]),
        ('[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris","days":3,"unit":"c","detail":{"wind":true}}}, '
         '{"name":"get_time","arguments":{}}]', [FULL, TIME_CALL])],
    "mistral-v3": [('[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Paris"}}]', [PARIS])],
    "mistral-args": [
        ('[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}', [PARIS]),
        ('[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}[TOOL_CALLS]get_time[ARGS]{}', [PARIS, TIME_CALL])],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
         [PARIS]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
         "</parameter>\n<parameter=unit>\nc\n</parameter>\n<parameter=detail>\n{\"wind\":true}\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>", [FULL, TIME_CALL]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\nNull </b>\n\n</parameter>\n</function>\n"
         "</tool_call>", [("get_weather", {"city": "\nNull </b>\n"})])],
    "glm47": [
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>", [PARIS]),
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
         "<arg_value>3</arg_value><arg_key>unit</arg_key><arg_value>c</arg_value><arg_key>detail</arg_key>"
         '<arg_value>{"wind":true}</arg_value></tool_call><tool_call>get_time</tool_call>', [FULL, TIME_CALL]),
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>New\nYork 3</arg_value></tool_call>",
         [("get_weather", {"city": "New\nYork 3"})]),
        ("<tool_call>get_weather<arg_key>city</arg_key><arg_value></arg_value></tool_call>",
         [("get_weather", {"city": ""})])],
}
ACCEPTED["laguna"] = ACCEPTED["glm47"]
REFUSED = {  # format: answers the parser would misread (or that break the schema)
    "json_tools": ['<tool_call>\n{"name":"get_weather","arguments":{}}\n</tool_call>'],
    "mistral": ['[TOOL_CALLS] [{"name":"get_weather","arguments":{"city":"Paris"}}]',
                '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"},"id":"x"}]'],
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nnull\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nNULL\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\na</parameter>b\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\na</tool_call>\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n" + "x" * 41 + "\n</parameter>\n</function>\n"
        "</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nP\n</parameter>\n<parameter=days>\n0\n</parameter>\n"
        "</function>\n</tool_call>"],
    "glm47": [
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value> Paris</arg_value></tool_call>",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris\n</arg_value></tool_call>",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>a</arg_value>b</arg_value></tool_call>",
        "<tool_call>get_weather<arg_key>unit</arg_key><arg_value>k</arg_value></tool_call>"],
}


def info_for(tmp_path, name: str) -> ModelInfo:
    """A text model with the tools capability whose directory holds only the `name` template's config."""
    path = tmp_path / name
    path.mkdir(exist_ok=True)
    (path / "tokenizer_config.json").write_text(json.dumps(TEMPLATES[name]))
    return ModelInfo(name, path, "text", None, None, 0, f"dir:{path}", None, None, 0, ("tools",))


def grammar(tmp_path, name: str, parallel: bool = True, choice: str = "required", tools=TOOLS) -> str:
    """The grammar `plan` gives a forced choice on a model writing the `name` template's format."""
    return plan(tools, choice, parallel, info_for(tmp_path, name)).grammar


def admits(grammar_text: str, answer: str) -> bool:
    """Whether the grammar admits exactly `answer` (fed byte by byte, then complete)."""
    matcher = LLMatcher(_byte_tokenizer(), grammar_text, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(b) for b in answer.encode()) and matcher.is_accepting()


def parsed(name: str, answer: str) -> list[tuple[str, dict]]:
    """The calls the worker cuts out of `answer` with mlx-lm's parser of the `name` template's format."""
    fmt = {"mistral-v3": "mistral", "mistral-args": "mistral"}.get(name, name)
    module = importlib.import_module(f"mlx_lm.tool_parsers.{fmt}")
    tokenizer = type("Tokenizer", (), {"tool_call_start": module.tool_call_start, "tool_call_end": module.tool_call_end,
                                       "tool_parser": staticmethod(module.parse_tool_call)})
    content, calls = ToolCalls(tokenizer, [t.for_template() for t in TOOLS]).split(answer, final=True)
    assert content == ""
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize("name", ACCEPTED)
def test_every_answer_a_grammar_admits_parses_into_its_calls(tmp_path, name):
    forced = grammar(tmp_path, name)
    for answer, calls in ACCEPTED[name]:
        assert admits(forced, answer), answer
        assert parsed(name, answer) == calls


@pytest.mark.parametrize("name", REFUSED)
def test_what_the_parser_would_misread_is_never_admitted(tmp_path, name):
    forced = grammar(tmp_path, name)
    for answer in REFUSED[name]:
        assert not admits(forced, answer), answer


@pytest.mark.parametrize("name", ["json_tools", "mistral", "mistral-args", "qwen3_coder", "glm47"])
def test_one_call_when_parallel_calls_are_off_and_the_named_tool_only(tmp_path, name):
    single, two = ACCEPTED[name][0][0], ACCEPTED[name][1][0]
    assert admits(grammar(tmp_path, name, parallel=False), single)
    assert not admits(grammar(tmp_path, name, parallel=False), two)
    named = grammar(tmp_path, name, choice="function:get_time")
    assert not admits(named, single)


def test_every_format_with_a_grammar_is_one_mlx_lm_parses():
    assert set(CALL_GRAMMARS) <= TOOL_PARSERS
    assert {"json_tools", "mistral", "qwen3_coder", "glm47"} <= set(CALL_GRAMMARS)


@pytest.mark.parametrize("name", ["qwen3_coder", "glm47"])
@pytest.mark.parametrize("prop, why", [
    ({"type": "string", "pattern": "^[A-Z]"}, "'pattern'"),
    ({"type": "string", "format": "date"}, "'format'"),
    ({"type": "string", "maxLength": 1000}, "at most 64 characters"),
])
def test_a_raw_string_that_cannot_be_held_to_its_schema_is_refused(tmp_path, name, prop, why):
    weather = tool("get_weather", None, {"type": "object", "properties": {"city": prop}}, "tools[0].function")
    with pytest.raises(APIError) as info:
        grammar(tmp_path, name, tools=[weather])
    assert info.value.code == "unsupported_schema" and info.value.param == "tools[0].function"
    assert why in info.value.message and name in info.value.message


@pytest.mark.parametrize("parameters, why", [
    ({"type": "object", "properties": {"city": {"type": ["string", "null"]}}}, "no single JSON type"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}}, "no single"),
    ({"type": "object", "properties": {"the city": {"type": "string"}}}, "property name"),
    ({"type": "object", "properties": {}, "minProperties": 1}, "'minProperties'"),
    ({"type": "object", "properties": {}, "required": ["city"]}, "has no schema"),
    ({"type": "object", "properties": {"unit": {"type": "string", "enum": ["null", "c"]}}}, "'null'"),
])
def test_what_qwen3_coders_markup_cannot_say_is_refused(tmp_path, parameters, why):
    with pytest.raises(APIError) as info:
        grammar(tmp_path, "qwen3_coder", tools=[tool("f", None, parameters, "tools[0].function")])
    assert why in info.value.message


def test_glm47_writes_any_other_schema_as_json(tmp_path):
    either = tool("f", None, {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "integer"}]}},
                              "required": ["a"]}, "tools[0].function")
    forced = grammar(tmp_path, "glm47", tools=[either])
    assert admits(forced, '<tool_call>f<arg_key>a</arg_key><arg_value>"x"</arg_value></tool_call>')
    assert admits(forced, "<tool_call>f<arg_key>a</arg_key><arg_value>7</arg_value></tool_call>")
    assert not admits(forced, "<tool_call>f<arg_key>a</arg_key><arg_value>x</arg_value></tool_call>")
