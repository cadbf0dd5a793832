"""Errors with a meaning for clients, shared by both tiers: one exception -> (status, code, message) mapping.

The worker turns whatever ends a job into the data of its `error` event with `error_data`; the web
tier turns that data (or its own refusals, web.errors.APIError, a JobError too) into the envelope.
Anything that is not a JobError is an internal error: its text stays in the worker's log.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class JobError(Exception):
    """An error a client is told about: HTTP status, machine-readable code, message, maybe a field."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str = "", *, status: int | None = None, code: str | None = None,
                 param: str | None = None, **extra):
        super().__init__(message or self.code.replace("_", " "))
        self.message = str(self)
        self.status = status or self.status
        self.code = code or self.code
        self.param = param
        self.extra = extra

    def as_data(self) -> dict:
        """The `error` event's data: message, code, status, and param / extras when set."""
        data = {"message": self.message, "code": self.code, "status": self.status, **self.extra}
        if self.param:
            data["param"] = self.param
        return data


class InvalidRequest(JobError):
    """The request cannot be served as asked (HTTP 400)."""

    status, code = 400, "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    """The prompt does not fit the model's context window (HTTP 400)."""

    code = "context_length_exceeded"


class ModelTooLarge(JobError):
    """The model cannot fit the worker's memory budget even with every other model evicted (HTTP 507)."""

    status, code = 507, "insufficient_storage"


class Canceled(JobError):
    """The client canceled the job (or left its stream) while it waited or ran (HTTP 499)."""

    status, code = 499, "canceled"


class JobTimeout(JobError):
    """The job ran past its time limit (HTTP 504)."""

    status, code = 504, "job_timeout"


class WorkerShutdown(JobError):
    """The worker was told to stop at once while running the job (HTTP 503)."""

    status, code = 503, "worker_shutdown"


class WorkerDied(JobError):
    """The worker running the job died (HTTP 500)."""

    status, code = 500, "worker_died"


def error_data(exc: BaseException) -> dict:
    """The `error` event's data for whatever ended a job; never a traceback or a server path."""
    if isinstance(exc, JobError):
        return exc.as_data()
    from jobs.media import MediaError  # imported here: PyAV loads only where audio is handled
    from jobs.store import ModelNotFound

    if isinstance(exc, MediaError):
        code = {"not_audio": "unsupported_media_type", "too_long": "audio_too_long"}.get(exc.reason, "invalid_audio")
        return {"message": str(exc), "code": code, "status": exc.status, "reason": exc.reason, "param": "file"}
    if isinstance(exc, ModelNotFound):
        return {"message": exc.public_message, "code": "model_not_found", "status": 404, "param": "model"}
    # An unexpected error's text may hold anything (paths, internals): the client gets its type, the
    # log the whole traceback.
    log.error("job failed with an unexpected error", exc_info=exc)
    return {"message": f"the worker failed ({type(exc).__name__}); its log has the details",
            "code": "internal_error", "status": 500}
