"""OpenAI-compatible text endpoints: /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import time

from flask import g

from jobs import queues
from web import intake
from web.jobrun import answer, stream_response, submit
from web.jsonbody import Blueprint
from web.media_parts import accepts_media_parts
from web.render.openai import Chat, Completion
from web.response_schemas import SSE, ChatCompletionSchema, CompletionSchema, ServerSentEventSchema
from web.schemas import ChatCompletionRequestSchema, CompletionRequestSchema

blp = Blueprint("openai", __name__, url_prefix="/v1", description="OpenAI-compatible text generation")


def _usage_wanted(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


@blp.route("/chat/completions", methods=["POST"])
@accepts_media_parts
@blp.arguments(ChatCompletionRequestSchema())
@blp.response(200, ChatCompletionSchema, description="A chat.completion; with `stream`, chat.completion.chunk "
              "events, then `data: [DONE]`")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def chat_completions(body):
    """Create a chat completion (plain JSON, or SSE chunks when `stream` is true)."""
    request = intake.chat_request(body, queues.new_job_id("chatcmpl"))
    submit(request, intake.chat_func(request), f"chat {request.model.id}")
    out = Chat(request.id, request.model.id, int(time.time()), _usage_wanted(body), g.request_id)
    return stream_response(request.id, out) if body["stream"] else answer(request.id, out)


@blp.route("/completions", methods=["POST"])
@blp.arguments(CompletionRequestSchema())
@blp.response(200, CompletionSchema, description="A text_completion; with `stream`, text_completion events, "
              "then `data: [DONE]`")
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def completions(body):
    """Create a text completion for one prompt or a list of prompts (one choice each)."""
    request = intake.completion_request(body, queues.new_job_id("cmpl"))
    submit(request, queues.TEXT_COMPLETION, f"completion {request.model.id}")
    out = Completion(request.id, request.model.id, int(time.time()), _usage_wanted(body), g.request_id)
    return stream_response(request.id, out) if body["stream"] else answer(request.id, out)
