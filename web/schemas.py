"""Request and response schemas of the OpenAI-compatible endpoints (marshmallow, via flask-smorest)."""

from __future__ import annotations

import json
import math
import re

from marshmallow import EXCLUDE, Schema, ValidationError, fields, validate, validates_schema

from jobs.contract import MAX_EMBEDDING_INPUTS, Sampling
from web.errors import APIError
from web.structured import ResponseFormatSchema

DEFAULTS = Sampling()
"""The sampling defaults (jobs.contract: the one place they are set)."""
MAX_STOP = 4
MAX_N = 8
"""The most choices one request may ask for (`n`)."""
MAX_SEED = 2**63 - 1
"""Seeds are OpenAI's int64, non-negative (MLX seeds its generator with an unsigned 64-bit integer)."""
MAX_TOP_K = 2**31 - 1
"""A first bound on top_k before the model is known; its vocabulary size bounds it further."""


MAX_TOP_LOGPROBS = 20
"""Chat's top_logprobs: alternatives per token, at most (OpenAI's limit)."""

MAX_COMPLETION_LOGPROBS = 5
"""Completions' logprobs: alternatives per token, at most (OpenAI's limit)."""


class StringOrList(fields.Field):
    """A string, or a list of strings (OpenAI's `stop` and `prompt`); always loads as a list."""

    def __init__(self, max_items: int | None = None, allow_empty_list: bool = True,
                 allow_empty_strings: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.max_items, self.allow_empty_list = max_items, allow_empty_list
        self.allow_empty_strings = allow_empty_strings

    def _deserialize(self, value, attr, data, **kwargs):
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
            raise ValidationError("must be a string or a list of strings")
        if self.max_items is not None and len(items) > self.max_items:
            raise ValidationError(f"at most {self.max_items} items")
        if not items and not self.allow_empty_list:
            raise ValidationError("must not be empty")
        if not self.allow_empty_strings and not all(items):
            raise ValidationError("must not be an empty string (a prompt needs at least one character)")
        return items


MAX_LOGIT_BIAS = 300
"""The most token ids one request's logit_bias may name (OpenAI's limit)."""
MAX_BIAS = 100
"""logit_bias values lie in [-MAX_BIAS, MAX_BIAS]: -100 bans a token and +100 forces it, in practice."""


class LogitBias(fields.Dict):
    """OpenAI's `logit_bias`: token id (a JSON key: a non-negative integer as a string) to a number in
    [-100, 100], at most 300 entries; loads as {id: bias}. The model's vocabulary bounds the ids further
    (web.intake)."""

    def __init__(self, **kwargs):
        # `values` only documents the shape for OpenAPI (additionalProperties); _deserialize checks it
        # itself, with flat messages, so a 400 names `logit_bias` (not `logit_bias.abc.key`).
        metadata = {"description": "Token id (a non-negative integer, as a string) to a bias added to its "
                                   f"logit before sampling, -{MAX_BIAS} to {MAX_BIAS} (-100 bans the token, "
                                   f"+100 forces it, in practice); at most {MAX_LOGIT_BIAS} entries, ids "
                                   "below the model's vocabulary size",
                    "maxProperties": MAX_LOGIT_BIAS, "example": {"50256": -100}}
        super().__init__(values=fields.Float(validate=validate.Range(min=-MAX_BIAS, max=MAX_BIAS)),
                         metadata=metadata, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, dict):
            raise ValidationError("must be an object mapping token ids to biases, such as {\"50256\": -100}")
        if len(value) > MAX_LOGIT_BIAS:
            raise ValidationError(f"at most {MAX_LOGIT_BIAS} token ids (got {len(value)})")
        return {_token_id(key): _bias(key, bias) for key, bias in value.items()}


def _token_id(key: str) -> int:
    """A logit_bias key as a token id: digits only, no sign or leading zero (so no two keys name one id)."""
    # isascii: str.isdigit also takes digits such as "²", which int() refuses
    if not (key.isascii() and key.isdigit()) or (len(key) > 1 and key[0] == "0") or int(key) > MAX_TOP_K:
        raise ValidationError(f"key {key[:40]!r} is not a token id: keys are non-negative integers written as "
                              "strings, such as \"50256\"")
    return int(key)


def _bias(key: str, bias) -> float:
    """A logit_bias value: a number in [-MAX_BIAS, MAX_BIAS]."""
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise ValidationError(f"the bias of token {key} must be a number, not {type(bias).__name__}")
    if not -MAX_BIAS <= bias <= MAX_BIAS:
        raise ValidationError(f"the bias of token {key} must lie between -{MAX_BIAS} and {MAX_BIAS}")
    return float(bias)


IMAGE_DETAILS = ("auto", "low", "high")


class MessageContent(fields.Field):
    """Message content: a string, or an array of content parts.

    Text-only arrays load as their joined text. Arrays with `image_url` or `input_audio` parts load as a
    list of parts in OpenAI's shape (an `image_url` given as a bare string is accepted as `{"url": ...}`);
    web.media_parts fetches, checks and spools them.
    """

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValidationError("must be a string or an array of content parts")
        parts = [_content_part(part, index) for index, part in enumerate(value)]
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return parts


def _content_part(part, index: int) -> dict:
    """One content part, checked for shape (its data is checked when it is spooled)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise ValidationError(f"content part {index}: 'text' must be a string")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        image = part.get("image_url")
        image = {"url": image} if isinstance(image, str) else image
        if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
            raise ValidationError(f"content part {index}: 'image_url' must be an object with a 'url' string")
        detail = image.get("detail") or "auto"
        if detail not in IMAGE_DETAILS:
            raise ValidationError(f"content part {index}: 'detail' must be one of {', '.join(IMAGE_DETAILS)}")
        return {"type": "image_url", "image_url": {"url": image["url"], "detail": detail}}
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str) or not audio["data"]:
            raise ValidationError(f"content part {index}: 'input_audio' must be an object with a base64 'data' "
                                  "string and a 'format'")
        fmt = audio.get("format")
        if fmt is not None and not isinstance(fmt, str):
            raise ValidationError(f"content part {index}: 'format' must be a string such as 'wav' or 'mp3'")
        return {"type": "input_audio", "input_audio": {"data": audio["data"], "format": fmt or ""}}
    name = kind if isinstance(kind, str) else type(part).__name__
    raise ValidationError(f"content part {index} of type {name!r} is not supported; 'text', 'image_url' and "
                          "'input_audio' parts are")


class NotYet(fields.Field):
    """A request field that would change the answer but that mlxq does not serve (yet): reasoning and thinking
    control, audio answers, web search...; left out, null or a value that asks for nothing (`passes`) it goes
    through, any other value is a 400 naming it. Never accepted and ignored: a client must be able to tell that its
    setting would do nothing. docs/api.md lists them per API."""

    def __init__(self, what: str, passes: tuple = ({},), **kwargs):
        """`what` mlxq does not do (the 400 says "mlxq does not <what>"); `passes`: values that ask for nothing
        (besides null), such as an empty list or the API's own default."""
        shown = ", ".join(json.dumps(v) for v in passes)
        super().__init__(load_default=None, allow_none=True, metadata={
            "description": f"Not supported yet (mlxq does not {what}): leave it out"
                           f"{' or send ' + shown if shown else ''}; any other value is a 400."}, **kwargs)
        self.what, self.passes = what, passes

    def _deserialize(self, value, attr, data, **kwargs):
        if value is None or value in self.passes:
            return None
        raise ValidationError(f"not supported yet: mlxq does not {self.what}; leave it out")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
"""OpenAI's reasoning_effort values (web.intake.EFFORT_BUDGETS says what each means here)."""
MAX_THINKING_BUDGET = 2**31 - 1
"""A budget past any context: as good as none."""
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024
"""The largest chat_template_kwargs (as JSON) a request may send."""
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token", "raise_exception",
})
"""Template variables a request cannot set: the chat itself and the tokenizer's own arguments and variables."""


class TemplateKwargs(fields.Dict):
    """`chat_template_kwargs`: extra variables for the model's chat template (e.g. {"enable_thinking": false}),
    names of letters, digits and underscores, JSON values, at most MAX_TEMPLATE_KWARGS_BYTES."""

    def __init__(self, **kwargs):
        super().__init__(keys=fields.String(), metadata={"description": "Extra variables for the model's chat "
                                                         "template, passed as they are (enable_thinking: a boolean)"},
                         **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        value = super()._deserialize(value, attr, data, **kwargs)
        if len(json.dumps(value)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise ValidationError(f"must be at most {MAX_TEMPLATE_KWARGS_BYTES // 1024} KiB as JSON")
        for name in value:
            if not name.isidentifier() or name.startswith("_"):
                raise ValidationError(f"'{name}' is not a template variable name (letters, digits, underscores)")
            if name in RESERVED_TEMPLATE_KWARGS:
                raise ValidationError(f"'{name}' is set by the server, not the request")
        if "enable_thinking" in value and not isinstance(value["enable_thinking"], bool):
            raise ValidationError("'enable_thinking' must be true or false")
        return value


class StreamOptionsSchema(Schema):
    """`stream_options`: only include_usage is meaningful."""

    class Meta:
        unknown = EXCLUDE

    include_usage = fields.Boolean(load_default=False)


class PenaltiesSchema(Schema):
    """OpenAI's penalties (-2 to 2) and logit_bias, applied by the worker's sampler; null means neutral.
    Chat, completions and Responses bodies all take them from here."""

    presence_penalty = fields.Float(load_default=0.0, allow_none=True, validate=validate.Range(min=-2, max=2),
                                    metadata={"description": "Subtracted once from the logit of every token "
                                              "already in the answer"})
    frequency_penalty = fields.Float(load_default=0.0, allow_none=True, validate=validate.Range(min=-2, max=2),
                                     metadata={"description": "Subtracted from the logit of every token already "
                                               "in the answer, times the number of times it appears there"})
    logit_bias = LogitBias(load_default=dict, allow_none=True)


PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "logit_bias")
"""PenaltiesSchema's fields."""


class KeepAlive(fields.Field):
    """Ollama's `keep_alive`: how long the model stays loaded after this request, as seconds (a number) or a
    duration ("30s", "5m", "1h30m", "500ms"); negative: until the memory budget evicts it; 0: unload once idle.
    Loads as seconds (-1.0 for any negative)."""

    UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValidationError('must be a number of seconds or a duration such as "5m" or "1h30m"')
        if isinstance(value, str):
            text = value.strip()
            sign, text = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
            parts = self.PART.findall(text)
            if parts and "".join(n + u for n, u in parts) == text:
                value = sign * sum(float(n) * self.UNITS[u] for n, u in parts)
            else:
                try:
                    value = sign * float(text)
                except ValueError:
                    raise ValidationError('must be a number of seconds or a duration such as "5m" or "1h30m"') from None
        if not math.isfinite(value):
            raise ValidationError("must be finite")
        return -1.0 if value < 0 else float(value)


def keep_alive_field() -> KeepAlive:
    """`keep_alive`: how long the request's model stays loaded once idle (Ollama's field)."""
    return KeepAlive(load_default=None, allow_none=True, metadata={
        "oneOf": [{"type": "number"}, {"type": "string"}],
        "description": "How long the model stays loaded after this request once no request uses it: seconds, or "
                       "a duration such as \"5m\" or \"1h30m\" (Ollama's field); negative keeps it until the "
                       "memory budget evicts it, 0 unloads it as soon as it is idle. Left out: the worker's "
                       "MLXQ_MODEL_TTL_S, or what the model's latest request asked"})


def adapter_field() -> fields.String:
    """`adapter`: the LoRA adapter to decode with (one of the model's in GET /v1/models), or "none"."""
    return fields.String(load_default=None, allow_none=True, validate=validate.Length(min=1, max=128),
                         metadata={"description": "A LoRA adapter of the model (GET /v1/models lists each model's "
                                   "`adapters`) to decode with; \"none\" or left out: the model alone"})


class SamplingSchema(PenaltiesSchema):
    """Fields shared by chat and text completions."""

    class Meta:
        unknown = EXCLUDE  # harmless unknown fields are ignored, as OpenAI-style clients expect

    model = fields.String(load_default=None, validate=validate.Length(min=1, max=512))
    max_tokens = fields.Integer(strict=True, load_default=None, validate=validate.Range(min=1), allow_none=True)
    # Left out or null: the model's generation_config.json value, else mlxq's default (web.intake.sampling_defaults;
    # GET /v1/models/{id} shows them).
    temperature = fields.Float(load_default=None, validate=validate.Range(min=0, max=2), allow_none=True,
                               metadata={"description": f"Left out: the model's default (GET /v1/models/{{id}}, "
                                         f"`sampling_defaults`), else {DEFAULTS.temperature}"})
    top_p = fields.Float(load_default=None, validate=validate.Range(min=0, max=1, min_inclusive=False),
                         allow_none=True, metadata={"description": f"Left out: the model's default, else {DEFAULTS.top_p}"})
    # Bounded by the model's vocabulary too, once the model is known (web.openai_api).
    top_k = fields.Integer(strict=True, load_default=None, validate=validate.Range(min=0, max=MAX_TOP_K),
                           allow_none=True, metadata={"description": "Left out: the model's default, else 0 (none)"})
    min_p = fields.Float(load_default=None, validate=validate.Range(min=0, max=1), allow_none=True,
                         metadata={"description": "Left out: the model's default, else 0 (none)"})
    seed = fields.Integer(strict=True, load_default=None, validate=validate.Range(min=0, max=MAX_SEED),
                          allow_none=True)
    stop = StringOrList(max_items=MAX_STOP, load_default=list, allow_none=True)
    repetition_penalty = fields.Float(load_default=None, validate=validate.Range(min=0, min_inclusive=False),
                                      allow_none=True)
    stream = fields.Boolean(load_default=False, allow_none=True)
    stream_options = fields.Nested(StreamOptionsSchema, load_default=None, allow_none=True)
    user = fields.String(load_default=None, allow_none=True)
    n = fields.Integer(strict=True, load_default=1, validate=validate.Range(min=1, max=MAX_N), allow_none=True)
    adapter = adapter_field()
    keep_alive = keep_alive_field()


class ChatMessageSchema(Schema):
    """One chat message: system, developer, user, assistant (with tool calls, content may be null) and
    tool (a call's result, naming the call)."""

    class Meta:
        unknown = EXCLUDE

    role = fields.String(required=True,
                         validate=validate.OneOf(["system", "developer", "user", "assistant", "tool"]))
    content = MessageContent(load_default=None, allow_none=True)
    name = fields.String(load_default=None, allow_none=True)
    tool_calls = fields.List(fields.Dict(), load_default=None, allow_none=True)
    tool_call_id = fields.String(load_default=None, allow_none=True)

    @validates_schema
    def _check_tool_fields(self, data, **kwargs):
        """Null content only beside tool calls; calls only from the assistant; results name their call."""
        role = data["role"]
        if data.get("tool_calls") and role != "assistant":
            raise ValidationError("only assistant messages carry tool calls", field_name="tool_calls")
        if data.get("content") is None and not (role == "assistant" and data.get("tool_calls")):
            raise ValidationError("must not be null (only an assistant message with tool_calls may omit it)",
                                  field_name="content")
        if role == "tool":
            if not data.get("tool_call_id"):
                raise ValidationError("a tool message needs the 'tool_call_id' of the call it answers",
                                      field_name="tool_call_id")
            if not isinstance(data["content"], str):
                raise ValidationError("a tool message's content must be text", field_name="content")
        for i, call in enumerate(data.get("tool_calls") or []):
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
                raise ValidationError(f"tool call {i} must be {{\"id\", \"type\": \"function\", \"function\": "
                                      "{\"name\", \"arguments\": a JSON string}}", field_name="tool_calls")


class ChatCompletionRequestSchema(SamplingSchema):
    """POST /v1/chat/completions body."""

    messages = fields.List(fields.Nested(ChatMessageSchema), required=True, validate=validate.Length(min=1))
    max_completion_tokens = fields.Integer(strict=True, load_default=None, validate=validate.Range(min=1),
                                           allow_none=True)
    tools = fields.List(fields.Raw(), load_default=None, allow_none=True)
    tool_choice = fields.Raw(load_default=None, allow_none=True)
    parallel_tool_calls = fields.Boolean(load_default=True, allow_none=True)
    response_format = fields.Nested(ResponseFormatSchema, load_default=None, allow_none=True)
    logprobs = fields.Boolean(load_default=None, allow_none=True)
    top_logprobs = fields.Integer(strict=True, load_default=None, allow_none=True,
                                  validate=validate.Range(min=0, max=MAX_TOP_LOGPROBS))
    # Thinking control (reasoning models: capability "reasoning"): OpenAI's reasoning_effort, and the names
    # mlx_lm.server, mlx-vlm, vLLM and Qwen use; web.intake.thinking decides what they mean together.
    reasoning_effort = fields.String(load_default=None, allow_none=True, validate=validate.OneOf(REASONING_EFFORTS),
                                     metadata={"description": "How much a reasoning model thinks: 'none' turns "
                                               "thinking off, the others set a thinking budget (docs/api.md)"})
    enable_thinking = fields.Boolean(load_default=None, allow_none=True,
                                     metadata={"description": "Whether a reasoning model thinks before it answers "
                                               "(left out: it does)"})
    thinking_budget = fields.Integer(strict=True, load_default=None, allow_none=True,
                                     validate=validate.Range(min=0, max=MAX_THINKING_BUDGET),
                                     metadata={"description": "The most tokens a reasoning model thinks for "
                                               "(markers included); then it answers"})
    chat_template_kwargs = TemplateKwargs(load_default=None, allow_none=True)
    # OpenAI's fields that would change the answer and that mlxq does not serve (harmless ones, such as
    # `prediction`, `service_tier` or `store`, are ignored like any unknown field).
    functions = NotYet("take the legacy `functions`; send them as `tools`", passes=([],))
    function_call = NotYet("take the legacy `function_call`; use `tool_choice`", passes=())
    modalities = NotYet("answer in audio", passes=(["text"],))
    audio = NotYet("answer in audio")
    web_search_options = NotYet("search the web")

    @validates_schema
    def _refuse_chat_extras(self, data, **kwargs):
        """top_logprobs means nothing without logprobs."""
        if data.get("top_logprobs") and not data.get("logprobs"):
            raise ValidationError("needs 'logprobs': true", field_name="top_logprobs")


class CompletionRequestSchema(SamplingSchema):
    """POST /v1/completions body."""

    prompt = StringOrList(required=True, max_items=32, allow_empty_list=False, allow_empty_strings=False)
    echo = fields.Boolean(load_default=False, allow_none=True)
    logprobs = fields.Integer(strict=True, load_default=None, allow_none=True,
                              validate=validate.Range(min=0, max=MAX_COMPLETION_LOGPROBS))
    suffix = fields.String(load_default=None, allow_none=True)
    best_of = fields.Integer(strict=True, load_default=None, allow_none=True)

    @validates_schema
    def _refuse_completion_extras(self, data, **kwargs):
        """echo, suffix and best_of > 1 change the answer: refuse them clearly."""
        if data.get("echo"):
            raise ValidationError("is not supported by this server", field_name="echo")
        if data.get("suffix"):
            raise ValidationError("is not supported by this server", field_name="suffix")
        if data.get("best_of") not in (None, 1):
            raise ValidationError("is not supported by this server", field_name="best_of")


class EmbeddingInput(fields.Field):
    """OpenAI's embeddings `input`: a string, a list of strings, a list of token ids, or a list of such lists;
    loads as a list of items, each a string or a list of token ids. At most MAX_EMBEDDING_INPUTS items, none
    empty; the model's room per item is checked once it is tokenized (on the worker)."""

    def __init__(self, **kwargs):
        metadata = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                              {"type": "array", "items": {"type": "integer"}},
                              {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}],
                    "description": "What to embed: a string, a list of strings, a list of token ids or a list of "
                                   f"such lists, at most {MAX_EMBEDDING_INPUTS} items, none empty; each item within "
                                   "the model's tokens per input (`context_length` in GET /v1/models). Token ids "
                                   "are the model's own, without its special tokens (mlxq adds them as it does "
                                   "for text)"}
        super().__init__(metadata=metadata, **kwargs)

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_token(v) for v in value)):
            items = [value]
        elif isinstance(value, list):
            items = value
        else:
            raise ValidationError("must be a string, a list of strings, a list of token ids or a list of such lists")
        if not items:
            raise ValidationError("must not be empty")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValidationError(f"at most {MAX_EMBEDDING_INPUTS} items (got {len(items)}); send the rest in "
                                  "another request")
        for i, item in enumerate(items):
            where = "" if len(items) == 1 and items[0] is value else f"item {i} "
            if isinstance(item, str):
                if not item:
                    raise ValidationError(f"{where}must not be an empty string")
            elif not isinstance(item, list) or not all(_is_token(t) for t in item):
                raise ValidationError(f"{where}must be a string or a list of token ids (non-negative integers)")
            elif not item:
                raise ValidationError(f"{where}must not be an empty list of token ids")
        return items


def _is_token(value) -> bool:
    """A token id as JSON carries it: a non-negative integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP_K


class EmbeddingRequestSchema(Schema):
    """POST /v1/embeddings body (OpenAI's)."""

    class Meta:
        unknown = EXCLUDE  # harmless unknown fields are ignored, as OpenAI-style clients expect

    model = fields.String(load_default=None, validate=validate.Length(min=1, max=512),
                          metadata={"description": "An embedding model (GET /v1/models, kind `embedding`); left out: "
                                    "minilm-l6, the demo model"})
    input = EmbeddingInput(required=True)
    encoding_format = fields.String(load_default="float", validate=validate.OneOf(("float", "base64")),
                                    metadata={"description": "`float`: lists of numbers; `base64`: each vector's "
                                              "little-endian float32 bytes in base64 (what the openai client asks "
                                              "for, and decodes)"})
    dimensions = fields.Integer(strict=True, load_default=None, allow_none=True, validate=validate.Range(min=1),
                                metadata={"description": "The vectors' length: only the model's own is accepted "
                                          "(GET /v1/models, `dimensions`); cutting vectors shorter needs a model "
                                          "trained for it"})
    user = fields.String(load_default=None, allow_none=True, validate=validate.Length(max=512),
                         metadata={"description": "OpenAI's end-user id: accepted, not used"})
    keep_alive = keep_alive_field()


class ModelSchema(Schema):
    """One entry of GET /v1/models (OpenAI's shape plus mlxq's extra facts)."""

    id = fields.String()
    object = fields.String(dump_default="model")
    created = fields.Integer()
    owned_by = fields.String()
    kind = fields.String()
    capabilities = fields.List(fields.String(), metadata={"description": "What the model takes besides text: "
                                                         "'vision' (image_url parts), 'audio' (input_audio heard "
                                                         "by the model itself)"})
    context_length = fields.Integer(allow_none=True)
    size_bytes = fields.Integer()
    quantization = fields.String(allow_none=True)
    source = fields.String()
    sampling_defaults = fields.Dict(metadata={"description": "What a request that leaves a sampling field out "
                                              "gets: the model's generation_config.json value, else mlxq's"})
    adapters = fields.List(fields.String(), metadata={"description": "The LoRA adapters made for this model, by "
                                                     "name: what a request's `adapter` may name"})
    dimensions = fields.Integer(allow_none=True, metadata={"description": "An embedding model's vector length"})


class ModelListSchema(Schema):
    """GET /v1/models."""

    object = fields.String(dump_default="list")
    data = fields.List(fields.Nested(ModelSchema))


def load_chat(chat: dict, names: dict[str, str] | None = None) -> dict:
    """A chat completion body built by another API (Responses, Messages), validated like a client's;
    a 400 names the field by `names` (the other API's name for a chat field), else by its chat name."""
    try:
        return ChatCompletionRequestSchema().load({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        field = next(iter(exc.messages))
        name = (names or {}).get(field, field)
        raise APIError(400, f"Invalid value for '{name}': {exc.messages[field]}", "invalid_value", name) from None

