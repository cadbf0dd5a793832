"""Anthropic's Messages API shapes: the `message` object, its event stream (message_start ... message_stop)
and its error envelope (which has no `param`: the message names the field)."""

from __future__ import annotations

import json

from jobs.events import DELTA, DONE, REASONING
from web.render.base import Renderer
from web.render.sse import sse_data

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error type for each status (others: api_error)."""

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""The worker's finish reasons as Anthropic's stop reasons. A stop sequence reports end_turn: the worker
finishes "stop" for it and for the end of sequence alike, without saying which string matched."""


def error_body(status: int, error: dict, request_id: str | None) -> dict:
    """Anthropic's error envelope `{"type": "error", "error": {type, message}, "request_id"}`."""
    return {"type": "error", "error": _error(status, error), "request_id": request_id}


def _error(status: int, error: dict) -> dict:
    return {"type": ERROR_TYPES.get(status, "api_error"), "message": naming(error)}


def naming(error: dict) -> str:
    """An error's message, naming its field: Anthropic's errors have no `param`, so the message starts
    with it ("tools.0.input_schema: ...") unless it names it already."""
    message, param = error.get("message") or "", error.get("param")
    if not param or message.startswith(param) or f"'{param}'" in message:
        return message
    return f"{param}: {message}"


def tool_use_blocks(calls: list | None) -> list[dict]:
    """The worker's calls as Anthropic's `tool_use` content blocks."""
    return [{"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["name"], "input": tool_input(call)}
            for call in calls or []]


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a call ("toolu_..."), from the worker's ("call_<hex>")."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(call: dict) -> dict:
    """A call's arguments as the object `input` is; {} when the model wrote something else (a grammar
    holds forced calls to their schema, but a freely chosen call's arguments are the model's)."""
    try:
        value = json.loads(call["arguments"] or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def thinking_block(text: str) -> dict:
    """A reasoning model's thinking as a `thinking` block (its signature empty: an open model's thinking is
    not signed, and thinking blocks sent back are left out of the conversation)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def message(message_id: str, model: str, done: dict) -> dict:
    """Anthropic's `message` object from a chat job's `done` data: its thinking, its text, then a tool_use block
    per call."""
    choice = done["choices"][0]
    calls = tool_use_blocks(choice.get("tool_calls"))
    thought = [thinking_block(choice["reasoning"])] if choice.get("reasoning") else []
    # The markup cut out around calls leaves line breaks: blank text beside calls is no block.
    text = [{"type": "text", "text": choice["text"]}] if choice["text"].strip() or not calls else []
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": thought + text + calls,
            "stop_reason": "stop_sequence" if choice.get("stop_sequence") and choice["finish_reason"] == "stop"
            else STOP_REASONS.get(choice["finish_reason"], "end_turn"), "stop_sequence": choice.get("stop_sequence"),
            "usage": usage(done["usage"])}


def usage(counts: dict) -> dict:
    """Anthropic's usage from a job's: as Anthropic counts, `input_tokens` are the prompt tokens processed, the
    cached ones (read from the prompt cache) are `cache_read_input_tokens` beside them, and their sum is the
    prompt. mlxq's cache is automatic: nothing is ever counted as written to it on request."""
    cached = (counts.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": counts["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": counts["completion_tokens"]}


def _event(kind: str, **data) -> str:
    """One frame of Anthropic's stream (its `event:` name is its type)."""
    return sse_data({"type": kind, **data}, event=kind)


class _Blocks:
    """A streamed message's content blocks, at consecutive indexes: a thinking block first (a reasoning model's),
    then a text block that opens at the first text that is not blank (as in `message`), each tool call a block
    of its own, sent whole."""

    def __init__(self):
        self.index, self.open, self.blank, self.sent = 0, False, "", set()
        self.thinking_open = False
        self.answered = False  # whether a text block or a call went out

    def thinking(self, text: str):
        """Frames for a piece of the thinking."""
        if not self.thinking_open:
            self.thinking_open = True
            yield _event("content_block_start", index=self.index, content_block=thinking_block(""))
        yield _event("content_block_delta", index=self.index, delta={"type": "thinking_delta", "thinking": text})

    def text(self, text: str):
        """Frames for a piece of the answer's text."""
        if not self.open:
            self.blank += text
            if not self.blank.strip():
                return
            yield from self._stop()
            text, self.blank, self.open, self.answered = self.blank, "", True, True
            yield _event("content_block_start", index=self.index, content_block={"type": "text", "text": ""})
        if text:
            yield _event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": text})

    def call(self, call: dict):
        """Frames for one complete tool call: its block, its input in one delta (once per call)."""
        if call["id"] in self.sent:
            return
        self.sent.add(call["id"])
        self.answered = True
        yield from self._stop()
        self.blank = ""
        block = tool_use_blocks([call])[0]
        yield _event("content_block_start", index=self.index, content_block={**block, "input": {}})
        yield _event("content_block_delta", index=self.index,
                     delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
        yield _event("content_block_stop", index=self.index)
        self.index += 1

    def end(self):
        """Frames that close the content; an answer without blocks still has its text block, blank or empty."""
        if not self.answered:
            yield from self._stop()
            yield _event("content_block_start", index=self.index, content_block={"type": "text", "text": ""})
            if self.blank:
                yield _event("content_block_delta", index=self.index, delta={"type": "text_delta", "text": self.blank})
            self.open = self.answered = True
        yield from self._stop()

    def _stop(self):
        """Frames that close the open block, if one is."""
        if self.open or self.thinking_open:
            yield _event("content_block_stop", index=self.index)
            self.index, self.open, self.thinking_open = self.index + 1, False, False


class Message(Renderer):
    """A Messages answer: the `message` object, or Anthropic's stream (message_start ... message_stop)."""

    def __init__(self, message_id: str, model: str):
        self.message_id, self.model = message_id, model
        self.started = False
        self.blocks = _Blocks()

    def body(self, done: dict) -> dict:
        """The `message` object."""
        return message(self.message_id, self.model, done)

    def frames(self, event: dict):
        """message_start first; content blocks for deltas; the blocks' end, message_delta and message_stop
        for `done` (with any call a delta did not carry)."""
        if not self.started:
            self.started = True
            yield _event("message_start", message={
                "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}})
        data = event["data"]
        if event["type"] == REASONING:
            yield from self.blocks.thinking(data["text"])
        elif event["type"] == DELTA:
            yield from self.blocks.text(data["text"])
            for call in data.get("tool_calls") or ():
                yield from self.blocks.call(call)
        elif event["type"] == DONE:
            for call in data["choices"][0].get("tool_calls") or ():
                yield from self.blocks.call(call)
            yield from self.blocks.end()
            final = self.body(data)
            yield _event("message_delta", delta={"stop_reason": final["stop_reason"],
                                                 "stop_sequence": final["stop_sequence"]},
                         usage=final["usage"])
            yield _event("message_stop")

    def error_frame(self, error: dict) -> str:
        """The stream's `error` event, in Anthropic's shape."""
        return sse_data({"type": "error", "error": _error(int(error.get("status") or 500), error)}, event="error")
