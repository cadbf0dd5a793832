"""The typed requests web and worker exchange, and the results and events a job produces.

The web tier builds one request from a validated body (model resolved, defaults applied, upload
spooled) and enqueues its `to_payload()` as the RQ job's only argument; the worker `parse`s it once.
Defaults live here and nowhere else.

Events of a job (jobs.events numbers them), by type, with their data:
  reasoning {"index", "text"}                      reasoning (thinking) generated for choice `index`, before its answer
  delta     {"index", "text", "tool_calls"?}      text generated for choice `index`; calls it completed
  segment   {"segment", "words"?}                 a finished transcript segment (verbose_json's shape)
  progress  {"done_s", "total_s", "percent", "eta_s"}
  done      TextResult.as_dict(), EmbeddingResult.as_dict()  or  {"result": <verbose_json transcription>}
  error     jobs.errors.error_data(...): {"message", "code", "status", ...}
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from jobs.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 512
"""max_tokens of a request built without one (the web tier always sets it: a client that sends none gets the
model's room, web.intake.max_tokens_limit)."""

DEFAULT_SPEECH_MODEL = "whisper-tiny.en"
"""The model of a transcription request that names none (OpenAI's clients always send one)."""

DEFAULT_EMBEDDING_MODEL = "minilm-l6"
"""The model of an embedding request that names none: the demo model pull-demo installs."""

DEFAULT_TRANSLATION_MODEL = "whisper-base"
"""The model of a translation request that names none: the demo model that knows languages besides English."""

SPEECH_TASKS = ("transcribe", "translate")
"""What a speech request asks: text in the spoken language, or English text (multilingual models only)."""


@dataclass(frozen=True)
class Sampling:
    """How to generate: the OpenAI sampling knobs, validated by the web tier."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token the answer already holds
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the answer so far
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), ids checked by the web
    grammar: str | None = None  # an llguidance grammar the answer must follow (response_format: web/structured.py)
    logprobs: int | None = None  # None: no logprobs; k >= 0: each token's, with its k likeliest alternatives


@dataclass(frozen=True)
class ModelRef:
    """The model a request runs on, as the web tier resolved it in the catalog (jobs.store)."""

    id: str
    path: str
    kind: str
    context_length: int | None = None
    vocab_size: int | None = None


@dataclass(frozen=True)
class AdapterRef:
    """The LoRA adapter a request decodes with, as the web tier found it in the adapter store (jobs.adapters)."""

    name: str
    path: str  # the store entry's directory (adapters.safetensors + adapter_config.json)
    base: str  # the store name of the model it was made for


@dataclass(frozen=True)
class TextRequest:
    """A chat (`messages`: one conversation, one choice) or a completion (`prompts`: one choice each)."""

    id: str
    model: ModelRef
    sampling: Sampling = Sampling()
    messages: list[dict] | None = None
    prompts: list[str] | None = None
    n: int = 1  # choices per input: choice i*n + k is the k-th for input i
    is_async: bool = False  # an async job (/v1/jobs) keeps a record; a synchronous call does not
    request_id: str | None = None
    tools: list[dict] | None = None  # function definitions the template renders; calls are parsed out of answers
    template_kwargs: dict | None = None  # extra chat template variables (chat_template_kwargs), JSON values
    enable_thinking: bool | None = None  # a reasoning model thinks first (None: as its template decides)
    thinking_budget: int | None = None  # the most reasoning tokens, markers included; then the block is closed
    adapter: AdapterRef | None = None  # decode with this LoRA adapter applied (None: the model alone)
    keep_alive: float | None = None  # seconds the model stays loaded once idle (negative: until evicted)
    kind: str = field(default="text", init=False)

    @property
    def inputs(self) -> list:
        """What each choice continues: the conversation, or each prompt."""
        return [self.messages] if self.messages is not None else list(self.prompts or [])


@dataclass(frozen=True)
class TranscriptionRequest:
    """Speech to text of a spooled upload, or of a `file_url` the worker fetches to `audio_path` first (OpenAI's
    transcription parameters)."""

    id: str
    model: ModelRef
    audio_path: str
    filename: str = ""
    file_url: str | None = None
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False
    chunking: str | None = None  # "auto": decode only the speech a voice activity detector finds
    task: str = "transcribe"  # one of SPEECH_TASKS: "translate" gives English text
    logprobs: bool = False  # include[]=logprobs: the text tokens' log-probabilities in the result
    diarize: bool = False  # label each segment and word with its speaker (workers/speakers.py)
    min_speakers: int | None = None
    max_speakers: int | None = None
    speaker_names: list[str] = field(default_factory=list)  # known speakers, in the order of their references
    speaker_references: list[str] = field(default_factory=list)  # spooled clips of their voices
    keep_alive: float | None = None  # seconds the model stays loaded once idle (negative: until evicted)
    is_async: bool = False
    request_id: str | None = None
    attempts: int = 1  # runs started so far, this one included (a crashed run is resumed, not restarted)
    resume: bool = False  # continue from the job's checkpoint
    kind: str = field(default="transcription", init=False)


@dataclass(frozen=True)
class MultimodalRequest:
    """A chat with images or audio in it, or any chat on a vision model: in the model's text batch when it can
    (no audio, a vision model whose language part mlx-lm decodes: workers/backends/vision_batch.py), else alone.

    Each message's content is a string or a list of parts: {"type": "text", "text"}, {"type": "image",
    "image": i} (the i-th path of `images`) and {"type": "input_audio", "audio": i} (of `audio`). With a
    `speech_model`, audio is transcribed by it first and reaches the model as text; without, the model
    hears it itself.
    """

    id: str
    model: ModelRef
    messages: list[dict]
    sampling: Sampling = Sampling()
    images: list[str] = field(default_factory=list)  # spooled image files, in the order they appear
    audio: list[str] = field(default_factory=list)  # spooled audio files, in the order they appear
    speech_model: ModelRef | None = None
    n: int = 1
    is_async: bool = False
    request_id: str | None = None
    keep_alive: float | None = None  # seconds the model stays loaded once idle (negative: until evicted)
    tools: list[dict] | None = None  # as the template renders them (a forced call's grammar is in `sampling`)
    kind: str = field(default="multimodal", init=False)

    @property
    def inputs(self) -> list:
        """What each choice continues: the one conversation."""
        return [self.messages]


MAX_EMBEDDING_INPUTS = 2048
"""The most inputs one embedding request may hold (OpenAI's limit)."""


@dataclass(frozen=True)
class EmbeddingRequest:
    """Inputs to turn into vectors, one each (OpenAI's /v1/embeddings): texts, or token ids of the model's
    vocabulary; padded and encoded together with other requests' inputs (workers/backends/embeddings.py)."""

    id: str
    model: ModelRef
    inputs: list  # each a string, or a list of token ids (the model's own, special tokens left out)
    is_async: bool = False
    request_id: str | None = None
    keep_alive: float | None = None  # seconds the model stays loaded once idle (negative: until evicted)
    kind: str = field(default="embedding", init=False)


@dataclass(frozen=True)
class EmbeddingResult:
    """The `done` event of an embedding request: each input's vector as base64 of little-endian float32 (what
    OpenAI's `encoding_format=base64` sends; the web decodes it for `float`), in the inputs' order."""

    model: str
    embeddings: list[str]
    dimensions: int
    prompt_tokens: int

    def as_dict(self) -> dict:
        """The JSON shape."""
        return asdict(self)


CONTROL_ACTIONS = ("load", "unload", "pin", "unpin", "mount", "unmount")
"""mount / unmount: an adapter (ControlRequest.adapter) on its base model (ControlRequest.model)."""


@dataclass(frozen=True)
class ControlRequest:
    """An operator's change to what a worker holds (the admin API): run between requests, never beside one."""

    id: str
    model: ModelRef
    action: str  # one of CONTROL_ACTIONS
    adapter: AdapterRef | None = None  # the adapter of a mount or unmount
    is_async: bool = False
    request_id: str | None = None
    kind: str = field(default="control", init=False)


Request = TextRequest | TranscriptionRequest | MultimodalRequest | EmbeddingRequest | ControlRequest
_KINDS = {"text": TextRequest, "transcription": TranscriptionRequest, "multimodal": MultimodalRequest,
          "embedding": EmbeddingRequest, "control": ControlRequest}


@dataclass(frozen=True)
class Choice:
    """One generated choice."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: list | None = None  # one entry per token (workers/backends/logprobs.py) when asked for
    tool_calls: list | None = None  # [{"id", "name", "arguments": a JSON string}] parsed out of the text
    stop_sequence: str | None = None  # the stop string that ended it (cut from the text), if one did
    reasoning: str | None = None  # what a reasoning model thought before its answer (markers cut), if it did
    reasoning_tokens: int = 0  # tokens of `text`'s generation spent reasoning (markers included)


@dataclass(frozen=True)
class TextResult:
    """The `done` event of a text request (and its async job's stored result)."""

    model: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    created: int
    cached_tokens: int = 0  # prompt tokens whose processing was reused from the prompt cache

    def as_dict(self) -> dict:
        """The JSON shape: OpenAI's `usage` block instead of the counts."""
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
                 "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in self.choices)}}
        return {"model": self.model, "choices": [asdict(c) for c in self.choices], "usage": usage,
                "created": self.created}


def to_payload(request: Request) -> dict:
    """The request as the RQ job's JSON argument."""
    return asdict(request)


def parse(payload: dict) -> Request:
    """The request an RQ job carries; InvalidRequest when the payload is not one."""
    try:
        cls = _KINDS[payload["kind"]]
        values = {f.name: payload[f.name] for f in fields(cls) if f.init and f.name in payload}
        values["model"] = ModelRef(**values["model"])
        if values.get("speech_model") is not None:
            values["speech_model"] = ModelRef(**values["speech_model"])
        if values.get("adapter") is not None:
            values["adapter"] = AdapterRef(**values["adapter"])
        if cls in (TextRequest, MultimodalRequest):
            sampling = dict(values.get("sampling") or {})
            sampling["stop"] = tuple(sampling.get("stop") or ())
            sampling["logit_bias"] = tuple((int(t), float(b)) for t, b in sampling.get("logit_bias") or ())
            values["sampling"] = Sampling(**sampling)
        return cls(**values)
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"the job's payload is not an mlxq request ({type(exc).__name__}: {exc})") from None
