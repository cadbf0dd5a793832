"""OpenAI's wire shapes: chat.completion and its chunks, text_completion and its stream, the error envelope.

Inputs are the worker's events (jobs.contract documents their data); outputs are JSON bodies or SSE frames.
"""

from __future__ import annotations

from jobs.events import DELTA, DONE, REASONING
from web.render.base import Renderer
from web.render.sse import sse_data

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    499: "canceled_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
    507: "insufficient_storage_error",
}
"""OpenAI's error `type` for each status mlxq answers with (others: server_error)."""


def error_body(status: int, error: dict, request_id: str | None) -> dict:
    """The error envelope `{"error": {message, type, param, code, ...}, "request_id"}` (`error`: message,
    code, param and any extra fields)."""
    extra = {k: v for k, v in error.items() if k not in ("message", "code", "param")}
    body = {"message": error["message"], "type": ERROR_TYPES.get(status, "server_error"),
            "param": error.get("param"), "code": error.get("code"), **extra}
    return {"error": body, "request_id": request_id}


def stream_error(data: dict, request_id: str | None) -> str:
    """An error event as an OpenAI-style error frame (the openai client raises on it)."""
    error = {"message": data.get("message", "error"), "type": "server_error",
             "param": data.get("param"), "code": data.get("code")}
    extra = {k: v for k, v in data.items() if k not in ("message", "param", "code", "status")}
    return sse_data({"error": {**error, **extra}, "request_id": request_id})


def chat_logprobs(entries: list | None) -> dict | None:
    """A chat choice's (or chunk's) `logprobs` object from the worker's entries."""
    return None if entries is None else {"content": entries, "refusal": None}


def completion_logprobs(entries: list | None, offset: int = 0) -> dict | None:
    """Completions' older `logprobs` shape from the worker's entries, text offsets counted from `offset`."""
    if entries is None:
        return None
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def openai_tool_calls(calls: list | None) -> list:
    """The worker's tool calls in OpenAI's chat shape."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls or []]


def chat_message(choice: dict) -> dict:
    """A chat choice's assistant message: its text, its reasoning (a reasoning model's thinking: vLLM's and
    LM Studio's `reasoning_content`, mlx_lm.server's `reasoning`), and its tool calls (content null when it
    only calls)."""
    thought = choice.get("reasoning")
    message = {"role": "assistant", "content": choice["text"]}
    if thought:
        message.update(reasoning_content=thought, reasoning=thought)
    calls = choice.get("tool_calls")
    if calls:
        message.update(content=choice["text"].strip() or None, tool_calls=openai_tool_calls(calls))
    return message


def chat_completion(job_id: str, created: int, done: dict) -> dict:
    """A `chat.completion` object from a text job's `done` data."""
    choices = [{"index": c["index"], "message": chat_message(c),
                "logprobs": chat_logprobs(c.get("logprobs")), "finish_reason": c["finish_reason"]}
               for c in done["choices"]]
    return {"id": job_id, "object": "chat.completion", "created": created, "model": done["model"],
            "system_fingerprint": None, "choices": choices, "usage": done["usage"]}


def text_completion(job_id: str, created: int, done: dict) -> dict:
    """A `text_completion` object from a text job's `done` data."""
    choices = [{"index": c["index"], "text": c["text"], "logprobs": completion_logprobs(c.get("logprobs")),
                "finish_reason": c["finish_reason"]} for c in done["choices"]]
    return {"id": job_id, "object": "text_completion", "created": created, "model": done["model"],
            "system_fingerprint": None, "choices": choices, "usage": done["usage"]}


class _OpenAIStream(Renderer):
    """What chat and completions streams share: the chunks' common fields, usage, errors and `[DONE]`."""

    object = ""

    def __init__(self, job_id: str, model: str, created: int, include_usage: bool, request_id: str | None):
        self.job_id, self.created, self.request_id = job_id, created, request_id
        self.include_usage = include_usage
        self.base = {"id": job_id, "object": self.object, "created": created, "model": model}
        self.extra = {"usage": None} if include_usage else {}

    def chunk(self, choice: dict) -> str:
        """One chunk frame carrying one choice's piece."""
        return sse_data({**self.base, "choices": [choice], **self.extra})

    def usage(self, done: dict):
        """The last chunk, with the usage and no choices, when the client asked for it."""
        if self.include_usage:
            yield sse_data({**self.base, "choices": [], "usage": done["usage"]})

    def error_frame(self, error: dict) -> str:
        """An OpenAI-style error frame."""
        return stream_error(error, self.request_id)

    def closing(self):
        """`data: [DONE]`, as OpenAI's streams end."""
        yield sse_data("[DONE]")


class Chat(_OpenAIStream):
    """A chat completion: the `chat.completion` object, or `chat.completion.chunk` frames (a role delta
    opens each choice; reasoning comes as `reasoning_content` deltas before the content's; each tool call
    comes whole, in one delta)."""

    object = "chat.completion.chunk"

    def __init__(self, job_id: str, model: str, created: int, include_usage: bool = False,
                 request_id: str | None = None):
        super().__init__(job_id, model, created, include_usage, request_id)
        self.base["system_fingerprint"] = None
        self.started: set[int] = set()
        self.calls_sent: dict[int, int] = {}  # per choice: tool calls streamed so far (a call's `index`)

    def body(self, done: dict) -> dict:
        """The `chat.completion` object."""
        return chat_completion(self.job_id, self.created, done)

    def _piece(self, index: int, delta: dict, finish_reason=None, logprobs=None) -> str:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    def frames(self, event: dict):
        """Chunks for a delta (the role first), or each choice's finish and the usage for `done`."""
        data = event["data"]
        if event["type"] == REASONING:
            index = data.get("index", 0)
            if index not in self.started:
                self.started.add(index)
                yield self._piece(index, {"role": "assistant", "content": ""})
            yield self._piece(index, {"reasoning_content": data["text"], "reasoning": data["text"]})
        elif event["type"] == DELTA:
            index = data.get("index", 0)
            if index not in self.started:
                self.started.add(index)
                yield self._piece(index, {"role": "assistant", "content": ""})
            if data["text"] or data.get("logprobs"):
                yield self._piece(index, {"content": data["text"]}, logprobs=chat_logprobs(data.get("logprobs")))
            for call in openai_tool_calls(data.get("tool_calls")):
                position = self.calls_sent.get(index, 0)
                self.calls_sent[index] = position + 1
                yield self._piece(index, {"tool_calls": [{"index": position, **call}]})
        elif event["type"] == DONE:
            for choice in data["choices"]:
                if choice["index"] not in self.started:
                    yield self._piece(choice["index"], {"role": "assistant", "content": ""})
                yield self._piece(choice["index"], {}, choice["finish_reason"])
            yield from self.usage(data)


class Completion(_OpenAIStream):
    """A text completion: the `text_completion` object, or its streamed chunks."""

    object = "text_completion"

    def __init__(self, job_id: str, model: str, created: int, include_usage: bool = False,
                 request_id: str | None = None):
        super().__init__(job_id, model, created, include_usage, request_id)
        self.offsets: dict[int, int] = {}  # per choice: characters of text already sent (logprobs' text_offset)

    def body(self, done: dict) -> dict:
        """The `text_completion` object."""
        return text_completion(self.job_id, self.created, done)

    def _piece(self, index: int, text: str, finish_reason=None, logprobs=None) -> str:
        return self.chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})

    def frames(self, event: dict):
        """A chunk per delta, then each choice's finish and the usage for `done`."""
        data = event["data"]
        if event["type"] == DELTA:
            index = data.get("index", 0)
            logprobs = completion_logprobs(data.get("logprobs"), self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(data["text"])
            yield self._piece(index, data["text"], logprobs=logprobs)
        elif event["type"] == DONE:
            for choice in data["choices"]:
                yield self._piece(choice["index"], "", choice["finish_reason"])
            yield from self.usage(data)
