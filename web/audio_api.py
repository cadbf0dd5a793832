"""OpenAI-compatible speech to text: POST /v1/audio/transcriptions and /v1/audio/translations (sync jobs on
`interactive`). A translation is a transcription with task "translate": the same limits, formats and stream."""

from __future__ import annotations

import functools

from flask import g

from jobs import queues
from jobs.formats import TEXT_MIMETYPES
from web import intake
from web.audio_schemas import TranscriptionFormSchema, TranslationFormSchema
from web.errors import APIError
from web.jobrun import stream_response, submit, wait_for_result
from web.jsonbody import Blueprint
from web.render.transcripts import Transcript
from web.response_schemas import SSE, ServerSentEventSchema, TranscriptionSchema
from web.uploads import Upload, accepts_upload, discard, keep

blp = Blueprint("audio", __name__, url_prefix="/v1/audio", description="OpenAI-compatible speech to text")


def _speech_responses(view):
    """The responses both endpoints document (the JSON body, each text format's type, the SSE stream)."""
    view = blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)(view)
    for mimetype in TEXT_MIMETYPES.values():
        view = blp.alt_response(200, schema={"type": "string"}, content_type=mimetype.split(";")[0],
                                success=True)(view)
    return blp.response(200, TranscriptionSchema, description="`json` and `verbose_json` as JSON; `text` as "
                        "text/plain, `srt` as application/x-subrip, `vtt` as text/vtt (UTF-8); with `stream`, "
                        "transcript.text.delta events then transcript.text.done")(view)


@blp.route("/transcriptions", methods=["POST"])
@accepts_upload
@blp.arguments(TranscriptionFormSchema(), location="multipart")
@_speech_responses
def transcriptions(form):
    """Transcribe an audio file (JSON, text, srt, vtt or verbose_json; SSE text deltas when `stream`)."""
    return _speech_to_text(form, "transcribe")


@blp.route("/translations", methods=["POST"])
@accepts_upload
@blp.arguments(TranslationFormSchema(), location="multipart")
@_speech_responses
def translations(form):
    """Translate speech in any language into English text (multilingual models; formats as transcriptions)."""
    return _speech_to_text(form, "translate")


def _speech_to_text(form: dict, task: str):
    """Run one sync speech job and answer in the form's format, or stream its text."""
    request, upload, audio = intake.transcription_request(form, queues.new_job_id("transcr"), is_async=False,
                                                          task=task)
    meta = {"kind": "transcription", "model": request.model.id, "filename": upload.filename,
            "duration_s": round(audio.duration_s, 3), "bytes": upload.size}
    submit(request, queues.TRANSCRIPTION, intake.describe_audio(request, audio), meta=meta)
    out = Transcript(form["response_format"], form["timestamp_granularities"], g.request_id)
    if form["stream"]:
        response = stream_response(request.id, out)
        response.call_on_close(functools.partial(discard, upload.directory))
        return response
    return out.answer(_wait_then_discard(request.id, upload))


def _wait_then_discard(job_id: str, upload: Upload) -> dict:
    """Wait for the job's `done` data; remove the upload once the job ended (kept on 504: it still runs)."""
    try:
        done = wait_for_result(job_id)
    except APIError as exc:
        if exc.code == "timeout":
            keep(upload)
        raise  # any other failure: accepts_upload removes the upload
    discard(upload.directory)
    return done
