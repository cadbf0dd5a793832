"""RQ job functions run by the worker; each takes one JSON payload dict and publishes events.

Events of a text job: `delta` {"index", "text"} while generating (non-empty text only), then one
terminal event: `done` {"model", "choices", "usage", "created"} (also the job's return value), or
`error` {"message", "code", "status"}, after which the job raises so that RQ marks it failed.
Cancellation is an error too (code "canceled", status 499, the job fails): the client got no answer.
Besides the contract's codes, a job past its RQ timeout gets 504 "job_timeout" and one interrupted by
a cold shutdown 503 "worker_shutdown".
"""

from __future__ import annotations

import logging
import time

from rq import get_current_job
from rq.timeouts import JobTimeoutException

from jobs import keys, records
from jobs.events import DELTA, DONE, ERROR, EventPublisher, SentPublish
from jobs.settings import load_settings
from jobs.store import ModelInfo, ModelNotFound, resolve
from jobs.webhooks import finish_record
from workers.engine import Canceled, Runtime, Stream
from workers.registry import ModelTooLarge
from workers.text import ContextLengthExceeded, Piece, Sampling

log = logging.getLogger(__name__)

_runtime: Runtime | None = None

TEXT_KINDS = frozenset({"text"})
"""Model kinds the text job functions accept."""


class InvalidModel(ValueError):
    """The model exists but is the wrong kind for this endpoint (HTTP 400)."""


# Exception class -> (HTTP status, error code) of the error event; anything else is a 500.
ERRORS: dict[type, tuple[int, str]] = {
    ModelNotFound: (404, "model_not_found"),
    InvalidModel: (400, "invalid_model"),
    ModelTooLarge: (507, "insufficient_storage"),
    ContextLengthExceeded: (400, "context_length_exceeded"),
    Canceled: (499, "canceled"),
    JobTimeoutException: (504, "job_timeout"),
    SystemExit: (503, "worker_shutdown"),  # a cold shutdown (second SIGTERM) interrupted the job
}


def set_runtime(runtime: Runtime | None) -> None:
    """Install the process's runtime (workers.main does, after warming the default model)."""
    global _runtime
    _runtime = runtime


def get_runtime() -> Runtime:
    """The process's runtime, created from the environment on first use (e.g. a test's burst worker)."""
    global _runtime
    if _runtime is None:
        _runtime = Runtime.create(load_settings())
    return _runtime


def chat_completion(payload: dict) -> dict:
    """Answer a chat: one choice (index 0) generated from `payload["messages"]`."""
    return _run_text_job(payload, [list(payload["messages"])])


def text_completion(payload: dict) -> dict:
    """Complete prompts: choice i continues `payload["prompts"][i]`."""
    return _run_text_job(payload, list(payload["prompts"]))


def _run_text_job(payload: dict, prompts: list) -> dict:
    """Generate one choice per prompt, publishing deltas and the terminal event of the current job."""
    job = get_current_job()
    runtime = get_runtime()
    publisher = EventPublisher(job.connection, runtime.settings.result_ttl_s, runtime.settings.event_log_max)
    is_async = bool(payload.get("job_id"))  # async chat (/v1/jobs) keeps a job record; sync calls do not
    if is_async:
        records.set_status(job.connection, runtime.settings, job.id, records.RUNNING)
    finished: list[Stream] = []  # generations that gave their last piece; closed once the answer is out
    try:
        try:
            done, last_delta = _generate_all(runtime, publisher, job, payload, prompts, finished)
        except BaseException as exc:  # SystemExit too: the client must still get a terminal event
            status, code, message = describe_error(exc)
            error = {"message": message, "code": code, "status": status}
            if is_async:  # the record first: a client who sees the event may read it at once
                finish_record(job.connection, runtime.settings, job.id, records.status_of_error(error), error)
            publisher.publish(job.id, ERROR, error)
            raise
        if is_async:
            finish_record(job.connection, runtime.settings, job.id, records.SUCCEEDED, result=done)
        publisher.publish_many(job.id, [*last_delta, (DONE, done)])  # one round trip for the answer
        return done
    finally:
        for stream in finished:
            # After the answer: closing ends mlx-lm's generator, which on Apple GPUs first waits for
            # the token it computes ahead and that nobody will use.
            stream.close()


def _generate_all(runtime: Runtime, publisher: EventPublisher, job, payload: dict, prompts: list,
                  finished: list) -> tuple[dict, list]:
    """Run every prompt in turn; return the `done` event's data and the last delta event, unpublished.

    Each prompt's generation, once it gave its last piece, is left open in `finished` for the caller
    to close; the previous one is closed before the next prompt starts.
    """
    info = resolve_text_model(payload.get("model"), runtime)
    sampling = Sampling.from_payload(payload)
    choices, prompt_tokens, completion_tokens, held = [], 0, 0, []
    for index, prompt in enumerate(prompts):
        if _canceled_before_prompt(job, publisher, index, held):
            raise Canceled("canceled before generation started" if index == 0
                           else f"canceled after {index} of {len(prompts)} prompts")
        while finished:
            finished.pop().close()
        choice, final, last_delta, stream = _generate_choice(runtime, publisher, job, index, info, prompt, sampling)
        finished.append(stream)
        held = [(DELTA, {"index": index, "text": last_delta})] if last_delta else []
        choices.append(choice)
        prompt_tokens += final.prompt_tokens
        completion_tokens += final.tokens
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    return {"model": info.id, "choices": choices, "usage": usage, "created": int(time.time())}, held


def resolve_text_model(ref: str | None, runtime: Runtime) -> ModelInfo:
    """Resolve a client's model reference (names only, never paths) and check it generates text."""
    info = resolve(ref, runtime.settings, allow_paths=False)
    if info.kind not in TEXT_KINDS:
        raise InvalidModel(f"model {info.id!r} is a {info.kind} model; this endpoint needs a text model")
    return info


def _generate_choice(runtime: Runtime, publisher: EventPublisher, job, index: int, info: ModelInfo,
                     prompt, sampling: Sampling):
    """Stream one choice's deltas; return (the choice, its final Piece, its last delta unpublished,
    the stream, which the caller closes).

    Deltas go out at most one per settings.stream_interval_ms, each carrying every token generated
    meanwhile: fewer Redis round trips between tokens. A delta is sent without waiting for Redis's
    reply, which is read when the next one goes out (it has long arrived by then): generation is
    CPU-bound for small models, and a round trip waited for is time no token is computed. Each
    reply reports a requested cancel, so a cancel stops generation at the next delta after the one
    that saw it. It returns as soon as the piece with the finish reason arrives, without letting
    mlx-lm finish the token it has already started computing; the text of that last batch is
    returned unpublished, for the caller to send with the next event in one round trip.
    """
    stream = runtime.generate_text(info, prompt, sampling)
    interval = runtime.settings.stream_interval_ms / 1000
    parts, final, last_delta, sent = [], None, "", None
    try:
        for batch in stream.batches(interval=interval):
            delta = "".join(piece.text for piece in batch)
            parts.append(delta)
            final = batch[-1]
            if final.final:
                last_delta = delta
                break
            if delta:
                _raise_if_canceled(sent, final)
                sent = publisher.send_many(job.id, [(DELTA, {"index": index, "text": delta})])
        _raise_if_canceled(sent, final)  # and the last delta is in before the answer goes out
    except BaseException:
        if sent is not None:
            sent.discard()
        stream.close()  # leaving early (a cancel, a timeout, a Redis error): generation stops here
        raise
    choice = {"index": index, "text": "".join(parts), "finish_reason": final.finish_reason}
    return choice, final, last_delta, stream


def _raise_if_canceled(sent: SentPublish | None, last: Piece) -> None:
    """Read the reply to the delta sent before (if any); raise Canceled if it reported a cancel."""
    if sent is not None and sent.result()[1]:
        raise Canceled(f"canceled after {last.tokens} generated tokens")


def _canceled_before_prompt(job, publisher: EventPublisher, index: int, held: list) -> bool:
    """Whether a client asked to cancel the job, checked before prompt `index` starts.

    Before the first, the flag read with the job when the worker claimed it (jobs.queues'
    DoorbellQueue; Redis is asked under another RQ worker class); between prompts, publishing the
    previous one's last delta reports it, and only without such a delta is Redis asked.
    """
    if index == 0:
        known = getattr(job, "cancel_flag_when_fetched", None)
        if known is not None:
            return known
    elif held:
        return publisher.publish_many(job.id, held)[1]
    return bool(job.connection.exists(keys.cancel_flag(job.id)))


_FALLBACK_MESSAGES = {"worker_shutdown": "the worker shut down while running this job",
                      "canceled": "the job was canceled"}


def describe_error(exc: BaseException) -> tuple[int, str, str]:
    """(status, code, message) of the error event for an exception; never a traceback or a server path."""
    if isinstance(exc, ModelNotFound):
        return 404, "model_not_found", exc.public_message
    for cls, (status, code) in ERRORS.items():
        if isinstance(exc, cls):
            return status, code, str(exc) or _FALLBACK_MESSAGES.get(code, code.replace("_", " "))
    # An unexpected error's text may hold anything (paths, internals): the client gets its type, the
    # worker's log the whole traceback.
    log.error("job failed with an unexpected error", exc_info=exc)
    return 500, "internal_error", f"the worker failed ({type(exc).__name__}); its log has the details"
