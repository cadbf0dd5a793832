"""From a validated body to one typed request (jobs.contract): the model resolved, bounds checked,
defaults applied, the upload spooled and probed. Every view submits what this builds.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from pathlib import Path
from urllib.parse import unquote, urlsplit

from flask import g

from jobs import queues
from jobs.adapters import NO_ADAPTER, AdapterNotFound, adapter_entry, fits
from jobs.contract import (
    DEFAULT_EMBEDDING_MODEL,
    DEFAULT_SPEECH_MODEL,
    AdapterRef,
    EmbeddingRequest,
    ModelRef,
    MultimodalRequest,
    Sampling,
    TextRequest,
    TranscriptionRequest,
)
from jobs.media import MediaInfo
from jobs.model_files import SAMPLING_DEFAULT_RANGES, is_multilingual
from jobs.store import ModelInfo, ModelNotFound, resolve
from web.audio_check import check_audio
from web.errors import APIError
from web.media_parts import check_text_size, media_parts, spool_parts
from web.services import services
from web.structured import answer_schema, grammar_for
from web.tools import ToolPlan, chat_choice, chat_tools, plan
from web.uploads import Upload, safe_filename, spool

log = logging.getLogger(__name__)

MAX_CHOICES = 64
"""The most choices (prompts times `n`) one completion request may ask for."""
THINK_MODEL = "smollm2-135m-think"
"""The demo model that reasons (workers/demo/think_model.py): named in errors."""


def resolve_model(ref: str | None, kind: str | tuple[str, ...]) -> ModelInfo:
    """Resolve a model reference to a catalog entry of `kind` (or one of several), or raise 404 / 400."""
    kinds = (kind,) if isinstance(kind, str) else kind
    try:
        info = resolve(ref, services().settings, allow_paths=False)
    except ModelNotFound as exc:
        log.info("%s", exc)  # the operator's log gets the places looked, with their paths
        raise APIError(404, exc.public_message, "model_not_found", "model") from None
    if info.kind not in kinds:
        raise APIError(400, f"Model '{info.id}' is a {info.kind} model; this endpoint needs a "
                            f"{' or '.join(kinds)} model.", "invalid_model", "model")
    return info


def model_ref(info: ModelInfo) -> ModelRef:
    """What the worker needs of a catalog entry."""
    return ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


def adapter_ref(name: str | None, info: ModelInfo) -> AdapterRef | None:
    """The request's `adapter` in the adapter store (None: left out or "none"); 400 naming the field when there is
    no such adapter, or it was made for another model."""
    if name is None or name == NO_ADAPTER:
        return None
    settings = services().settings
    entry = adapter_entry(settings, name)
    if entry is None:
        raise APIError(400, AdapterNotFound(name).public_message, "adapter_not_found", "adapter")
    if not fits(settings, entry, info):
        raise APIError(400, f"Adapter '{name}' was made for model '{entry.base}', not '{info.id}' (GET /v1/models "
                            "lists each model's adapters).", "invalid_adapter", "adapter")
    return AdapterRef(entry.name, str(entry.path), entry.base)


def sampling(body: dict, info: ModelInfo, grammar: str | None = None) -> Sampling:
    """The sampling of a chat or completion body, bounded by the settings and the model; `grammar`
    (tool calls') stands in for the response_format's."""
    limit = max_tokens_limit(info)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or limit
    if max_tokens > limit:
        param = "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"
        raise APIError(400, f"'{param}' must be at most {limit} for model '{info.id}'.", "invalid_value", param)
    if body["top_k"] and info.vocab_size and body["top_k"] > info.vocab_size:
        raise APIError(400, f"'top_k' must be at most {info.vocab_size}, the vocabulary size of model "
                            f"'{info.id}'.", "invalid_value", "top_k")
    bias = _logit_bias(body, info)
    own = grammar_for(body.get("response_format"))  # checked even where the tools' grammar stands in for it
    chosen = sampling_defaults(info)
    for name in chosen:  # what the request sets wins; left out (or null), the model's default, then mlxq's
        if body.get(name) is not None:
            chosen[name] = body[name]
    top_k = chosen["top_k"] or 0
    if top_k and info.vocab_size and top_k > info.vocab_size:  # a model's own default past its vocabulary
        top_k = 0
    return Sampling(
        max_tokens=max_tokens,
        temperature=chosen["temperature"],
        top_p=chosen["top_p"],
        top_k=top_k,
        min_p=chosen["min_p"] or 0.0,
        seed=body["seed"],
        stop=tuple(s for s in body["stop"] or () if s),
        repetition_penalty=chosen["repetition_penalty"],
        presence_penalty=body["presence_penalty"] or 0.0,
        frequency_penalty=body["frequency_penalty"] or 0.0,
        logit_bias=bias,
        grammar=grammar or own,
        logprobs=_logprobs(body),
    )


def max_tokens_limit(info: ModelInfo) -> int:
    """The most tokens a request may ask of this model (MLXQ_MAX_TOKENS_LIMIT, and its context length), and what
    one that leaves max_tokens out gets: its answer runs until it ends, or its prompt leaves no more room."""
    limit = services().settings.max_tokens_limit
    return min(limit, info.context_length) if info.context_length else limit


def sampling_defaults(info: ModelInfo) -> dict:
    """What a request that leaves a sampling field out gets: the model's generation_config.json value, else
    mlxq's (`jobs.contract.Sampling`), and max_tokens; shown by /v1/models."""
    base = Sampling()
    return {**{name: getattr(base, name) for name in SAMPLING_DEFAULT_RANGES}, **dict(info.sampling_defaults),
            "max_tokens": max_tokens_limit(info)}


def _logit_bias(body: dict, info: ModelInfo) -> tuple[tuple[int, float], ...]:
    """The body's logit_bias as (token id, bias) pairs by id; 400 for an id outside the model's vocabulary."""
    bias = body["logit_bias"] or {}
    outside = [token for token in bias if info.vocab_size and token >= info.vocab_size]
    if outside:
        raise APIError(400, f"'logit_bias' names token {min(outside)}, but model '{info.id}' has "
                            f"{info.vocab_size} tokens (ids 0 to {info.vocab_size - 1}).", "invalid_value",
                       "logit_bias")
    return tuple(sorted(bias.items()))


def _logprobs(body: dict) -> int | None:
    """How many alternatives each token's logprobs entry lists; None when none are asked for. A chat
    asks with `logprobs: true` and `top_logprobs`, a completion with `logprobs: k`."""
    if "messages" in body:
        return (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return body.get("logprobs")


def chat_request(body: dict, job_id: str, is_async: bool = False) -> TextRequest | MultimodalRequest:
    """A chat request: developer messages become system ones (chat templates know those).

    A chat with images or audio, or on a vision model, is a MultimodalRequest: its media are checked
    against the model first (nothing is fetched for a model that cannot use it), then spooled. Tools
    come as chat's `tools`/`tool_choice`, or already checked from another API (`tool_list`/`tool_mode`).
    """
    check_text_size(body["messages"], services().settings)
    info = resolve_model(body["model"], ("text", "vision"))
    messages = [_message(m, i) for i, m in enumerate(body["messages"])]
    tools = tool_plan(body, info)
    kinds = _check_media(messages, info)
    think = thinking(body, info)
    adapter = adapter_ref(body.get("adapter"), info)
    common = {"sampling": sampling(body, info, tools.grammar), "n": body["n"] or 1, "is_async": is_async,
              "request_id": g.request_id, "keep_alive": body.get("keep_alive")}
    if not kinds and info.kind == "text":
        return TextRequest(job_id, model_ref(info), messages=messages, tools=tools.tools, adapter=adapter, **think,
                           **common)
    if adapter is not None:
        raise APIError(400, "'adapter' is not served for chats with images or audio, or on a vision model, yet.",
                       "invalid_value", "adapter")
    if think["template_kwargs"] or think["enable_thinking"] or think["thinking_budget"] is not None:
        asked = next(name for name in THINKING_FIELDS if body.get(name) not in (None, False, "none"))
        raise APIError(400, f"'{asked}' is not served for chats with images or audio, or on a vision model, yet.",
                       "invalid_value", asked)
    speech = None
    if "input_audio" in kinds and "audio" not in info.capabilities:
        speech = model_ref(_speech_model_for_chat())
    parts = spool_parts(messages, job_id, services().settings)
    messages, images, audio = _with_media_refs(messages, parts)
    return MultimodalRequest(job_id, model_ref(info), messages, images=images, audio=audio, speech_model=speech,
                             tools=tools.tools, **common)


EFFORT_BUDGETS = {"minimal": 128, "low": 1024, "medium": 4096, "high": None}
"""The thinking budget (tokens) each reasoning_effort sets when the request gives none; "none" turns thinking off.
A template that only knows `enable_thinking` gets it on, with this budget kept by the worker."""
THINKING_FIELDS = ("enable_thinking", "reasoning_effort", "thinking_budget", "chat_template_kwargs")
"""The chat fields that control a model's thinking or its template."""


def thinking(body: dict, info: ModelInfo) -> dict:
    """The request's thinking control (TextRequest's template_kwargs, enable_thinking, thinking_budget) from
    `enable_thinking`, `chat_template_kwargs`, `reasoning_effort` and `thinking_budget` (another API's
    `reasoning` or `thinking` arrive converted to these); 400 for asking a model that does not reason to."""
    template = body.get("chat_template_kwargs") or None
    enabled = body.get("enable_thinking")
    effort, budget = body.get("reasoning_effort"), body.get("thinking_budget")
    param = "enable_thinking"
    if enabled is None and template and "enable_thinking" in template:
        enabled, param = template["enable_thinking"], "chat_template_kwargs.enable_thinking"
    if effort is not None:
        if enabled is not None and enabled != (effort != "none"):
            raise APIError(400, f"'reasoning_effort' {effort!r} contradicts '{param}' {str(enabled).lower()}.",
                           "invalid_value", "reasoning_effort")
        enabled, param = effort != "none", "reasoning_effort"
        if budget is None and enabled:
            budget = EFFORT_BUDGETS[effort]
    if "reasoning" not in info.capabilities:
        asks = [name for name, value in ((param, enabled), ("reasoning_effort", effort), ("thinking_budget", budget))
                if value not in (None, False, "none")]
        if asks:
            raise APIError(400, f"Model '{info.id}' does not reason: its chat template has no think markers (GET "
                                f"/v1/models lists each model's capabilities; the demo model '{THINK_MODEL}' "
                                "reasons).", "reasoning_not_supported", asks[0])
    return {"template_kwargs": template, "enable_thinking": enabled,
            "thinking_budget": budget if enabled is not False else None}


def tool_plan(body: dict, info: ModelInfo) -> ToolPlan:
    """The request's tools, checked against the model (web/tools.py)."""
    if "tool_list" in body:  # converted by the Responses or Messages API, which named its own fields
        tools, choice = body["tool_list"], body["tool_mode"]
    else:
        tools, choice = chat_tools(body.get("tools")), chat_choice(body.get("tool_choice"))
    parallel = body.get("parallel_tool_calls") is not False
    return plan(tools, choice, parallel, info, answer_schema(body.get("response_format")))


def _message(message: dict, index: int) -> dict:
    """One message as chat templates take it: developer as system; tool calls' arguments as objects."""
    converted = {"role": "system" if message["role"] == "developer" else message["role"],
                 "content": message["content"]}
    if message.get("tool_calls"):
        converted["tool_calls"] = [_template_call(call, index, j) for j, call in enumerate(message["tool_calls"])]
        converted["content"] = converted["content"] or ""
    if message.get("tool_call_id"):
        converted["tool_call_id"] = message["tool_call_id"]
    if message.get("name") and message["role"] == "tool":
        converted["name"] = message["name"]
    return converted


def _template_call(call: dict, index: int, j: int) -> dict:
    """An earlier tool call as templates render it: {"id", "type", "function": {"name", "arguments": {}}}."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise APIError(400, "A tool call's arguments must be a JSON object encoded as a string.", "invalid_value",
                       f"messages[{index}].tool_calls[{j}].function.arguments")
    return {"id": call.get("id") or f"call_{index}_{j}", "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def chat_func(request) -> str:
    """The RQ function name a chat request is queued under: it tells the worker whether it can batch (a chat on a
    vision model without audio may: the worker decides once it has the model)."""
    if request.kind != "multimodal":
        return queues.CHAT_COMPLETION
    return queues.VISION_CHAT if request.model.kind == "vision" and not request.audio else queues.MULTIMODAL_CHAT


def _check_media(messages: list[dict], info: ModelInfo) -> set[str]:
    """The kinds of media parts in the chat; 400 for an image sent to a model that cannot see."""
    kinds = set()
    for m, p, part in media_parts(messages):
        if part["type"] == "image_url" and "vision" not in info.capabilities:
            raise APIError(400, f"Model '{info.id}' cannot see images: it is a text model. Send images to a "
                                "vision model (GET /v1/models lists each model's capabilities).",
                           "image_not_supported", f"messages[{m}].content[{p}]")
        kinds.add(part["type"])
    return kinds


def _speech_model_for_chat() -> ModelInfo:
    """The speech model that transcribes audio parts for models that cannot hear."""
    try:
        return resolve_model(DEFAULT_SPEECH_MODEL, "speech")
    except APIError:
        raise APIError(400, f"Audio parts need a speech model to transcribe them for this model, and the "
                            f"default one ('{DEFAULT_SPEECH_MODEL}') is not installed.", "model_not_found",
                       "messages") from None


def _with_media_refs(messages: list[dict], parts) -> tuple[list[dict], list[str], list[str]]:
    """The messages with each media part replaced by a reference to its spooled file, and the files."""
    images, audio, refs = [], [], {}
    for part in parts:
        files, kind = (images, "image") if part.kind == "image" else (audio, "input_audio")
        refs[(part.message_index, part.part_index)] = {"type": kind, kind.removeprefix("input_"): len(files)}
        files.append(str(part.path))
    converted = []
    for m, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, list):
            content = [refs.get((m, p), part) for p, part in enumerate(content)]
        converted.append({**message, "content": content})
    return converted, images, audio


def completion_request(body: dict, job_id: str) -> TextRequest:
    """A completion request: one choice per prompt."""
    info = resolve_model(body["model"], "text")
    prompts, n = list(body["prompt"]), body["n"] or 1
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts with n={n} ask for {len(prompts) * n} choices; at most "
                            f"{MAX_CHOICES} per request.", "invalid_value", "n")
    return TextRequest(job_id, model_ref(info), sampling(body, info), prompts=prompts, n=n, request_id=g.request_id,
                       adapter=adapter_ref(body.get("adapter"), info), keep_alive=body.get("keep_alive"))


def embedding_request(body: dict, job_id: str, is_async: bool = False) -> EmbeddingRequest:
    """An embedding request: the model resolved (an embedding model), token ids within its vocabulary, and
    `dimensions`, if given, its own."""
    info = resolve_model(body["model"] or DEFAULT_EMBEDDING_MODEL, "embedding")
    if body["dimensions"] is not None and body["dimensions"] != info.dimensions:
        raise APIError(400, f"Model '{info.id}' makes {info.dimensions}-dimensional vectors and was not trained to "
                            "have them cut shorter; leave 'dimensions' out (or send its own length).",
                       "invalid_value", "dimensions")
    items = body["input"]
    for i, item in enumerate(items):
        if not isinstance(item, str) and info.vocab_size and max(item) >= info.vocab_size:
            param = "input" if len(items) == 1 else f"input[{i}]"
            raise APIError(400, f"'{param}' holds the token id {max(item)}, outside the vocabulary of model "
                                f"'{info.id}' (0 to {info.vocab_size - 1}).", "invalid_value", param)
    return EmbeddingRequest(job_id, model_ref(info), items, is_async=is_async, request_id=g.request_id,
                            keep_alive=body.get("keep_alive"))


def transcription_request(form: dict, job_id: str, is_async: bool, task: str = "transcribe"
                          ) -> tuple[TranscriptionRequest, Upload, MediaInfo]:
    """Resolve the model, spool the upload and probe it; the request, the upload and what it holds."""
    info = _speech_model(form, task)
    upload = spool(form["file"], job_id)
    audio = check_audio(upload.path, upload.filename, services().settings.max_audio_s)
    return _transcription(form, job_id, info, str(upload.path), upload.filename, is_async, task), upload, audio


def url_transcription_request(form: dict, job_id: str, task: str) -> TranscriptionRequest:
    """An async transcription of `form["file_url"]`: the worker fetches it into the job's spool directory."""
    info = _speech_model(form, task)
    name = unquote(urlsplit(form["file_url"]).path.rsplit("/", 1)[-1])
    path = services().settings.spool_dir / job_id / safe_filename(name or "audio")
    return _transcription(form, job_id, info, str(path), (name or "audio")[:255], True, task,
                          file_url=form["file_url"])


def _speech_model(form: dict, task: str) -> ModelInfo:
    """The Whisper model a transcription (or translation) form names."""
    info = resolve_model(form["model"], "speech")
    if task == "translate" and is_multilingual(info.vocab_size) is False:  # None: the worker finds out
        raise APIError(400, f"Model '{info.id}' is English-only: it cannot translate. Use a multilingual "
                            "Whisper model (such as 'whisper-base').", "translation_not_supported", "model")
    return info


def _transcription(form: dict, job_id: str, info: ModelInfo, path: str, filename: str, is_async: bool, task: str,
                   file_url: str | None = None) -> TranscriptionRequest:
    references = speaker_references(form["known_speaker_references"], Path(path).parent)
    return TranscriptionRequest(
        job_id, model_ref(info), path, filename, file_url=file_url, language=form.get("language"),
        prompt=form["prompt"], temperature=form["temperature"],
        word_timestamps="word" in form["timestamp_granularities"], chunking=form["chunking_strategy"],
        task=task, logprobs=form["logprobs"], diarize=form["diarize"], min_speakers=form["min_speakers"],
        max_speakers=form["max_speakers"], speaker_names=form["known_speaker_names"],
        speaker_references=references, is_async=is_async, request_id=g.request_id,
        keep_alive=form.get("keep_alive"),
    )


REFERENCE_S = (1.0, 30.0)
"""Shortest and longest known speaker reference clip, in seconds."""


def speaker_references(urls: list[str], directory: Path) -> list[str]:
    """Decode each known_speaker_references[] data URL into the job's spool directory, probe it; their paths."""
    paths = []
    for n, url in enumerate(urls):
        param = f"known_speaker_references[].{n}"  # (as the envelope names a list item)
        header, comma, payload = url.partition(",")
        media = header.removeprefix("data:").split(";")
        if not url.startswith("data:") or not comma or not media[0].lower().startswith("audio/") \
                or media[-1].lower() != "base64":
            raise APIError(400, "A reference clip must be a data URL: data:audio/<type>;base64,<data>.",
                           "invalid_value", param)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise APIError(400, "The reference clip's base64 data is malformed.", "invalid_value", param) from None
        if not directory.exists():  # a file_url job's directory: made here, removed if the request fails
            directory.mkdir(parents=True)
            g.mlxq_spooled.append(directory)
        path = directory / f"speaker-{n}.{safe_filename(media[0].split('/', 1)[1])[:8] or 'audio'}"
        path.write_bytes(data)
        try:
            audio = check_audio(path, param, REFERENCE_S[1])
        except APIError as exc:
            raise APIError(exc.status, exc.message, exc.code, param, **exc.extra) from None
        if audio.duration_s < REFERENCE_S[0]:
            raise APIError(400, f"The reference clip is {audio.duration_s:.1f} s long: at least {REFERENCE_S[0]:g} s "
                                "of the speaker's voice is needed.", "invalid_audio", param)
        paths.append(str(path))
    return paths


def describe_audio(request: TranscriptionRequest, audio: MediaInfo | None) -> str:
    """A job description for rq-dashboard: 'transcribe meeting.mp3 (whisper-tiny.en, 62 min)' ('by URL' when
    the worker fetches it)."""
    if audio is None:
        return f"{request.task} {request.filename} ({request.model.id}, by URL)"
    seconds = audio.duration_s
    length = (f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 7200
              else f"{seconds / 3600:.1f} h")
    return f"{request.task} {request.filename} ({request.model.id}, {length})"
