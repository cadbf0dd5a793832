"""Tool calls out of generated text: the model's call markup is cut out of the content, parsed by
mlx-lm's parser for the model's family (the tokenizer knows it: `tool_call_start`, `tool_parser`),
and handed on as calls, as soon as each is complete. The markup is never streamed as content: text
that may begin a call is held back until it is clearly not one.
"""

from __future__ import annotations

import json
import logging
import secrets

from jobs.errors import InvalidRequest
from workers.backends.textgen import held_tail

log = logging.getLogger(__name__)


class ToolCalls:
    """One choice's splitter: feed it released text, get back (content, completed calls)."""

    def __init__(self, tokenizer, tools: list[dict]):
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.parse, self.tools = tokenizer.tool_parser, tools
        self.buffer, self.in_call, self.after_call = "", False, False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Add generated text; return the content that is safe to release and the calls it completed."""
        self.buffer += text
        content, calls = [], []
        while True:
            if self.after_call:  # the line break between calls (or after the last) is not content
                self.buffer = self.buffer.lstrip()
                self.after_call = not self.buffer
            if not self.in_call:
                found = self.buffer.find(self.start)
                if found < 0:
                    keep = held_tail(self.buffer, [self.start])
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:found])
                self.buffer, self.in_call = self.buffer[found + len(self.start):], True
            found = self.buffer.find(self.end) if self.end else -1
            if found < 0:
                break
            body, self.buffer = self.buffer[:found], self.buffer[found + len(self.end):]
            self.in_call, self.after_call = False, True
            call = self._call(body)
            if call is None:  # not a call after all: the text stays the model's answer
                content.append(self.start + body + self.end)
            else:
                calls.append(call)
        return "".join(content), calls

    def split(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """`feed`, then `finish` when this is the generation's last text."""
        content, calls = self.feed(text)
        if final:
            rest, more = self.finish()
            content, calls = content + rest, calls + more
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """Generation ended: a call left open (no end marker) is parsed if it can be, else released as text."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        call = self._call(rest)
        return ("", [call]) if call is not None else (self.start + rest, [])

    def _call(self, body: str) -> dict | None:
        """One call in OpenAI's terms (arguments as a JSON string), or None when the body does not parse."""
        try:
            parsed = self.parse(body, self.tools)
        except Exception as exc:  # each family's parser raises its own errors on malformed markup
            log.info("tool call not parsed (%s: %s): %r", type(exc).__name__, exc, body[:200])
            return None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return None
        arguments = parsed.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        return {"id": "call_" + secrets.token_hex(12), "name": parsed["name"], "arguments": arguments}


def for_request(request, tokenizer) -> ToolCalls | None:
    """The splitter of a request with tools on this tokenizer (None without tools)."""
    if not getattr(request, "tools", None):
        return None
    if not getattr(tokenizer, "has_tool_calling", False):
        raise InvalidRequest(f"model {request.model.id!r} has no tool-call parser", param="tools")
    return ToolCalls(tokenizer, request.tools)

