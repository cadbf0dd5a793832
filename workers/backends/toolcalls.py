"""Tool calls out of generated text: the model's call markup is cut out of the content, parsed by
mlx-lm's parser for the model's family (the tokenizer knows it: `tool_call_start`, `tool_parser`),
and handed on as calls, as soon as each is complete. The markup is never streamed as content: text
that may begin a call is held back until it is clearly not one.

Every format mlx-lm parses works alike: one with no end marker (mistral's `tool_call_end` is "") runs
from its start marker to the end of the answer; a parser may give one call or a list of them (several
in one markup), and may give a call its id (the model's own, kept as mlx-lm's server keeps it, unless
another call of the answer has it already).
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
        self.ids: set[str] = set()  # the ids of the calls made so far (a model's own may repeat)

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
            parsed = self._calls(body)
            if not parsed:  # not a call after all: the text stays the model's answer
                content.append(self.start + body + self.end)
            calls += parsed
        return "".join(content), calls

    def split(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """`feed`, then `finish` when this is the generation's last text."""
        content, calls = self.feed(text)
        if final:
            rest, more = self.finish()
            content, calls = content + rest, calls + more
        return content, calls

    def finish(self) -> tuple[str, list[dict]]:
        """Generation ended: a call left open (the only way a format without an end marker ends one) is parsed
        if it can be, else released as text."""
        rest, self.buffer = self.buffer, ""
        if not self.in_call:
            return rest, []
        self.in_call = False
        calls = self._calls(rest)
        return ("", calls) if calls else (self.start + rest, [])

    def _calls(self, body: str) -> list[dict]:
        """The calls in one markup's body in OpenAI's terms (arguments as a JSON string); none when it does not
        parse, or when anything the parser gives is not a call."""
        try:
            parsed = self.parse(body, self.tools)
        except Exception as exc:  # each family's parser raises its own errors on malformed markup
            log.info("tool call not parsed (%s: %s): %r", type(exc).__name__, exc, body[:200])
            return []
        parsed = parsed if isinstance(parsed, list) else [parsed]
        if not parsed or not all(isinstance(p, dict) and isinstance(p.get("name"), str) for p in parsed):
            return []
        return [self._call(p) for p in parsed]

    def _call(self, parsed: dict) -> dict:
        """One parsed call as the answer holds it: its own id if the parser gave one no other call has, else a new one."""
        arguments = parsed.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        given = parsed.get("id")
        if isinstance(given, str) and given and given not in self.ids:
            call_id = given
        else:
            call_id = "call_" + secrets.token_hex(12)
        self.ids.add(call_id)
        return {"id": call_id, "name": parsed["name"], "arguments": arguments}


def for_request(request, tokenizer) -> ToolCalls | None:
    """The splitter of a request with tools on this tokenizer (None without tools)."""
    if not getattr(request, "tools", None):
        return None
    if not getattr(tokenizer, "has_tool_calling", False):
        raise InvalidRequest(f"model {request.model.id!r} has no tool-call parser", param="tools")
    return ToolCalls(tokenizer, request.tools)

