"""One job lifecycle on a real Redis: how a job ends, whoever ends it, and who counts as dead."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rq.job import JobStatus

from jobs import keys, lifecycle, queues, records
from jobs.events import DONE, ERROR, EventPublisher, read_log


def _async_job(conn, settings, job_id: str, kind: str = "chat") -> None:
    records.create(conn, settings, job_id, kind, {"model": "m", "webhook_url": "http://hooks.example/x"})


def test_ending_a_job_writes_the_record_then_the_event_then_cleans_up(redis_conn, settings):
    _async_job(redis_conn, settings, "job-ok", "transcription")
    (settings.spool_dir / "job-ok").mkdir(parents=True)
    redis_conn.hset(keys.checkpoint_key("job-ok"), "state", "{}")
    done = {"result": {"text": "hello"}}
    assert lifecycle.end(redis_conn, settings, "job-ok", done=done, result=done["result"])
    record = records.get(redis_conn, "job-ok")
    assert record["status"] == "succeeded" and records.get_result(redis_conn, "job-ok") == {"text": "hello"}
    assert [e["type"] for e in read_log(redis_conn, "job-ok")] == [DONE]
    assert queues.fetch_job(redis_conn, "webhook-job-ok") is not None  # its webhook is queued
    assert not redis_conn.exists(keys.checkpoint_key("job-ok"))
    assert not (settings.spool_dir / "job-ok").exists()


def test_an_error_ends_a_job_canceled_or_failed(redis_conn, settings):
    for job_id, code, status in (("job-c", "canceled", "canceled"), ("job-f", "worker_died", "failed")):
        _async_job(redis_conn, settings, job_id)
        lifecycle.end(redis_conn, settings, job_id, error={"message": "x", "code": code, "status": 499})
        assert records.get(redis_conn, job_id)["status"] == status
        assert read_log(redis_conn, job_id)[-1]["type"] == ERROR


def test_whoever_ends_a_job_second_finds_the_record_matching_the_first_end(redis_conn, settings):
    _async_job(redis_conn, settings, "job-race")
    lifecycle.end(redis_conn, settings, "job-race", error={"message": "died", "code": "worker_died", "status": 500})
    assert not lifecycle.end(redis_conn, settings, "job-race", done={"choices": []})  # the worker, too late
    assert records.get(redis_conn, "job-race")["status"] == "failed"
    assert [e["type"] for e in read_log(redis_conn, "job-race")] == [ERROR]


def test_synchronous_calls_ending_together_each_get_their_events_then_their_answer(redis_conn, settings):
    from jobs.events import DELTA

    redis_conn.hset(keys.checkpoint_key("call-a"), "state", "{}")
    # call-c was ended first by someone else (its client gone: a reader found its worker dead): it keeps that end.
    lifecycle.end(redis_conn, settings, "call-c", error={"message": "died", "code": "worker_died", "status": 500},
                  has_record=False)
    lifecycle.end_calls(redis_conn, settings, [
        ("call-a", {"choices": ["a"]}, [(DELTA, {"text": "x"}), (DELTA, {"text": "y"})]),
        ("call-b", {"choices": ["b"]}, None),
        ("call-c", {"choices": ["c"]}, [(DELTA, {"text": "late"})])])
    assert [(e["type"], e["data"]) for e in read_log(redis_conn, "call-a")] == [
        (DELTA, {"text": "x"}), (DELTA, {"text": "y"}), (DONE, {"choices": ["a"]})]
    assert [(e["type"], e["data"]) for e in read_log(redis_conn, "call-b")] == [(DONE, {"choices": ["b"]})]
    assert [e["type"] for e in read_log(redis_conn, "call-c")] == [ERROR]
    assert not redis_conn.exists(keys.checkpoint_key("call-a"))


def test_settle_records_an_outcome_a_reader_published(redis_conn, settings):
    _async_job(redis_conn, settings, "job-s")
    assert not lifecycle.settle(redis_conn, settings, "job-s")  # nothing happened yet
    done = {"model": "m", "choices": [{"index": 0, "text": "Paris", "finish_reason": "stop"}], "usage": {}}
    EventPublisher(redis_conn, 60, 100).publish("job-s", DONE, done)
    assert lifecycle.settle(redis_conn, settings, "job-s")
    assert records.get(redis_conn, "job-s")["status"] == "succeeded"
    assert records.get_result(redis_conn, "job-s") == done
    assert not lifecycle.settle(redis_conn, settings, "job-s")


def test_cancel_queued_ends_a_job_that_never_started(redis_conn, settings):
    _async_job(redis_conn, settings, "job-q")
    queues.enqueue(redis_conn, settings, queues.BATCH, queues.CHAT_COMPLETION, {}, "job-q")
    assert lifecycle.cancel_queued(redis_conn, settings, "job-q")
    assert records.get(redis_conn, "job-q")["status"] == "canceled"
    assert queues.get_queue(queues.BATCH, redis_conn).count == 0
    assert queues.fetch_job(redis_conn, "job-q").get_status() == JobStatus.CANCELED


def test_a_job_started_by_a_dead_worker_is_failed_by_its_reader(redis_conn, settings):
    job = queues.enqueue(redis_conn, settings, queues.INTERACTIVE, queues.CHAT_COMPLETION, {}, "chatcmpl-x")
    with redis_conn.pipeline() as pipe:
        job.prepare_for_execution("gone-worker", pipe)
        pipe.execute()
    assert lifecycle.fail_if_orphaned(redis_conn, settings, "chatcmpl-x")
    error = read_log(redis_conn, "chatcmpl-x")[-1]
    assert error["type"] == ERROR and error["data"]["code"] == "worker_died"
    assert not lifecycle.fail_if_orphaned(redis_conn, settings, "chatcmpl-x")  # ended once


def test_worker_is_dead_when_its_key_expired_or_its_process_is_gone(redis_conn):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    here = lifecycle.host_identity()
    redis_conn.set(keys.worker_alive("w-gone"), json.dumps({"host": here, "pid": gone.pid}), ex=60)
    redis_conn.set(keys.worker_alive("w-here"), json.dumps({"host": here, "pid": os.getppid()}), ex=60)
    redis_conn.set(keys.worker_alive("w-elsewhere"), json.dumps({"host": "other|pid:[1]", "pid": gone.pid}), ex=60)
    assert lifecycle.worker_is_dead(redis_conn, "w-gone") and lifecycle.worker_is_dead(redis_conn, "w-expired")
    assert not lifecycle.worker_is_dead(redis_conn, "w-here")
    assert not lifecycle.worker_is_dead(redis_conn, "w-elsewhere")
