"""Async job records against a real Redis: lifecycle, TTLs, listing with cursors, queue position."""

from __future__ import annotations

import pytest

from jobs import records
from jobs.lifecycle import end
from jobs.queues import BATCH, INTERACTIVE, enqueue

FIELDS = {"model": "whisper-tiny.en", "filename": "talk.mp3", "params": {"response_format": "srt"},
          "webhook_url": "https://example.com/hook", "metadata": {"customer": "42"}, "duration_s": 12.5}


def test_create_and_get(redis_conn, settings):
    created = records.create(redis_conn, settings, "job-1", "transcription", FIELDS)
    got = records.get(redis_conn, "job-1")
    assert created == got
    assert got["object"] == "job" and got["kind"] == "transcription" and got["status"] == "queued"
    assert got["model"] == "whisper-tiny.en" and got["filename"] == "talk.mp3"
    assert got["metadata"] == {"customer": "42"} and got["webhook_url"] == "https://example.com/hook"
    assert isinstance(got["created_at"], int) and got["started_at"] is None and got["finished_at"] is None
    assert got["progress"] is None and got["error"] is None and got["attempts"] == 0
    assert "params" not in got and "rq_job_id" not in got  # internal fields stay internal
    internal = records.load(redis_conn, "job-1")
    assert internal["params"] == {"response_format": "srt"} and internal["rq_job_id"] == "job-1"
    assert records.get(redis_conn, "nope") is None


def test_update_and_incr(redis_conn, settings):
    records.create(redis_conn, settings, "job-1", "transcription", FIELDS)
    progress = {"done_s": 3.0, "total_s": 12.5, "percent": 24.0, "eta_s": 9.1}
    records.update(redis_conn, "job-1", progress=progress, rq_job_id="job-1.1")
    assert records.get(redis_conn, "job-1")["progress"] == progress
    assert records.load(redis_conn, "job-1")["rq_job_id"] == "job-1.1"
    assert records.incr(redis_conn, "job-1", "attempts") == 1
    assert records.incr(redis_conn, "job-1", "attempts") == 2
    assert records.get(redis_conn, "job-1")["attempts"] == 2
    records.update(redis_conn, "missing", progress=progress)  # a missing record is not created
    assert not redis_conn.exists(records.record_key("missing"))


def test_status_lifecycle_and_ttls(redis_conn, settings):
    records.create(redis_conn, settings, "job-1", "transcription", FIELDS)
    assert redis_conn.ttl(records.record_key("job-1")) > settings.result_ttl_s  # pending: a longer safety TTL
    records.set_status(redis_conn, settings, "job-1", records.RUNNING)
    running = records.get(redis_conn, "job-1")
    assert running["status"] == "running" and running["started_at"] is not None
    records.set_result(redis_conn, settings, "job-1", {"text": "hi"})
    error = {"message": "boom", "code": "internal_error", "status": 500}
    records.set_status(redis_conn, settings, "job-1", records.FAILED, error=error)
    failed = records.get(redis_conn, "job-1")
    assert failed["status"] == "failed" and failed["error"] == error
    assert failed["finished_at"] >= failed["started_at"] == running["started_at"]
    for key in (records.record_key("job-1"), records.result_key("job-1")):
        assert 0 < redis_conn.ttl(key) <= settings.result_ttl_s
    assert records.get_result(redis_conn, "job-1") == {"text": "hi"}
    with pytest.raises(ValueError):
        records.set_status(redis_conn, settings, "job-1", "exploded")


def test_a_stored_responses_record_keeps_its_conversation_unlisted_and_its_end_completes_it(redis_conn, settings):
    conversation = [{"role": "user", "content": "Hi"}]
    records.create(redis_conn, settings, "resp_1", "chat", {"model": "m", "response": {"store": True}},
                   listed=False, conversation=conversation)
    assert records.get_conversation(redis_conn, "resp_1") == conversation
    assert redis_conn.ttl(records.conversation_key("resp_1")) > settings.result_ttl_s  # pending, as the record
    assert records.list_jobs(redis_conn, None, 10, None)[0] == []  # no async job: /v1/jobs does not list it
    done = {"choices": [{"index": 0, "text": "Hello", "finish_reason": "stop"}], "usage": {}}
    assert end(redis_conn, settings, "resp_1", done=done)  # as the worker ends the job
    assert records.get(redis_conn, "resp_1")["status"] == "succeeded"
    assert records.get_result(redis_conn, "resp_1") == done
    assert 0 < redis_conn.ttl(records.conversation_key("resp_1")) <= settings.result_ttl_s
    assert records.get_conversation(redis_conn, "nope") is None


def test_plain_error_becomes_message_and_code(redis_conn, settings):
    records.create(redis_conn, settings, "job-1", "chat", {"model": "m"})
    records.set_status(redis_conn, settings, "job-1", records.CANCELED, error="client went away")
    assert records.get(redis_conn, "job-1")["error"] == {"message": "client went away", "code": "canceled"}


def test_result_missing(redis_conn, settings):
    assert records.get_result(redis_conn, "job-1") is None


def _make(redis_conn, settings, count: int, created_at: float) -> list[str]:
    """Create `count` records, three per creation second (ties exercise the cursor)."""
    ids = [f"job-{n:02d}" for n in range(count)]
    for n, job_id in enumerate(ids):
        records.create(redis_conn, settings, job_id, "transcription", FIELDS)
        redis_conn.zadd(records.JOBS_INDEX, {job_id: created_at + n // 3})  # ties: three per second
    return ids


def test_list_pages_newest_first_with_ties(redis_conn, settings):
    ids = _make(redis_conn, settings, 10, 1_700_000_000.0)
    seen, cursor, pages = [], None, 0
    while True:
        page, cursor = records.list_jobs(redis_conn, None, 3, cursor)
        seen.extend(job["id"] for job in page)
        pages += 1
        if cursor is None:
            break
    assert pages == 4
    assert sorted(seen) == ids and len(set(seen)) == len(seen)  # nothing missed, nothing twice
    scores = [redis_conn.zscore(records.JOBS_INDEX, job_id) for job_id in seen]
    assert scores == sorted(scores, reverse=True)


def test_list_exact_page_has_no_cursor(redis_conn, settings):
    _make(redis_conn, settings, 3, 1_700_000_000.0)
    page, cursor = records.list_jobs(redis_conn, None, 3, None)
    assert len(page) == 3 and cursor is None


def test_list_filters_by_status_and_drops_expired(redis_conn, settings):
    ids = _make(redis_conn, settings, 6, 1_700_000_000.0)
    for job_id in ids[::2]:
        records.set_status(redis_conn, settings, job_id, records.SUCCEEDED)
    redis_conn.delete(records.record_key(ids[0]))  # as if it expired
    page, cursor = records.list_jobs(redis_conn, "succeeded", 10, None)
    assert [job["id"] for job in page] == [ids[4], ids[2]] and cursor is None
    assert redis_conn.zscore(records.JOBS_INDEX, ids[0]) is None  # its index entry went with it
    queued, _ = records.list_jobs(redis_conn, "queued", 1, None)
    assert [job["id"] for job in queued] == [ids[5]]


def test_bad_cursor(redis_conn):
    with pytest.raises(ValueError):
        records.list_jobs(redis_conn, None, 10, "not-a-cursor!")


def test_queue_position(redis_conn, settings):
    for job_id in ("job-a", "job-b", "job-c"):
        records.create(redis_conn, settings, job_id, "transcription", FIELDS)
        enqueue(redis_conn, settings, BATCH, "transcription", {"job_id": job_id}, job_id)
    enqueue(redis_conn, settings, INTERACTIVE, "chat_completion", {}, "chat-1")
    assert [records.queue_position(redis_conn, j) for j in ("job-a", "job-b", "job-c")] == [0, 1, 2]
    # A continuation at the front of batch carries the record's place.
    records.update(redis_conn, "job-c", rq_job_id="job-c_1")
    enqueue(redis_conn, settings, BATCH, "transcription", {"job_id": "job-c"}, "job-c_1",
            at_front=True)
    assert records.queue_position(redis_conn, "job-c") == 0
    assert records.queue_position(redis_conn, "job-a") == 1
    assert records.queue_position(redis_conn, "unknown") is None
