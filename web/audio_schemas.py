"""Request and response schemas of the transcription and translation endpoints and the async jobs API."""

from __future__ import annotations

from marshmallow import (
    EXCLUDE,
    Schema,
    ValidationError,
    fields,
    post_load,
    validate,
    validates,
    validates_schema,
)
from werkzeug.datastructures import FileStorage

from jobs.contract import DEFAULT_SPEECH_MODEL, DEFAULT_TRANSLATION_MODEL, SPEECH_TASKS
from jobs.formats import FORMATS, GRANULARITIES
from jobs.records import STATUSES
from jobs.webhooks import UnsafeDestination, check_destination
from web.jsonbody import JSONRejected, loads
from web.schemas import ChatCompletionRequestSchema, EmbeddingRequestSchema, KeepAlive
from web.services import services

MAX_METADATA_KEYS = 16

INCLUDES = ("logprobs",)
"""The `include[]` values speech to text accepts."""

PLAIN_FORMATS = ("text", "srt", "vtt")
"""Response formats with no room for token log-probabilities."""


class Metadata(fields.Field):
    """A flat JSON object of at most 16 keys (a JSON string in multipart forms, an object in JSON)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if isinstance(value, str):  # a multipart form field: parsed as strictly as a JSON body
            try:
                value = loads(value) if value.strip() else {}
            except JSONRejected as exc:
                raise ValidationError(str(exc)) from None
            except ValueError:
                raise ValidationError("must be a JSON object") from None
        if not isinstance(value, dict):
            raise ValidationError("must be a JSON object")
        if len(value) > MAX_METADATA_KEYS:
            raise ValidationError(f"at most {MAX_METADATA_KEYS} keys")
        for key, item in value.items():
            if len(key) > 64:
                raise ValidationError("keys must be at most 64 characters")
            if isinstance(item, (dict, list)):
                raise ValidationError(f"must be flat: the value of {key!r} is an object or array")
            if isinstance(item, str) and len(item) > 512:
                raise ValidationError(f"the value of {key!r} is longer than 512 characters")
        return value


class FilePart(fields.Field):
    """A multipart file part (a text field of the same name is refused)."""

    def _deserialize(self, value, attr, data, **kwargs):
        if not isinstance(value, FileStorage):
            raise ValidationError("must be a file part of the multipart form (filename included)")
        return value


MAX_KNOWN_SPEAKERS = 4
"""Most known speakers one request names (OpenAI's limit)."""

MAX_SPEAKERS = 32
"""The largest min_speakers / max_speakers."""

MAX_REFERENCE_CHARS = 4 * 1024 * 1024
"""Longest known_speaker_references[] data URL (3 MiB of audio: 30 s of 16-bit WAV at 48 kHz)."""


class SpeakerName(fields.String):
    """A known speaker's name: 1-64 printable characters, nothing that could end a subtitle's voice tag."""

    def _deserialize(self, value, attr, data, **kwargs):
        name = super()._deserialize(value, attr, data, **kwargs).strip()
        if not 1 <= len(name) <= 64 or not name.isprintable() or any(c in name for c in "<>&"):
            raise ValidationError("must be 1-64 printable characters, none of < > &")
        return name


class TranscriptionFormSchema(Schema):
    """POST /v1/audio/transcriptions multipart form (OpenAI's names): the file and its options."""

    class Meta:
        unknown = EXCLUDE  # OpenAI fields we do not use (server_vad's tuning...) are ignored

    file = FilePart(required=True, metadata={"type": "string", "format": "binary",
                                             "description": "The audio file (wav, mp3, ogg, flac, m4a, ...)"})
    model = fields.String(load_default=DEFAULT_SPEECH_MODEL, validate=validate.Length(min=1, max=512))
    # Optional fields have no load_default: a `default: null` in the OpenAPI document made Swagger UI's
    # try-it send the text "null". _normalise gives an absent field its value (None).
    language = fields.String(validate=validate.Regexp(
        r"^([A-Za-z]{2,3}([-_][A-Za-z0-9]{2,8})?)?$", error="must be an ISO-639-1 code such as 'en'"))
    prompt = fields.String(validate=validate.Length(max=4096))
    temperature = fields.Float(load_default=0.0, validate=validate.Range(min=0, max=1))
    response_format = fields.String(load_default="json", validate=validate.OneOf(FORMATS))
    timestamp_granularities = fields.List(fields.String(validate=validate.OneOf(GRANULARITIES)),
                                          data_key="timestamp_granularities[]", load_default=list)
    granularities_plain = fields.List(fields.String(validate=validate.OneOf(GRANULARITIES)),
                                      data_key="timestamp_granularities", load_default=list)
    stream = fields.Boolean(load_default=False)
    chunking_strategy = fields.String(validate=validate.OneOf(["auto"]), metadata={
        "description": "'auto': decode the speech pieces several at once (batched); left out, window after window, "
                       "each prompted with the text before it. Either way silence is skipped (Silero VAD)"})
    chunking_type = fields.String(data_key="chunking_strategy[type]",
                                  validate=validate.OneOf(["server_vad"]))
    include = fields.List(fields.String(validate=validate.OneOf(INCLUDES)), data_key="include[]",
                          load_default=list, metadata={
                              "description": "'logprobs': each text token's log-probability, in the `json` and "
                                             "`verbose_json` bodies and the stream's events"})
    include_plain = fields.List(fields.String(validate=validate.OneOf(INCLUDES)), data_key="include",
                                load_default=list)
    diarize = fields.Boolean(load_default=False, metadata={
        "description": "Label each segment and word with its speaker (`speaker`: A, B, ... or a known speaker's "
                       "name) in verbose_json, diarized_json, srt and vtt; response_format=diarized_json implies it"})
    known_speaker_names = fields.List(SpeakerName(), data_key="known_speaker_names[]", load_default=list,
                                      metadata={"description": f"Up to {MAX_KNOWN_SPEAKERS} names, each with a "
                                                               "reference clip in known_speaker_references[]"})
    names_plain = fields.List(SpeakerName(), data_key="known_speaker_names", load_default=list)
    known_speaker_references = fields.List(
        fields.String(validate=validate.Length(max=MAX_REFERENCE_CHARS)), data_key="known_speaker_references[]",
        load_default=list, metadata={"description": "Each known speaker's voice, 1-30 s of audio as a data URL "
                                                    "(data:audio/wav;base64,...), in the order of the names"})
    references_plain = fields.List(fields.String(validate=validate.Length(max=MAX_REFERENCE_CHARS)),
                                   data_key="known_speaker_references", load_default=list)
    min_speakers = fields.Integer(validate=validate.Range(min=1, max=MAX_SPEAKERS), metadata={
        "description": "At least this many speakers are told apart (a hint: the voices decide)"})
    max_speakers = fields.Integer(validate=validate.Range(min=1, max=MAX_SPEAKERS), metadata={
        "description": "At most this many speakers: past it, a segment goes to the nearest voice"})
    keep_alive = KeepAlive(metadata={"type": "string", "description": "How long the Whisper model stays loaded "
                                     "once idle: seconds or a duration such as \"5m\" (Ollama's field; negative: until "
                                     "evicted, 0: unload once idle). Left out: as the model's latest request said, "
                                     "else MLXQ_MODEL_TTL_S"})

    @post_load
    def _normalise(self, data, **kwargs):
        """Merge both spellings of timestamp_granularities; empty strings mean "not given"."""
        granularities = set(data.pop("timestamp_granularities")) | set(data.pop("granularities_plain"))
        data["timestamp_granularities"] = [g for g in GRANULARITIES if g in granularities] or ["segment"]
        data["language"] = data.get("language") or None  # translations have no `language`
        data["prompt"] = data.get("prompt") or None
        data["keep_alive"] = data.get("keep_alive")
        # OpenAI's {"type": "server_vad", ...} arrives as chunking_strategy[type]: the same detector.
        data["chunking_strategy"] = "auto" if data.pop("chunking_type", None) else data.get("chunking_strategy")
        data["logprobs"] = "logprobs" in _included(data)
        del data["include"], data["include_plain"]
        data["known_speaker_names"], data["known_speaker_references"], data["diarize"] = _speaker_fields(data)
        del data["names_plain"], data["references_plain"]
        data["min_speakers"], data["max_speakers"] = data.get("min_speakers"), data.get("max_speakers")
        return data

    @validates_schema
    def _speakers(self, data, **kwargs):
        """Speaker options need diarization, a reference per name, and a range that holds the known speakers."""
        names, references, diarize = _speaker_fields(data)
        asked = [key for key, value in (("known_speaker_names[]", names), ("known_speaker_references[]", references),
                                        ("min_speakers", data.get("min_speakers")),
                                        ("max_speakers", data.get("max_speakers"))) if value]
        if asked and not diarize:
            raise ValidationError("needs diarize=true (or response_format=diarized_json)", field_name=asked[0])
        if diarize and data.get("stream"):
            raise ValidationError("is not supported with stream=true: an async job's segment events carry each "
                                  "segment's speaker", field_name="diarize")
        if len(names) > MAX_KNOWN_SPEAKERS:
            raise ValidationError(f"at most {MAX_KNOWN_SPEAKERS} known speakers", field_name="known_speaker_names[]")
        if len(references) != len(names):
            raise ValidationError(f"{len(references)} reference clips for {len(names)} names: one each",
                                  field_name="known_speaker_references[]")
        if len(set(names)) != len(names):
            raise ValidationError("names must differ", field_name="known_speaker_names[]")
        least, most = data.get("min_speakers"), data.get("max_speakers")
        if most is not None and least is not None and most < least:
            raise ValidationError("must be at least min_speakers", field_name="max_speakers")
        if most is not None and most < len(names):
            raise ValidationError(f"must be at least the {len(names)} known speakers", field_name="max_speakers")

    @validates_schema
    def _logprobs_need_json(self, data, **kwargs):
        """Token log-probabilities have no place in text, srt or vtt (OpenAI: `json` only; here verbose_json too)."""
        if "logprobs" in _included(data) and data.get("response_format") in PLAIN_FORMATS and not data.get("stream"):
            raise ValidationError("'logprobs' needs response_format json or verbose_json (or stream)",
                                  field_name="include[]")


def _speaker_fields(data: dict) -> tuple[list, list, bool]:
    """The known speakers' names and references (both spellings of each), and whether the form diarizes
    (`diarize`, or response_format=diarized_json)."""
    names = data.get("known_speaker_names", []) + data.get("names_plain", [])
    references = data.get("known_speaker_references", []) + data.get("references_plain", [])
    return names, references, bool(data.get("diarize")) or data.get("response_format") == "diarized_json"


def _included(data: dict) -> set:
    """What `include[]` (or `include`) asks for."""
    return set(data.get("include", ())) | set(data.get("include_plain", ()))


class TranslationFormSchema(TranscriptionFormSchema):
    """POST /v1/audio/translations multipart form: the transcription's fields but `language` (OpenAI's
    translations have none: the spoken language is detected, the text is English)."""

    class Meta(TranscriptionFormSchema.Meta):
        exclude = ("language",)  # sent anyway, it is ignored like any field this API does not use

    model = fields.String(load_default=DEFAULT_TRANSLATION_MODEL, validate=validate.Length(min=1, max=512))


class JobOptionsSchema(Schema):
    """Fields every async job accepts: where to send a webhook, and the client's own metadata."""

    # No load_default (see TranscriptionFormSchema): _absent_is_none fills them in.
    webhook_url = fields.Url(allow_none=True, schemes={"http", "https"}, require_tld=False,
                             validate=validate.Length(max=2048))
    metadata = Metadata(allow_none=True)

    @post_load
    def _absent_is_none(self, data, **kwargs):
        """An option not given is None."""
        return {"webhook_url": None, "metadata": None, **data}

    @validates("webhook_url")
    def _public_destination(self, value, **kwargs):
        """Refuse URLs resolving to loopback / private / link-local / reserved addresses (SSRF)."""
        if value:
            try:
                check_destination(value, services().settings.webhook_allow_private)
            except UnsafeDestination as exc:
                raise ValidationError(str(exc)) from None

    @validates_schema
    def _no_stream(self, data, **kwargs):
        """An async job is followed through /v1/jobs/{id}/events, not streamed in the response."""
        if data.get("stream"):
            raise ValidationError("is not supported on async jobs: follow /v1/jobs/{id}/events instead",
                                  field_name="stream")


class JobTranscriptionFormSchema(TranscriptionFormSchema, JobOptionsSchema):
    """POST /v1/jobs/transcriptions form fields: the file, or the URL the worker fetches it from."""

    file = FilePart(metadata={"type": "string", "format": "binary",
                              "description": "The audio file (wav, mp3, ogg, flac, m4a, ...); or `file_url`"})
    file_url = fields.Url(schemes={"http", "https"}, require_tld=False, validate=validate.Length(max=2048),
                          metadata={"description": "An http(s) URL of the audio, fetched by the worker instead of an "
                                                   "upload (held to the upload's size and length limits; follow its "
                                                   "download in the job's progress events)"})

    task = fields.String(load_default="transcribe", validate=validate.OneOf(SPEECH_TASKS), metadata={
        "description": "'translate': English text from speech in any language (multilingual models only); "
                       "`language`, if given, names the spoken language"})

    @post_load
    def _no_url_is_none(self, data, **kwargs):
        """`file_url` not given is None."""
        return {"file_url": None, **data}

    @validates("file_url")
    def _fetchable(self, value, **kwargs):
        """Refuse URLs resolving to loopback / private / link-local / reserved addresses (SSRF); the worker
        checks again at every redirect."""
        try:
            check_destination(value, services().settings.audio_fetch_allow_private)
        except UnsafeDestination as exc:
            raise ValidationError(str(exc)) from None

    @validates_schema
    def _one_source(self, data, **kwargs):
        """A job transcribes one file: uploaded or named by URL."""
        if ("file" in data) == ("file_url" in data):
            raise ValidationError("give either a file part or `file_url`, not both" if "file" in data
                                  else "missing: a file part or `file_url`", field_name="file")


class JobChatRequestSchema(ChatCompletionRequestSchema, JobOptionsSchema):
    """POST /v1/jobs/chat/completions body: a chat completion request plus the job options."""


class JobEmbeddingRequestSchema(EmbeddingRequestSchema, JobOptionsSchema):
    """POST /v1/jobs/embeddings body: an embeddings request plus the job options."""


class JobListQuerySchema(Schema):
    """GET /v1/jobs query."""

    class Meta:
        unknown = EXCLUDE

    status = fields.String(load_default=None, validate=validate.OneOf(STATUSES))
    limit = fields.Integer(load_default=20, validate=validate.Range(min=1, max=100))
    cursor = fields.String(load_default=None, validate=validate.Length(max=256))


class ResultQuerySchema(Schema):
    """GET /v1/jobs/{id}/result query."""

    class Meta:
        unknown = EXCLUDE

    format = fields.String(load_default=None, validate=validate.OneOf((*FORMATS, "npy")), metadata={
        "description": "A transcription's format (default: the one it was submitted with); for an embeddings "
                       "job, `npy`: its vectors as one float32 NumPy array file (inputs × dimensions)"})


class EventsQuerySchema(Schema):
    """GET /v1/jobs/{id}/events query (the Last-Event-ID header wins when both are given)."""

    class Meta:
        unknown = EXCLUDE

    last_event_id = fields.Integer(strict=False, load_default=0, validate=validate.Range(min=0, max=10**15 - 1))


class LinksSchema(Schema):
    """Where to follow a job."""

    self = fields.String()
    events = fields.String()
    result = fields.String()


class JobAcceptedSchema(Schema):
    """The 202 answer to an async submission."""

    id = fields.String()
    object = fields.String(dump_default="job")
    status = fields.String()
    links = fields.Nested(LinksSchema)
    warning = fields.String(metadata={"description": "Present when no MLX worker is running: the job waits "
                                                     "in the queue until one starts"})


class JobSchema(Schema):
    """One job record, as GET /v1/jobs/{id} answers it."""

    class Meta:
        unknown = EXCLUDE

    id = fields.String()
    object = fields.String(dump_default="job")
    kind = fields.String()
    status = fields.String()
    model = fields.String(allow_none=True)
    filename = fields.String(allow_none=True)
    created_at = fields.Raw(allow_none=True)
    started_at = fields.Raw(allow_none=True)
    finished_at = fields.Raw(allow_none=True)
    progress = fields.Dict(allow_none=True)
    error = fields.Raw(allow_none=True)
    metadata = fields.Dict(allow_none=True)
    webhook_url = fields.String(allow_none=True)
    attempts = fields.Integer(allow_none=True)
    queue_position = fields.Integer(allow_none=True)
    links = fields.Nested(LinksSchema)
    result = fields.Raw(allow_none=True)


class JobListSchema(Schema):
    """GET /v1/jobs."""

    object = fields.String(dump_default="list")
    data = fields.List(fields.Nested(JobSchema))
    has_more = fields.Boolean()
    next_cursor = fields.String(allow_none=True)
