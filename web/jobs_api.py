"""The async jobs API (/v1/jobs): submit long work to `batch`, then poll, follow, fetch or cancel it."""

from __future__ import annotations

import re
import time

from flask import Response, jsonify, request, url_for

from jobs import queues, records
from jobs.events import HEARTBEAT, has_ended, read_log
from jobs.formats import FORMATS
from jobs.lifecycle import cancel_queued, request_cancel, settle
from jobs.subscriber import IDLE, follow
from web import intake
from web.audio_schemas import (
    EventsQuerySchema,
    JobAcceptedSchema,
    JobChatRequestSchema,
    JobEmbeddingRequestSchema,
    JobListQuerySchema,
    JobListSchema,
    JobSchema,
    JobTranscriptionFormSchema,
    ResultQuerySchema,
)
from web.auth import caller
from web.errors import APIError
from web.jobrun import KEEPALIVE_S, submit_async
from web.jsonbody import Blueprint
from web.media_parts import accepts_media_parts
from web.render.embeddings import npy_file
from web.render.jobs import event_frame, result_body
from web.render.sse import event_stream, sse_comment
from web.render.transcripts import transcription
from web.response_schemas import SSE, TEXT, AnyObjectSchema, ServerSentEventSchema
from web.services import Services, services
from web.uploads import accepts_upload

blp = Blueprint("jobs", __name__, url_prefix="/v1/jobs", description="Async jobs: transcriptions, chat and embeddings")

CHAT_TIMEOUT_S = 3600
"""RQ timeout of an async chat job."""

RESULT_FORMATS = {"transcription": FORMATS, "embedding": ("json", "npy")}
"""What GET /v1/jobs/{id}/result?format= may ask of each kind of job (others: json only)."""


def _links(job_id: str) -> dict:
    """Where a client follows a job."""
    return {"self": url_for("jobs.get_job", job_id=job_id), "events": url_for("jobs.job_events", job_id=job_id),
            "result": url_for("jobs.job_result", job_id=job_id)}


def _accepted(job_id: str, warning: str | None):
    """The 202 answer to a submission, with a Location header (and a warning when no worker is live)."""
    body = {"id": job_id, "object": "job", "status": "queued", "links": _links(job_id)}
    if warning:
        body["warning"] = warning
    return body, 202, {"Location": body["links"]["self"]}


def _record_or_404(job_id: str) -> dict:
    """The job's record, brought up to date, or a 404 envelope."""
    svc = services()
    stored = records.load(svc.redis, job_id)
    record = records.get(svc.redis, job_id) if stored and caller().may_see(stored) else None
    if record is None:  # another key's job is as good as absent
        raise APIError(404, f"No job with id '{job_id}' (it may have expired).", "job_not_found", "id")
    if record["status"] not in records.TERMINAL and settle(svc.redis, svc.settings, job_id):
        record = records.get(svc.redis, job_id)  # it ended without its worker (a reader saw it die)
    return record


@blp.route("/transcriptions", methods=["POST"])
@accepts_upload
@blp.arguments(JobTranscriptionFormSchema(), location="multipart")
@blp.response(202, JobAcceptedSchema)
def create_transcription(form):
    """Submit an async transcription (or, with task=translate, translation) of an upload or of a `file_url`;
    follow it at /v1/jobs/{id}."""
    settings = services().settings
    job_id = queues.new_job_id("job")
    if form["file_url"]:  # the worker fetches it: its size and length are known only then
        request, audio = intake.url_transcription_request(form, job_id, task=form["task"]), None
        duration_s = size = None
        timeout_s = int(settings.audio_fetch_timeout_s + settings.max_audio_s * 3) + 600
    else:
        request, upload, audio = intake.transcription_request(form, job_id, is_async=True, task=form["task"])
        duration_s, size = round(audio.duration_s, 3), upload.size
        timeout_s = max(3600, int(duration_s * 3) + 600)
    params = {"response_format": form["response_format"], "duration_s": duration_s,
              "timestamp_granularities": form["timestamp_granularities"], "diarize": form["diarize"]}
    # (the defaults of /result, and whether it may be diarized_json)
    fields = {"model": request.model.id, "filename": request.filename, "metadata": form["metadata"] or {},
              "webhook_url": form["webhook_url"], "params": params}
    meta = {"kind": "transcription", "model": request.model.id, "filename": request.filename,
            "duration_s": duration_s, "bytes": size}
    warning = submit_async(request, "transcription", fields, queues.TRANSCRIPTION,
                           intake.describe_audio(request, audio), timeout_s=timeout_s, meta=meta)
    return _accepted(request.id, warning)


@blp.route("/chat/completions", methods=["POST"])
@accepts_media_parts
@blp.arguments(JobChatRequestSchema())
@blp.response(202, JobAcceptedSchema)
def create_chat(body):
    """Submit an async chat completion; its result is a chat.completion object."""
    request = intake.chat_request(body, queues.new_job_id("job"), is_async=True)
    fields = {"model": request.model.id, "metadata": body["metadata"] or {}, "webhook_url": body["webhook_url"]}
    warning = submit_async(request, "chat", fields, intake.chat_func(request), f"chat {request.model.id} (async)",
                           timeout_s=CHAT_TIMEOUT_S, meta={"kind": "chat", "model": request.model.id})
    return _accepted(request.id, warning)


@blp.route("/embeddings", methods=["POST"])
@blp.arguments(JobEmbeddingRequestSchema())
@blp.response(202, JobAcceptedSchema)
def create_embeddings(body):
    """Submit an async embeddings request; its result is an embedding list (or, from /result?format=npy, a .npy
    file of its vectors)."""
    request = intake.embedding_request(body, queues.new_job_id("job"), is_async=True)
    fields = {"model": request.model.id, "metadata": body["metadata"] or {}, "webhook_url": body["webhook_url"],
              "params": {"encoding_format": body["encoding_format"]}}
    warning = submit_async(request, "embedding", fields, queues.EMBEDDING,
                           f"embed {len(request.inputs)} inputs ({request.model.id}, async)",
                           timeout_s=CHAT_TIMEOUT_S, meta={"kind": "embedding", "model": request.model.id})
    return _accepted(request.id, warning)


@blp.route("", methods=["GET"])
@blp.arguments(JobListQuerySchema(), location="query")
@blp.response(200, JobListSchema)
def list_jobs(query):
    """List jobs, newest first; pass `next_cursor` back as `cursor` for the next page."""
    svc = services()
    try:
        who = caller()
        items, next_cursor = records.list_jobs(svc.redis, query["status"], query["limit"], query["cursor"],
                                               owner=None if who.admin else who.owner)
    except ValueError:
        raise APIError(400, "Invalid value for 'cursor': pass back a next_cursor from this listing.",
                       "invalid_value", "cursor") from None
    data = [{**item, "links": _links(item["id"])} for item in items]
    return {"object": "list", "data": data, "has_more": next_cursor is not None, "next_cursor": next_cursor}


@blp.route("/<job_id>", methods=["GET"])
@blp.response(200, JobSchema)
def get_job(job_id: str):
    """A job's record: status, progress, its place in the queue while queued, its result when done."""
    svc = services()
    record = _record_or_404(job_id)
    extra = {"links": _links(job_id)}
    if record["status"] == "queued":
        extra["queue_position"] = records.queue_position(svc.redis, job_id)
    if record["status"] == "succeeded":
        params = (records.load(svc.redis, job_id) or {}).get("params")
        extra["result"] = result_body(record, records.get_result(svc.redis, job_id), params)
    return {**record, **extra}


@blp.route("/<job_id>/result", methods=["GET"])
@blp.arguments(ResultQuerySchema(), location="query")
@blp.response(200, AnyObjectSchema, description="A transcription (in the format asked for: text as text/plain, srt "
              "as application/x-subrip, vtt as text/vtt), a chat.completion object, or an embedding list (with "
              "format=npy, a .npy file of its vectors)")
@blp.alt_response(200, schema={"type": "string"}, content_type=TEXT, success=True)
@blp.alt_response(200, schema={"type": "string"}, content_type="application/x-subrip", success=True)
@blp.alt_response(200, schema={"type": "string"}, content_type="text/vtt", success=True)
@blp.alt_response(200, schema={"type": "string", "format": "binary"}, content_type="application/octet-stream",
                  success=True)
@blp.alt_response(409, description="The job has not succeeded (yet)")
def job_result(query, job_id: str):
    """A finished job's result (transcriptions in any response format); 409 while it is not ready."""
    svc = services()
    record = _record_or_404(job_id)
    status = record["status"]
    if status in ("queued", "running"):
        raise APIError(409, f"Job '{job_id}' is {status}; its result is not ready.", "not_ready",
                       headers={"Retry-After": "2"}, job_status=status)
    if status == "canceled":
        raise APIError(409, f"Job '{job_id}' was canceled; it has no result.", "canceled", job_status=status)
    if status == "failed":
        error = record.get("error") or {}
        raise APIError(int(error.get("status") or 500), error.get("message") or "The job failed.",
                       error.get("code") or "job_failed", job_status=status)
    result = records.get_result(svc.redis, job_id)
    if result is None:
        raise APIError(404, f"The result of job '{job_id}' has expired.", "result_expired")
    params = (records.load(svc.redis, job_id) or {}).get("params") or {}
    kind, asked = record["kind"], query["format"]
    formats = RESULT_FORMATS.get(kind, ("json",))
    if asked is not None and asked not in formats:
        raise APIError(400, f"format={asked} is not one of a {kind} job's result formats ({', '.join(formats)}).",
                       "invalid_value", "format")
    if asked == "diarized_json" and not params.get("diarize"):
        raise APIError(400, "format=diarized_json needs a job submitted with diarize=true.", "invalid_value", "format")
    if asked == "npy":
        return Response(npy_file(result), mimetype="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{job_id}.npy"'})
    if kind != "transcription":
        return jsonify(result_body(record, result, params))
    return transcription(result, asked or params.get("response_format") or "json",
                         params.get("timestamp_granularities") or ("segment",))


_EVENT_ID = re.compile(r"^[0-9]{1,15}$")


def _last_event_id(query: dict) -> int:
    """Where to resume: the Last-Event-ID header (what browsers send), else ?last_event_id=."""
    header = request.headers.get("Last-Event-ID", "").strip()
    if not header:
        return query["last_event_id"]
    if not _EVENT_ID.match(header):  # ASCII digits only: str.isdigit() also admits "²"
        raise APIError(400, "Last-Event-ID must be a non-negative integer (at most 15 digits).", "invalid_value",
                       "Last-Event-ID")
    return int(header)


@blp.route("/<job_id>/events", methods=["GET"])
@blp.arguments(EventsQuerySchema(), location="query")
@blp.response(200, ServerSentEventSchema, content_type=SSE, description="Events with `id` and `event` "
              "(progress, segment, delta, done, error); the stream ends after done or error")
@blp.alt_response(204, description="The client has already seen the job's last event")
def job_events(query, job_id: str):
    """Server-Sent Events of a job (progress, segment, delta, done, error), replayed from the log.

    204 when the client has already seen the job's last event: an EventSource that reconnects after
    the stream ended (sending the last id it saw) is told there is nothing more, and stops.
    """
    svc = services()
    _record_or_404(job_id)
    after = _last_event_id(query)
    if has_ended(svc.redis, job_id) and not read_log(svc.redis, job_id, after):
        return Response(status=204)
    stream = _event_stream(svc, job_id, after)
    return event_stream(stream)


def _event_stream(svc: Services, job_id: str, after: int):
    """Frame each event with its id and type; end after the terminal one. Leaving cancels nothing."""
    last_write = time.monotonic()
    for event in follow(svc.hub, job_id, after_id=after):
        if event is IDLE:
            if records.get(svc.redis, job_id) is None:  # expired while we waited: nothing more will come
                return
            if time.monotonic() - last_write >= KEEPALIVE_S:
                last_write = time.monotonic()
                yield sse_comment()
            continue
        if event["type"] == HEARTBEAT:
            continue
        last_write = time.monotonic()
        yield event_frame(event)


@blp.route("/<job_id>", methods=["DELETE"])
@blp.response(200, JobSchema)
@blp.alt_response(202, schema=JobSchema, description="Running: it stops at its next piece", success=True)
def cancel_job(job_id: str):
    """Cancel a job: a queued one at once (200), a running one at its next piece (202)."""
    svc = services()
    record = _record_or_404(job_id)
    if record["status"] in records.TERMINAL:
        raise APIError(409, f"Job '{job_id}' already {record['status']}.", "already_finished",
                       job_status=record["status"])
    ended = record["status"] == "queued" and cancel_queued(svc.redis, svc.settings, job_id)
    if not ended:
        request_cancel(svc.redis, job_id, svc.settings.result_ttl_s)  # its worker stops it at the next piece
    return {**records.get(svc.redis, job_id), "links": _links(job_id)}, 200 if ended else 202
