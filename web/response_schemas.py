"""Schemas of what the API answers, for /openapi.json: the error envelope, OpenAI's answer shapes, SSE.

They document; the views render (a schema-fuzzing test checks that every answer matches them).
"""

from __future__ import annotations

from marshmallow import INCLUDE, Schema, fields


class ErrorDetailSchema(Schema):
    """The `error` object: OpenAI's four fields, and sometimes more (job_id, reason, job_status...)."""

    class Meta:
        unknown = INCLUDE

    message = fields.String(required=True)
    type = fields.String(required=True)
    param = fields.String(required=True, allow_none=True)
    code = fields.String(required=True, allow_none=True)


class ErrorEnvelopeSchema(Schema):
    """Every error answer: `{"error": {...}, "request_id": ...}` (also the `X-Request-ID` header)."""

    error = fields.Nested(ErrorDetailSchema, required=True)
    request_id = fields.String(required=True, allow_none=True)


class PromptTokensDetailsSchema(Schema):
    """How many prompt tokens were served from the prompt cache."""

    cached_tokens = fields.Integer(required=True)


class CompletionTokensDetailsSchema(Schema):
    """How many of the completion tokens a reasoning model spent thinking (markers included)."""

    reasoning_tokens = fields.Integer(required=True)


class UsageSchema(Schema):
    """Token counts of a text answer."""

    prompt_tokens = fields.Integer(required=True)
    completion_tokens = fields.Integer(required=True)
    total_tokens = fields.Integer(required=True)
    prompt_tokens_details = fields.Nested(PromptTokensDetailsSchema)
    completion_tokens_details = fields.Nested(CompletionTokensDetailsSchema)


class FunctionCallSchema(Schema):
    """The function a tool call calls."""

    name = fields.String(required=True)
    arguments = fields.String(required=True, metadata={"description": "The arguments, a JSON object as a string"})


class ToolCallSchema(Schema):
    """One tool call of an assistant message."""

    id = fields.String(required=True)
    type = fields.String(required=True, metadata={"description": "Always 'function'"})
    function = fields.Nested(FunctionCallSchema, required=True)


class AssistantMessageSchema(Schema):
    """The message of a chat choice."""

    role = fields.String(required=True)
    content = fields.String(required=True, allow_none=True,
                            metadata={"description": "The answer; null when the choice only calls tools"})
    tool_calls = fields.List(fields.Nested(ToolCallSchema), metadata={"description": "Present when it calls tools"})
    reasoning_content = fields.String(metadata={"description": "A reasoning model's thinking, apart from the answer"})
    reasoning = fields.String(metadata={"description": "The same as reasoning_content (mlx_lm.server's name)"})


class ChatChoiceSchema(Schema):
    """One choice of a chat.completion."""

    index = fields.Integer(required=True)
    message = fields.Nested(AssistantMessageSchema, required=True)
    logprobs = fields.Raw(required=True, allow_none=True)
    finish_reason = fields.String(required=True, allow_none=True)


class _TextAnswerSchema(Schema):
    """What a chat.completion and a text_completion share."""

    id = fields.String(required=True)
    object = fields.String(required=True)
    created = fields.Integer(required=True)
    model = fields.String(required=True)
    system_fingerprint = fields.String(required=True, allow_none=True)
    usage = fields.Nested(UsageSchema, required=True)


class ChatCompletionSchema(_TextAnswerSchema):
    """A `chat.completion` object."""

    choices = fields.List(fields.Nested(ChatChoiceSchema), required=True)


class CompletionChoiceSchema(Schema):
    """One choice of a text_completion."""

    index = fields.Integer(required=True)
    text = fields.String(required=True)
    logprobs = fields.Raw(required=True, allow_none=True)
    finish_reason = fields.String(required=True, allow_none=True)


class CompletionSchema(_TextAnswerSchema):
    """A `text_completion` object."""

    choices = fields.List(fields.Nested(CompletionChoiceSchema), required=True)


class TranscriptionSchema(Schema):
    """A transcription as `json` (only `text`) or `verbose_json` (everything, segments and/or words)."""

    class Meta:
        unknown = INCLUDE

    text = fields.String(required=True)
    task = fields.String()
    language = fields.String(allow_none=True)
    duration = fields.Float()
    segments = fields.List(fields.Dict())
    words = fields.List(fields.Dict())
    logprobs = fields.List(fields.Dict(), metadata={
        "description": "With include[]=logprobs: {token, logprob, bytes} for each text token, in order"})


class EmbeddingSchema(Schema):
    """One input's vector."""

    object = fields.String(required=True, metadata={"example": "embedding"})
    index = fields.Integer(required=True, metadata={"description": "The input's place in the request's `input`"})
    embedding = fields.Raw(required=True, metadata={
        "oneOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}],
        "description": "The vector: numbers, or with `encoding_format` base64 its little-endian float32 bytes"})


class EmbeddingUsageSchema(Schema):
    """Tokens read (special tokens included)."""

    prompt_tokens = fields.Integer(required=True)
    total_tokens = fields.Integer(required=True)


class EmbeddingListSchema(Schema):
    """The answer of POST /v1/embeddings."""

    object = fields.String(required=True, metadata={"example": "list"})
    data = fields.List(fields.Nested(EmbeddingSchema), required=True)
    model = fields.String(required=True)
    usage = fields.Nested(EmbeddingUsageSchema, required=True)


class AnyObjectSchema(Schema):
    """A JSON object of any shape (a job's result: a transcription or a chat.completion)."""

    class Meta:
        unknown = INCLUDE


class ServerSentEventSchema(Schema):
    """One Server-Sent Event: `data` is a JSON document (or `[DONE]`, the end of an OpenAI stream)."""

    data = fields.String(required=True)
    event = fields.String()
    id = fields.String()


class HealthSchema(Schema):
    """GET /health."""

    status = fields.String(required=True)


class ReadySchema(Schema):
    """GET /ready: whether Redis answers and a worker is alive."""

    status = fields.String(required=True)
    redis = fields.Boolean(required=True)
    worker = fields.Boolean(required=True)


SSE = "text/event-stream"
TEXT = "text/plain"
