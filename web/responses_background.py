"""`background: true` responses: run as async chat jobs (records, the batch queue, cancel), the stored
response refreshed from the job's record when it is fetched (OpenAI's own way of doing async work)."""

from __future__ import annotations

from jobs import records
from jobs.lifecycle import cancel_queued, request_cancel, settle
from web import intake
from web import responses as rs
from web.errors import APIError
from web.jobrun import submit_async

CHAT_TIMEOUT_S = 3600
"""RQ timeout of a background response's job."""

STATUS = {"queued": "queued", "running": "in_progress", "succeeded": "completed", "failed": "failed",
          "canceled": "cancelled"}
"""A job record's status as a response's status."""


def start(svc, request, body: dict, messages: list[dict], owner: str, created: int) -> dict:
    """Queue the job and store the response as `queued`; return it."""
    if body["stream"] or not body["store"]:
        raise APIError(400, "A background response is stored and fetched later: it takes neither `stream` nor "
                            "`store: false`.", "invalid_value", "background")
    submit_async(request, "chat", {"model": request.model.id, "metadata": body.get("metadata") or {}},
                 intake.chat_func(request), f"response {request.model.id} (background)", CHAT_TIMEOUT_S,
                 {"kind": "chat", "model": request.model.id})
    response = rs.response_object(request.id, body, created, "queued")
    rs.store(svc.redis, response, messages, owner, svc.settings.result_ttl_s)
    return response


def refresh(svc, stored: dict) -> dict:
    """A background response as its job stands now; once it has ended, the stored copy is final."""
    response = stored["response"]
    if not response.get("background") or response["status"] not in ("queued", "in_progress"):
        return response
    job_id = response["id"]
    settle(svc.redis, svc.settings, job_id)  # a job whose worker died ends now, not at the next sweep
    record = records.load(svc.redis, job_id) or {}
    status = STATUS.get(record.get("status"), "failed")
    if status in ("queued", "in_progress"):
        return {**response, "status": status}
    done = records.get_result(svc.redis, job_id) if status == "completed" else None
    error = record.get("error") if status in ("failed", "cancelled") else None
    final = rs.finished(response, done, status, error)
    answer = [rs.answer(done)] if done else []  # with its calls: a later request may answer them
    rs.store(svc.redis, final, stored["messages"] + answer, stored.get("owner", ""), svc.settings.result_ttl_s)
    return final


def cancel(svc, stored: dict) -> dict:
    """Cancel a background response: at once while queued, at the next piece while running."""
    response = refresh(svc, stored)
    if not response.get("background"):
        raise APIError(400, "Only a background response can be canceled.", "invalid_value", "id")
    if response["status"] in ("queued", "in_progress"):
        if not cancel_queued(svc.redis, svc.settings, response["id"]):
            request_cancel(svc.redis, response["id"], svc.settings.result_ttl_s)
    return refresh(svc, {**stored, "response": response})
