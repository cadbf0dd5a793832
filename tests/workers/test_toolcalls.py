"""Cutting tool calls out of streamed text (workers/backends/toolcalls.py), with mlx-lm's own json_tools
parser, fed the way tokens arrive: a few characters at a time, markers split anywhere."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tool_parsers import json_tools

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
