"""Rendering answers in OpenAI's wire shapes: the one place that knows them (views call it, never each other).

Inputs are the worker's events (jobs.contract documents their data); outputs are JSON bodies,
Responses, or SSE frames.
"""

from __future__ import annotations

from flask import Response, jsonify

from jobs.events import DELTA, DONE, SEGMENT
from jobs.formats import logprobs_field, render
from web.sse import sse_data


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
    """A chat choice's assistant message: its text, and its tool calls (content null when it only calls)."""
    calls = choice.get("tool_calls")
    if not calls:
        return {"role": "assistant", "content": choice["text"]}
    return {"role": "assistant", "content": choice["text"].strip() or None, "tool_calls": openai_tool_calls(calls)}


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


def chat_chunks(job_id: str, model: str, created: int, include_usage: bool):
    """A renderer of text events as `chat.completion.chunk` SSE frames (a role delta opens each choice)."""
    base = {"id": job_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}
    extra = {"usage": None} if include_usage else {}
    started = set()
    calls_sent: dict[int, int] = {}  # per choice: tool calls streamed so far (a call's `index`)

    def chunk(index: int, delta: dict, finish_reason=None, logprobs=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_data({**base, "choices": [choice], **extra})

    def frames(event: dict):
        data = event["data"]
        if event["type"] == DELTA:
            index = data.get("index", 0)
            if index not in started:
                started.add(index)
                yield chunk(index, {"role": "assistant", "content": ""})
            if data["text"] or data.get("logprobs"):
                yield chunk(index, {"content": data["text"]}, logprobs=chat_logprobs(data.get("logprobs")))
            for call in openai_tool_calls(data.get("tool_calls")):  # each call whole, in one delta
                position = calls_sent.get(index, 0)
                calls_sent[index] = position + 1
                yield chunk(index, {"tool_calls": [{"index": position, **call}]})
        elif event["type"] == DONE:
            for choice in data["choices"]:
                if choice["index"] not in started:
                    yield chunk(choice["index"], {"role": "assistant", "content": ""})
                yield chunk(choice["index"], {}, choice["finish_reason"])
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": data["usage"]})

    return frames


def completion_chunks(job_id: str, model: str, created: int, include_usage: bool):
    """A renderer of text events as streamed `text_completion` SSE frames."""
    base = {"id": job_id, "object": "text_completion", "created": created, "model": model}
    extra = {"usage": None} if include_usage else {}

    offsets: dict[int, int] = {}  # per choice: characters of text already sent (logprobs' text_offset)

    def chunk(index: int, text: str, finish_reason=None, logprobs=None) -> str:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_data({**base, "choices": [choice], **extra})

    def frames(event: dict):
        data = event["data"]
        if event["type"] == DELTA:
            index = data.get("index", 0)
            logprobs = completion_logprobs(data.get("logprobs"), offsets.get(index, 0))
            offsets[index] = offsets.get(index, 0) + len(data["text"])
            yield chunk(index, data["text"], logprobs=logprobs)
        elif event["type"] == DONE:
            for choice in data["choices"]:
                yield chunk(choice["index"], "", choice["finish_reason"])
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": data["usage"]})

    return frames


def transcript_deltas():
    """A renderer of transcription events as `transcript.text.delta` / `transcript.text.done` frames (each
    with its tokens' `logprobs` when include[]=logprobs asked for them)."""
    state = {"started": False}

    def frames(event: dict):
        data = event["data"]
        if event["type"] == SEGMENT:
            text = data["segment"]["text"]
            # Segments carry their own leading space; the first delta starts the text without one.
            text = text if state["started"] else text.lstrip()
            if text:
                state["started"] = True
                yield sse_data({"type": "transcript.text.delta", "delta": text, **logprobs_field(data)})
        elif event["type"] == DONE:
            result = data["result"]
            yield sse_data({"type": "transcript.text.done", "text": result["text"], **logprobs_field(result)})

    return frames


def stream_error(request_id: str):
    """A renderer of an error event as an OpenAI-style error frame (the openai client raises on it)."""

    def frame(data: dict) -> str:
        error = {"message": data.get("message", "error"), "type": "server_error",
                 "param": data.get("param"), "code": data.get("code")}
        extra = {k: v for k, v in data.items() if k not in ("message", "param", "code", "status")}
        return sse_data({"error": {**error, **extra}, "request_id": request_id})

    return frame


def transcription(result: dict, fmt: str, granularities) -> Response:
    """A verbose_json result in `fmt`: a JSON body, or text (text, srt, vtt: each as its own content type)."""
    body, mimetype = render(result, fmt, tuple(granularities))
    if isinstance(body, dict):
        return jsonify(body)
    return Response(body, content_type=mimetype)


def job_result(record: dict, result: dict | None):
    """An async job's result as clients see it: verbose_json, or a chat.completion object for chat."""
    if record["kind"] != "chat" or result is None:
        return result
    return chat_completion(record["id"], result.get("created") or record["created_at"],
                           {**result, "model": result.get("model", record.get("model"))})
