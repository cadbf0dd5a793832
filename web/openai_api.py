"""OpenAI-compatible text endpoints: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import logging
import time

from flask import g, jsonify

from jobs import queues
from jobs.events import DELTA, DONE
from jobs.store import ModelNotFound, resolve
from web.errors import APIError
from web.jobrun import stream_response, submit, wait_for_result
from web.jsonbody import Blueprint
from web.response_schemas import SSE, ChatCompletionSchema, CompletionSchema, ServerSentEventSchema
from web.schemas import ChatCompletionRequestSchema, CompletionRequestSchema
from web.services import services
from web.sse import sse_data

log = logging.getLogger(__name__)

blp = Blueprint("openai", __name__, url_prefix="/v1", description="OpenAI-compatible text generation")

DEFAULT_MAX_TOKENS = 512
"""max_tokens when the client sends none (bounded so a forgotten limit can't hold the GPU)."""


def resolve_model(ref: str | None, kind: str):
    """Resolve a model reference to a catalog entry of `kind`, or raise 404 / 400."""
    try:
        info = resolve(ref, services().settings, allow_paths=False)
    except ModelNotFound as exc:
        log.info("%s", exc)  # the operator's log gets the places looked, with their paths
        raise APIError(404, exc.public_message, "model_not_found", "model") from None
    if info.kind != kind:
        raise APIError(400, f"Model '{info.id}' is a {info.kind} model; this endpoint needs a {kind} model.",
                       "invalid_model", "model")
    return info


def sampling_payload(body: dict, info) -> dict:
    """The worker payload fields shared by chat and completions, bounded by the settings and the model."""
    limit = services().settings.max_tokens_limit
    if info.context_length:
        limit = min(limit, info.context_length)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or min(DEFAULT_MAX_TOKENS, limit)
    if max_tokens > limit:
        param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        raise APIError(400, f"'{param}' must be at most {limit} for model '{info.id}'.", "invalid_value", param)
    if body["top_k"] and info.vocab_size and body["top_k"] > info.vocab_size:
        raise APIError(400, f"'top_k' must be at most {info.vocab_size}, the vocabulary size of model "
                            f"'{info.id}'.", "invalid_value", "top_k")
    return {
        "model": info.id,
        "max_tokens": max_tokens,
        "temperature": 1.0 if body["temperature"] is None else body["temperature"],
        "top_p": 1.0 if body["top_p"] is None else body["top_p"],
        "top_k": body["top_k"] or 0,
        "min_p": body["min_p"] or 0.0,
        "seed": body["seed"],
        "stop": body["stop"] or [],
        "repetition_penalty": body["repetition_penalty"],
    }


def stream_error(request_id: str):
    """Frame a worker error as an OpenAI-style error chunk (the openai client raises on it)."""

    def frame(data: dict) -> str:
        error = {"message": data.get("message", "error"), "type": "server_error",
                 "param": data.get("param"), "code": data.get("code")}
        extra = {k: v for k, v in data.items() if k not in ("message", "param", "code", "status")}
        return sse_data({"error": {**error, **extra}, "request_id": request_id})

    return frame


def chat_messages(body: dict) -> list[dict]:
    """The worker's message list: developer messages become system ones (chat templates know those)."""
    return [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
            for m in body["messages"]]


def _usage_wanted(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


@blp.route("/chat/completions", methods=["POST"])
@blp.arguments(ChatCompletionRequestSchema())
@blp.response(200, ChatCompletionSchema, description="A chat.completion; with `stream`, chat.completion.chunk "
              "events, then `data: [DONE]`")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def chat_completions(body):
    """Create a chat completion (plain JSON, or SSE chunks when `stream` is true)."""
    info = resolve_model(body["model"], "text")
    payload = {**sampling_payload(body, info), "messages": chat_messages(body)}
    job_id = submit(queues.CHAT_COMPLETION, payload, "chatcmpl", f"chat {info.id}")
    created = int(time.time())
    if body["stream"]:
        return stream_response(job_id, _chat_chunks(job_id, info.id, created, _usage_wanted(body)),
                               stream_error(g.request_id))
    done = wait_for_result(job_id)
    choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                "logprobs": None, "finish_reason": c["finish_reason"]} for c in done["choices"]]
    return jsonify({"id": job_id, "object": "chat.completion", "created": created, "model": info.id,
                    "system_fingerprint": None, "choices": choices, "usage": done["usage"]})


def _chat_chunks(job_id: str, model: str, created: int, include_usage: bool):
    """Render worker events as `chat.completion.chunk` SSE messages."""
    base = {"id": job_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}
    extra = {"usage": None} if include_usage else {}
    started = set()

    def chunk(index: int, delta: dict, finish_reason=None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return sse_data({**base, "choices": [choice], **extra})

    def render(event: dict):
        data = event["data"]
        if event["type"] == DELTA:
            index = data.get("index", 0)
            if index not in started:
                started.add(index)
                yield chunk(index, {"role": "assistant", "content": ""})
            yield chunk(index, {"content": data["text"]})
        elif event["type"] == DONE:
            for choice in data["choices"]:
                if choice["index"] not in started:
                    yield chunk(choice["index"], {"role": "assistant", "content": ""})
                yield chunk(choice["index"], {}, choice["finish_reason"])
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": data["usage"]})

    return render


@blp.route("/completions", methods=["POST"])
@blp.arguments(CompletionRequestSchema())
@blp.response(200, CompletionSchema, description="A text_completion; with `stream`, text_completion events, "
              "then `data: [DONE]`")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def completions(body):
    """Create a text completion for one prompt or a list of prompts (one choice each)."""
    info = resolve_model(body["model"], "text")
    payload = {**sampling_payload(body, info), "prompts": body["prompt"]}
    job_id = submit(queues.TEXT_COMPLETION, payload, "cmpl", f"completion {info.id}")
    created = int(time.time())
    if body["stream"]:
        return stream_response(job_id, _completion_chunks(job_id, info.id, created, _usage_wanted(body)),
                               stream_error(g.request_id))
    done = wait_for_result(job_id)
    choices = [{"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
               for c in done["choices"]]
    return jsonify({"id": job_id, "object": "text_completion", "created": created, "model": info.id,
                    "system_fingerprint": None, "choices": choices, "usage": done["usage"]})


def _completion_chunks(job_id: str, model: str, created: int, include_usage: bool):
    """Render worker events as `text_completion` SSE messages."""
    base = {"id": job_id, "object": "text_completion", "created": created, "model": model}
    extra = {"usage": None} if include_usage else {}

    def chunk(index: int, text: str, finish_reason=None) -> str:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return sse_data({**base, "choices": [choice], **extra})

    def render(event: dict):
        data = event["data"]
        if event["type"] == DELTA:
            yield chunk(data.get("index", 0), data["text"])
        elif event["type"] == DONE:
            for choice in data["choices"]:
                yield chunk(choice["index"], "", choice["finish_reason"])
            if include_usage:
                yield sse_data({**base, "choices": [], "usage": data["usage"]})

    return render
