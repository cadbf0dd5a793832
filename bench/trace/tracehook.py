"""Timestamps through one synchronous chat, across processes (used by bench/trace_text.py only).

Wraps a few functions of the web tier and the worker so that each appends `job_id stage time`
lines to $MLXQ_TRACE_DIR/trace-<pid>.txt. Wall-clock time.time() is comparable across processes
of one machine. It leans on internal function names: a renamed function breaks the trace, not mlxq.
"""

from __future__ import annotations

import functools
import os
import time

_out = None


def mark(job_id: str, stage: str, moment: float | None = None) -> None:
    """Record that `job_id` reached `stage` now (or at `moment`)."""
    global _out
    if _out is None:
        _out = open(os.path.join(os.environ["MLXQ_TRACE_DIR"], f"trace-{os.getpid()}.txt"), "a", buffering=1)
    _out.write(f"{job_id} {stage} {time.time() if moment is None else moment:.6f}\n")


def _wrap(owner, name: str, before=None, after=None) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before:
            before(args)
        result = original(*args, **kwargs)
        if after:
            after(args, result)
        return result

    setattr(owner, name, wrapper)


def patch_web() -> None:
    """Mark: the request reaching Flask, the enqueue (start, job built, done), the answer (on the
    pub/sub connection, got, sent)."""
    import flask
    import rq

    from jobs import queues, subscriber
    from web import jobrun, openai_api

    def hub_receives(args):
        channel = args[1].decode()
        mark(channel[len(args[0]._prefix):], "web_hub_got")

    _wrap(subscriber.EventHub, "_dispatch", before=hub_receives)

    wsgi_app = flask.Flask.wsgi_app

    def timed_wsgi_app(self, environ, start_response):
        environ["mlxq.trace_t0"] = time.time()
        return wsgi_app(self, environ, start_response)

    flask.Flask.wsgi_app = timed_wsgi_app

    def enqueue_starts(args):
        mark(args[5], "web_request_in", flask.request.environ["mlxq.trace_t0"])
        mark(args[5], "web_enqueue_start")

    _wrap(queues, "enqueue", before=enqueue_starts, after=lambda args, job: mark(args[5], "web_enqueue_done"))
    _wrap(rq.Queue, "enqueue", after=lambda args, job: mark(job.id, "web_job_built"))
    wait_for_result = jobrun.wait_for_result

    def timed_wait(job_id):
        result = wait_for_result(job_id)
        mark(job_id, "web_got_done")
        flask.g.trace_job_id = job_id
        return result

    openai_api.wait_for_result = timed_wait
    process_response = flask.Flask.process_response

    def timed_process_response(self, response):
        response = process_response(self, response)
        if getattr(flask.g, "trace_job_id", None):
            mark(flask.g.trace_job_id, "web_response_ready")
        return response

    flask.Flask.process_response = timed_process_response


def patch_worker() -> None:
    """Mark: the job claimed, RQ handing it over, its preparation, the job function, generation and the answer's publish."""
    from rq import get_current_job

    from jobs import events
    from jobs.queues import DoorbellQueue
    from workers import engine, rqworker, tasks

    dequeue_any = DoorbellQueue.dequeue_any.__func__

    def timed_dequeue(cls, *args, **kwargs):
        result = dequeue_any(cls, *args, **kwargs)
        if result:
            mark(result[0].id, "wk_claimed")
        return result

    DoorbellQueue.dequeue_any = classmethod(timed_dequeue)
    _wrap(rqworker.Worker, "execute_job", before=lambda args: mark(args[1].id, "wk_dequeued"))
    _wrap(rqworker.Worker, "prepare_execution", after=lambda args, _: mark(args[1].id, "wk_prepared"))
    run_text_job = tasks._run_text_job

    def timed_run(payload, prompts):
        mark(get_current_job().id, "wk_job_function")
        return run_text_job(payload, prompts)

    tasks._run_text_job = timed_run
    generate_text = engine.Runtime.generate_text

    def timed_generate(self, *args, **kwargs):
        mark(get_current_job().id, "wk_generate")
        return generate_text(self, *args, **kwargs)

    engine.Runtime.generate_text = timed_generate
    publish_many = events.EventPublisher.publish_many

    def timed_publish(self, job_id, batch):
        final = any(kind == events.DONE for kind, _ in batch)
        if final:
            mark(job_id, "wk_publish_answer")
        result = publish_many(self, job_id, batch)
        if final:
            mark(job_id, "wk_published")
        return result

    events.EventPublisher.publish_many = timed_publish
