"""Cutting tool calls out of streamed text (workers/backends/toolcalls.py), with mlx-lm's own parsers (json_tools;
mistral, which has no end marker and gives lists; kimi_k2, whose calls carry ids), fed the way tokens arrive: a few
characters at a time, markers split anywhere."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from mlx_lm.tool_parsers import json_tools, kimi_k2, mistral

from workers.backends.toolcalls import ToolCalls


class Tokenizer:
    """The three attributes of mlx-lm's TokenizerWrapper the splitter reads (json_tools family)."""

    tool_call_start, tool_call_end = json_tools.tool_call_start, json_tools.tool_call_end
    tool_parser = staticmethod(json_tools.parse_tool_call)


def run(text: str, step: int) -> tuple[list[str], list[dict]]:
    """Feed `text` `step` characters at a time; the released content pieces and every call."""
    splitter, released, calls = ToolCalls(Tokenizer(), []), [], []
    for i in range(0, len(text), step):
        content, new = splitter.feed(text[i:i + step])
        released.append(content)
        calls += new
    content, new = splitter.finish()
    return released + [content], calls + new


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_calls_are_cut_out_and_markup_is_never_released(step):
    released, calls = run("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Lyon"), step)
    assert "".join(released) == "Let me check.\n"
    assert not any("<" in piece for piece in released)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)


def test_text_that_only_looks_like_a_marker_is_released_whole():
    released, calls = run("a <tool_cal b <tools> c", 1)
    assert "".join(released) == "a <tool_cal b <tools> c" and calls == []


def test_a_call_that_does_not_parse_stays_text():
    text = "<tool_call>\nnot json\n</tool_call> after"
    released, calls = run(text, 4)
    assert calls == [] and "".join(released) == "<tool_call>\nnot json\n</tool_call>after"


def test_a_call_left_open_at_the_end_is_parsed_if_complete_else_released():
    assert run(CALL.removesuffix("\n</tool_call>"), 5)[1][0]["name"] == "get_weather"
    cut = CALL[:30]
    released, calls = run(cut, 5)
    assert calls == [] and "".join(released) == cut


# --- every format mlx-lm parses: no end marker, a list of calls, a call's own id ------------------------------

def fake_tokenizer(start: str, end: str, parse):
    """A tokenizer of another family: its markers and parser (a function of the body and the tools)."""
    return SimpleNamespace(tool_call_start=start, tool_call_end=end, tool_parser=parse)


def split(tokenizer, text: str, step: int) -> tuple[str, list[dict]]:
    """Feed `text` `step` characters at a time, then finish: all the content and every call."""
    splitter, content, calls = ToolCalls(tokenizer, []), "", []
    for i in range(0, len(text), step):
        released, new = splitter.split(text[i:i + step], final=i + step >= len(text))
        content += released
        calls += new
    return content, calls


MISTRAL = fake_tokenizer(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call)


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_call_without_an_end_marker_runs_to_the_end_and_may_hold_a_list(step):
    assert MISTRAL.tool_call_end == ""
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
           '{"name": "get_time", "arguments": {}}]'
    content, calls = split(MISTRAL, text, step)
    assert content == "Sure."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                                  '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'])
def test_one_call_without_an_end_marker_is_held_until_the_answer_ends(text):
    splitter = ToolCalls(MISTRAL, [])
    assert splitter.feed(text) == ("", [])  # nothing is released while the call may go on
    content, calls = splitter.finish()
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


def test_a_cut_call_without_an_end_marker_stays_text():
    content, calls = split(MISTRAL, 'Hi [TOOL_CALLS][{"name": "get_weather", "argu', 3)
    assert calls == [] and content == 'Hi [TOOL_CALLS][{"name": "get_weather", "argu'


def test_the_models_own_ids_are_kept_unless_taken():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abc123xyz"}, {"name": "b", "arguments": {}, ' \
           '"id": "abc123xyz"}, {"name": "c", "arguments": {}}]'
    _, calls = split(MISTRAL, text, 5)
    assert [c["name"] for c in calls] == ["a", "b", "c"]
    assert calls[0]["id"] == "abc123xyz"
    assert calls[1]["id"].startswith("call_") and calls[2]["id"].startswith("call_")  # taken / none given
    assert len({c["id"] for c in calls}) == 3


def test_a_list_parser_with_ids_and_an_end_marker():
    """kimi_k2's parser: a list of calls, each with the model's id, in one section that ends."""
    kimi = fake_tokenizer(kimi_k2.tool_call_start, kimi_k2.tool_call_end, kimi_k2.parse_tool_call)
    call = "<|tool_call_begin|>functions.{0}:{1}<|tool_call_argument_begin|>{2}<|tool_call_end|>"
    text = ("Checking." + kimi.tool_call_start + call.format("get_weather", 0, '{"city": "Paris"}')
            + call.format("get_time", 1, "{}") + kimi.tool_call_end + " Done")
    for step in (1, 6, 1000):
        content, calls = split(kimi, text, step)
        assert content == "Checking.Done"
        assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("functions.get_weather:0", "get_weather", {"city": "Paris"}), ("functions.get_time:1", "get_time", {})]


def test_a_list_with_something_that_is_not_a_call_is_no_call():
    tokenizer = fake_tokenizer("<c>", "</c>", lambda body, tools: [{"name": "a", "arguments": {}}, "junk"])
    assert split(tokenizer, "<c>x</c>", 2) == ("<c>x</c>", [])
    empty = fake_tokenizer("<c>", "</c>", lambda body, tools: [])
    assert split(empty, "<c>x</c>", 2) == ("<c>x</c>", [])


def test_the_parser_gets_the_requests_tools():
    seen = []
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    tokenizer = fake_tokenizer("<c>", "</c>", lambda body, given: seen.append(given) or {"name": "f", "arguments": "{}"})
    splitter = ToolCalls(tokenizer, tools)
    assert splitter.split("<c>f</c>", final=True)[1][0]["arguments"] == "{}"  # a string stays as the parser gave it
    assert seen == [tools]
