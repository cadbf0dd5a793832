"""OpenAI-compatible speech to text: POST /v1/audio/transcriptions (a sync job on `interactive`)."""

from __future__ import annotations

import functools

from flask import Response, g, jsonify

from jobs import queues
from jobs.events import DONE, SEGMENT
from jobs.formats import TEXT_MIMETYPE, render
from web.audio_check import check_audio
from web.audio_schemas import TranscriptionFormSchema
from web.errors import APIError
from web.jobrun import stream_response, submit, wait_for_result
from web.jsonbody import Blueprint
from web.openai_api import resolve_model, stream_error
from web.response_schemas import SSE, TEXT, ServerSentEventSchema, TranscriptionSchema
from web.services import services
from web.sse import sse_data
from web.uploads import Upload, accepts_upload, discard, keep, spool

blp = Blueprint("audio", __name__, url_prefix="/v1/audio", description="OpenAI-compatible speech to text")


def format_duration(seconds: float) -> str:
    """A short human duration for job descriptions: '42 s', '62 min', '2.5 h'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def prepare_transcription(form: dict, job_id: str, mode: str) -> tuple[dict, dict, Upload]:
    """Resolve the model, spool and check the audio; return (worker payload, enqueue options, upload)."""
    info = resolve_model(form["model"], "speech")
    upload = spool(form["file"], job_id)
    audio = check_audio(upload.path, upload.filename, services().settings.max_audio_s)
    payload = {
        "job_id": job_id, "model": info.id, "audio_path": str(upload.path), "filename": upload.filename,
        "language": form["language"], "prompt": form["prompt"], "temperature": form["temperature"],
        "word_timestamps": "word" in form["timestamp_granularities"], "mode": mode, "request_id": g.request_id,
    }
    options = {
        "description": f"transcribe {upload.filename} ({info.id}, {format_duration(audio.duration_s)})",
        "meta": {"kind": "transcription", "model": info.id, "filename": upload.filename,
                 "duration_s": round(audio.duration_s, 3), "bytes": upload.size, "request_id": g.request_id},
    }
    return payload, options, upload


def _submit_sync(job_id: str, payload: dict, options: dict) -> None:
    """Enqueue the transcription on `interactive` under the id its spool directory is named after."""
    submit(queues.TRANSCRIPTION, payload, "transcr", options["description"], job_id=job_id, meta=options["meta"])


def rendered(result: dict, fmt: str, granularities, text_mimetype: str | None = None) -> Response:
    """Render a verbose_json result in `fmt`: a JSON body, or plain text (text, srt, vtt)."""
    body, mimetype = render(result, fmt, tuple(granularities))
    if isinstance(body, dict):
        return jsonify(body)
    return Response(body, content_type=text_mimetype or mimetype)


@blp.route("/transcriptions", methods=["POST"])
@accepts_upload
@blp.arguments(TranscriptionFormSchema(), location="multipart")
@blp.response(200, TranscriptionSchema, description="`json` and `verbose_json`; `text`, `srt` and `vtt` "
              "come as text/plain; with `stream`, transcript.text.delta events then transcript.text.done")
@blp.alt_response(200, schema={"type": "string"}, content_type=TEXT, success=True)
@blp.alt_response(200, schema=ServerSentEventSchema, content_type=SSE, success=True)
def transcriptions(form):
    """Transcribe an audio file (JSON, text, srt, vtt or verbose_json; SSE text deltas when `stream`)."""
    job_id = queues.new_job_id("transcr")
    payload, options, upload = prepare_transcription(form, job_id, "sync")
    _submit_sync(job_id, payload, options)
    if form["stream"]:
        response = stream_response(job_id, _text_deltas(), stream_error(g.request_id), trailer=None)
        response.call_on_close(functools.partial(discard, upload.directory))
        return response
    result = _wait_then_discard(job_id, upload)
    # OpenAI answers text, srt and vtt as text/plain; its clients read them as plain strings.
    return rendered(result, form["response_format"], form["timestamp_granularities"], TEXT_MIMETYPE)


def _wait_then_discard(job_id: str, upload: Upload) -> dict:
    """Wait for the job's result; remove the upload once the job ended (kept on 504: it still runs)."""
    try:
        done = wait_for_result(job_id)
    except APIError as exc:
        if exc.code == "timeout":
            keep(upload)
        raise  # any other failure: accepts_upload removes the upload
    discard(upload.directory)
    return done["result"]


def _text_deltas():
    """Render worker events as OpenAI `transcript.text.delta` / `transcript.text.done` SSE messages."""
    state = {"started": False}

    def render_event(event: dict):
        data = event["data"]
        if event["type"] == SEGMENT:
            text = data["segment"]["text"]
            # Segments carry their own leading space; the first delta starts the text without one.
            text = text if state["started"] else text.lstrip()
            if text:
                state["started"] = True
                yield sse_data({"type": "transcript.text.delta", "delta": text})
        elif event["type"] == DONE:
            yield sse_data({"type": "transcript.text.done", "text": data["result"]["text"]})

    return render_event
