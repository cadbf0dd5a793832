"""Which text requests are prepared at once on the MLX thread, and which on the preparing threads."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from workers.backends import prepare


def _request(text: str = "Name a colour.", tools=None, grammar=None, kind="text") -> SimpleNamespace:
    return SimpleNamespace(kind=kind, tools=tools, sampling=SimpleNamespace(grammar=grammar),
                           inputs=[[{"role": "user", "content": text}]])


def test_a_short_chat_is_light_and_tools_a_grammar_long_text_or_images_are_not():
    chars = prepare.LIGHT_CHARS
    assert prepare.light(_request(), chars)
    assert not prepare.light(_request(tools=[{"type": "function", "function": {"name": "f"}}]), chars)
    assert not prepare.light(_request(grammar={"json_schema": {}}), chars)
    assert not prepare.light(_request("word " * chars), chars)
    assert not prepare.light(_request("Name a colour."), 10)  # a lower limit (the disk tier's)
    assert not prepare.light(_request(kind="multimodal"), chars)  # its images are read on a preparing thread


def test_a_light_request_is_prepared_on_the_calling_thread_and_its_error_kept():
    threads = []

    def record(request):
        threads.append(threading.current_thread())
        if request.inputs[0][0]["content"] == "fail":
            raise ValueError("cannot prepare")
        return "prepared"

    done = prepare.submit(record, _request())
    assert done.done() and done.result() == "prepared" and threads == [threading.current_thread()]
    failed = prepare.submit(record, _request("fail"))
    with pytest.raises(ValueError, match="cannot prepare"):
        failed.result(timeout=0)
    heavy = prepare.submit(record, _request("word " * prepare.LIGHT_CHARS))
    assert heavy.result(timeout=30) == "prepared" and threads[-1] is not threading.current_thread()
    over_its_limit = prepare.submit(record, _request(), light_chars=5)
    assert over_its_limit.result(timeout=30) == "prepared" and threads[-1] is not threading.current_thread()
