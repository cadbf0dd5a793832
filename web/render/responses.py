"""OpenAI's Responses API shapes: the `response` object (from a job's `done` data, or from its record
for a stored or background response) and its stream (response.created ... response.completed).

A response echoes the request's settings: `echo` picks them out of the request, and a stored
response keeps them in its job's record, so the object fetched later is the one answered at first.
"""

from __future__ import annotations

from jobs import records
from jobs.events import DELTA, DONE, REASONING
from web.render.base import Renderer
from web.render.sse import sse_data

ECHOED = ("model", "instructions", "previous_response_id", "max_output_tokens", "temperature", "top_p", "text",
          "tools", "tool_choice", "parallel_tool_calls", "store", "metadata", "background", "reasoning")
"""The request's fields that its `response` object repeats."""

STATUS = {records.QUEUED: "queued", records.RUNNING: "in_progress", records.SUCCEEDED: "completed",
          records.FAILED: "failed", records.CANCELED: "cancelled"}
"""A job record's status as a response's status."""


def echo(body: dict, created: int) -> dict:
    """What a response repeats of its request (`body`: the Responses request, its model resolved)."""
    return {"created_at": created, **{field: body.get(field) for field in ECHOED}}


def response_object(response_id: str, echoed: dict, status: str, done: dict | None = None) -> dict:
    """The `response` object: queued or in progress (no `done` yet), or completed from a chat job's `done`."""
    response = {"id": response_id, "object": "response", "created_at": echoed["created_at"], "status": status,
                "model": echoed["model"], "instructions": echoed.get("instructions"), "output": [],
                "error": None, "incomplete_details": None, "previous_response_id": echoed.get("previous_response_id"),
                "max_output_tokens": echoed.get("max_output_tokens"), "temperature": echoed.get("temperature"),
                "top_p": echoed.get("top_p"), "text": echoed.get("text") or {"format": {"type": "text"}},
                "tools": echoed.get("tools") or [], "tool_choice": echoed.get("tool_choice") or "auto",
                "parallel_tool_calls": echoed.get("parallel_tool_calls") is not False,
                "store": echoed.get("store", True), "metadata": echoed.get("metadata") or {},
                "usage": None, "background": bool(echoed.get("background")),
                "reasoning": echoed.get("reasoning") or {"effort": None, "summary": None}}
    return finished(response, done, status) if done is not None else response


def from_record(record: dict, result: dict | None) -> dict:
    """A stored response as its job's record stands: queued, in progress, or final (its output from the
    job's result, or its error)."""
    status = STATUS.get(record.get("status"), "failed")
    response = response_object(record["id"], record["response"], status)
    if status in ("queued", "in_progress"):
        return response
    error = record.get("error") if status in ("failed", "cancelled") else None
    return finished(response, result if status == "completed" else None, status, error)


def finished(response: dict, done: dict | None, status: str, error: dict | None = None) -> dict:
    """The response once its job ended: its output and usage from `done`, or its error."""
    if done is None:
        failure = {"code": (error or {}).get("code") or "failed", "message": (error or {}).get("message") or ""}
        return {**response, "status": status, "error": failure if status == "failed" else None}
    choice = done["choices"][0]
    status = "incomplete" if choice["finish_reason"] == "length" else status
    usage = {"input_tokens": done["usage"]["prompt_tokens"],
             "input_tokens_details": {"cached_tokens": done["usage"]["prompt_tokens_details"]["cached_tokens"]},
             "output_tokens": done["usage"]["completion_tokens"],
             "output_tokens_details": {"reasoning_tokens": reasoning_tokens(done["usage"])},
             "total_tokens": done["usage"]["total_tokens"]}
    return {**response, "status": status, "output": output_items(response["id"], choice), "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None}


def reasoning_tokens(usage: dict) -> int:
    """The reasoning tokens of a job's usage (0 in results stored before they were counted)."""
    return (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)


def output_items(response_id: str, choice: dict) -> list[dict]:
    """A choice's output: its reasoning (a reasoning model's), the message (left out when the answer only
    calls), then one item per call."""
    calls = choice.get("tool_calls") or []
    thought = [reasoning_item(response_id, choice["reasoning"])] if choice.get("reasoning") else []
    message = [message_item(response_id, choice["text"])] if choice["text"].strip() or not calls else []
    return thought + message + [call_item(call) for call in calls]


def reasoning_item(response_id: str, text: str, status: str = "completed") -> dict:
    """A reasoning model's thinking as a `reasoning` output item: the whole of it as its summary text (an open
    model's reasoning is not hidden, so nothing is summarized away)."""
    return {"type": "reasoning", "id": f"rs_{response_id.removeprefix('resp_')}", "status": status,
            "summary": [{"type": "summary_text", "text": text}] if text else []}


def message_item(response_id: str, text: str, status: str = "completed") -> dict:
    """The assistant message output item."""
    return {"type": "message", "id": f"msg_{response_id.removeprefix('resp_')}", "status": status,
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: dict) -> dict:
    """A worker's call as a `function_call` output item; its id follows from the call's, so a stream's
    events and the final object (stored, fetched in the background) name it alike."""
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["name"], "arguments": call["arguments"], "status": "completed"}


class Responses(Renderer):
    """A Responses answer: the `response` object, or its numbered events.

    A reasoning model's thinking comes first, as a reasoning item whose summary text streams; it closes when
    the answer begins. The message item opens at the first text that is not whitespace (an answer that only
    calls a tool has none: its output is the calls alone, as in the plain response). The calls follow it as
    function_call items once the answer is done: they come after the message, which holds all the text
    (a forced call ends the answer anyway).
    """

    def __init__(self, response_id: str, echoed: dict):
        self.response_id, self.echoed = response_id, echoed
        self.item_id = message_item(response_id, "")["id"]
        self.reasoning_id = reasoning_item(response_id, "")["id"]
        self.sequence = 0
        self.started, self.open, self.held = False, False, ""  # held: leading whitespace, sent once the item opens
        self.thought: str | None = None  # the reasoning streamed so far (None: no reasoning item opened)
        self.thinking = False  # whether the reasoning item is open
        self.index = 0  # the message's output_index (1 after a reasoning item)

    def body(self, done: dict) -> dict:
        """The completed (or incomplete) `response` object."""
        return response_object(self.response_id, self.echoed, "completed", done)

    def pending(self, status: str) -> dict:
        """The `response` object before its job ended (queued, in_progress)."""
        return response_object(self.response_id, self.echoed, status)

    def frames(self, event: dict):
        """response.created and response.in_progress first; reasoning and text deltas; the items' ends and
        response.completed for `done` (its tool calls wait for it: see above)."""
        if not self.started:
            self.started = True
            yield self._event("response.created", response=self.pending("in_progress"))
            yield self._event("response.in_progress", response=self.pending("in_progress"))
        if event["type"] == REASONING:
            yield from self._reasoning(event["data"]["text"])
        elif event["type"] == DELTA:
            if event["data"]["text"]:
                yield from self._close_reasoning()
            yield from self._text(event["data"]["text"])
        elif event["type"] == DONE:
            yield from self._close_reasoning()
            yield from self._done(event["data"])

    def error_frame(self, error: dict) -> str:
        """The stream's `error` event for a job that failed."""
        return sse_data({"type": "error", "code": error.get("code"), "message": error.get("message"), "param": None,
                         "sequence_number": 0}, event="error")

    def _event(self, kind: str, **data) -> str:
        """One event, numbered in order (`sequence_number`), its type as the SSE event name."""
        self.sequence += 1
        return sse_data({"type": kind, "sequence_number": self.sequence - 1, **data}, event=kind)

    def _reasoning(self, piece: str):
        """A reasoning delta: the reasoning item and its summary part open at the first."""
        if self.thought is None:
            self.thought, self.thinking, self.index = "", True, 1
            yield self._event("response.output_item.added", output_index=0,
                              item=reasoning_item(self.response_id, "", "in_progress"))
            yield self._event("response.reasoning_summary_part.added", item_id=self.reasoning_id, output_index=0,
                              summary_index=0, part={"type": "summary_text", "text": ""})
        self.thought += piece
        yield self._event("response.reasoning_summary_text.delta", item_id=self.reasoning_id, output_index=0,
                          summary_index=0, delta=piece)

    def _close_reasoning(self):
        """The reasoning item's end, once the answer begins."""
        if not self.thinking:
            return
        self.thinking = False
        yield self._event("response.reasoning_summary_text.done", item_id=self.reasoning_id, output_index=0,
                          summary_index=0, text=self.thought)
        yield self._event("response.reasoning_summary_part.done", item_id=self.reasoning_id, output_index=0,
                          summary_index=0, part={"type": "summary_text", "text": self.thought})
        yield self._event("response.output_item.done", output_index=0,
                          item=reasoning_item(self.response_id, self.thought))

    def _open_message(self):
        self.open, held, self.held = True, self.held, ""
        yield self._event("response.output_item.added", output_index=self.index,
                          item={**message_item(self.response_id, "", "in_progress"), "content": []})
        yield self._event("response.content_part.added", item_id=self.item_id, output_index=self.index,
                          content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        if held:
            yield self._text_delta(held)

    def _text_delta(self, delta: str) -> str:
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=self.index,
                           content_index=0, delta=delta, logprobs=[])

    def _text(self, piece: str):
        if self.open:
            if piece:  # a delta that only completed a call has no text
                yield self._text_delta(piece)
        elif (self.held + piece).strip():
            self.held += piece
            yield from self._open_message()
        else:
            self.held += piece

    def _done(self, done: dict):
        response = self.body(done)
        output = response["output"]
        for index, item in enumerate(output):
            if item["type"] == "message":
                if not self.open:  # an answer of whitespace alone, without calls: still a message
                    self.index = index
                    yield from self._open_message()
                final = done["choices"][0]["text"]
                yield self._event("response.output_text.done", item_id=self.item_id, output_index=index,
                                  content_index=0, text=final, logprobs=[])
                yield self._event("response.content_part.done", item_id=self.item_id, output_index=index,
                                  content_index=0, part={"type": "output_text", "text": final, "annotations": []})
                yield self._event("response.output_item.done", output_index=index, item=item)
            elif item["type"] == "function_call":
                yield from self._call(item, index)
        yield self._event("response.completed", response=response)

    def _call(self, item: dict, output_index: int):
        """The events of one function_call item: the worker sends each call whole, so its arguments come in
        one delta."""
        yield self._event("response.output_item.added", output_index=output_index,
                          item={**item, "arguments": "", "status": "in_progress"})
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=output_index,
                          delta=item["arguments"])
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=output_index,
                          name=item["name"], arguments=item["arguments"])
        yield self._event("response.output_item.done", output_index=output_index, item=item)
