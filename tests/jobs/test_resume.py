"""One resume path on a real Redis: a job's checkpoints (jobs/checkpoints.py), handed over through its
JobRun, and `continue_job`, the one way a job goes on elsewhere."""

from __future__ import annotations

import dataclasses

from jobs import checkpoints, contract, keys, lifecycle, queues, records
from jobs.events import SEGMENT, read_log

REF = contract.ModelRef("whisper-tiny.en", "/models/whisper-tiny.en", "speech")


def _segment(number: int) -> dict:
    return {"id": number, "text": f" part {number}"}


def _transcription(conn, settings, job_id: str, attempts: int = 1) -> contract.TranscriptionRequest:
    records.create(conn, settings, job_id, "transcription", {"model": REF.id})
    return contract.TranscriptionRequest(job_id, REF, f"/spool/{job_id}/audio.wav", is_async=True,
                                         attempts=attempts)


def test_a_checkpoint_keeps_items_by_id_the_state_and_what_was_published(redis_conn, settings):
    assert checkpoints.load(redis_conn, "job-1") is None
    assert checkpoints.save(redis_conn, settings, "job-1", [_segment(1), _segment(0)], {"seek": 3000}) == 2
    assert checkpoints.save(redis_conn, settings, "job-1", [_segment(1)], {"seek": 3000}) == 2  # written again
    saved = checkpoints.load(redis_conn, "job-1")
    assert saved.state == {"seek": 3000} and saved.items == [_segment(0), _segment(1)]
    assert saved.published == 0 and saved.unpublished == saved.items  # stored, the worker died before publishing
    checkpoints.mark_published(redis_conn, "job-1", 2)
    assert checkpoints.save(redis_conn, settings, "job-1", [_segment(2)], {"seek": 6000}) == 3
    assert checkpoints.load(redis_conn, "job-1").unpublished == [_segment(2)]
    ttl = settings.result_ttl_s * records.PENDING_TTL_FACTOR
    assert 0 < redis_conn.ttl(keys.checkpoint_key("job-1")) <= ttl
    assert 0 < redis_conn.ttl(keys.checkpoint_segments("job-1")) <= ttl


def test_a_run_hands_its_checkpoint_over_and_a_resumed_run_gets_it_back(redis_conn, settings):
    run = lifecycle.JobRun(redis_conn, settings, "job-2")
    assert run.restore(resume=False) is None
    events = [(SEGMENT, {"segment": _segment(0)})]
    run.checkpoint({"seek": 3000}, [_segment(0)], events)
    assert [e["data"] for e in read_log(redis_conn, "job-2")] == [{"segment": _segment(0)}]
    resumed = lifecycle.JobRun(redis_conn, settings, "job-2").restore(resume=True)
    assert resumed.state == {"seek": 3000} and resumed.items == [_segment(0)] and resumed.unpublished == []
    assert run.checkpointed() == [_segment(0)]


def test_a_fresh_start_forgets_the_state_but_keeps_counting_continuations(redis_conn, settings):
    checkpoints.save(redis_conn, settings, "job-3", [_segment(0)], {"seek": 3000})
    assert checkpoints.next_continuation(redis_conn, "job-3") == 1
    assert lifecycle.JobRun(redis_conn, settings, "job-3").restore(resume=False) is None
    assert checkpoints.load(redis_conn, "job-3") is None and checkpoints.items(redis_conn, "job-3") == []
    assert checkpoints.next_continuation(redis_conn, "job-3") == 2


def test_continue_job_puts_a_continuation_first_in_its_batch_queue_even_when_the_queue_is_full(redis_conn,
                                                                                              settings):
    full = dataclasses.replace(settings, max_queued=1)
    queues.enqueue(redis_conn, full, queues.BATCH, queues.TRANSCRIPTION, {"id": "job-new"}, "job-new")
    request = _transcription(redis_conn, full, "job-4", attempts=2)
    rq_id = lifecycle.continue_job(redis_conn, full, request, queue=queues.BATCH, func=queues.TRANSCRIPTION,
                                   timeout_s=600, attempts=3, owner="k" * 24)
    assert rq_id == "job-4_1"
    assert queues.get_queue(queues.BATCH, redis_conn).job_ids == ["job-4_1", "job-new"]
    job = queues.fetch_job(redis_conn, rq_id)
    assert job.args[0] == {**contract.to_payload(request), "resume": True, "attempts": 3}
    assert job.timeout == 600 and job.meta == {"job_id": "job-4", "continuation": 1, "owner": "k" * 24}
    record = records.load(redis_conn, "job-4")
    assert record["attempts"] == 3 and record["rq_job_id"] == "job-4_1"


def test_continue_job_keeps_a_models_own_batch_queue_and_never_goes_to_interactive(redis_conn, settings):
    request = _transcription(redis_conn, settings, "job-5")
    own = queues.model_queue(queues.BATCH, REF.id)
    assert lifecycle.continue_job(redis_conn, settings, request, queue=own, func=None, timeout_s=None) == "job-5_1"
    assert queues.get_queue(own, redis_conn).job_ids == ["job-5_1"]
    lifecycle.continue_job(redis_conn, settings, request, queue=queues.INTERACTIVE, func=None, timeout_s=None)
    assert queues.get_queue(queues.BATCH, redis_conn).job_ids == ["job-5_2"]
    assert queues.get_queue(queues.INTERACTIVE, redis_conn).job_ids == []
    second = queues.fetch_job(redis_conn, "job-5_2")
    assert second.func_name == queues.TRANSCRIPTION and second.timeout == lifecycle.CONTINUATION_TIMEOUT_S
    assert records.load(redis_conn, "job-5")["attempts"] == 1  # handed back: not a new start


def test_the_end_of_a_job_deletes_its_checkpoint(redis_conn, settings):
    checkpoints.save(redis_conn, settings, "job-6", [_segment(0)], {"seek": 3000})
    lifecycle.end(redis_conn, settings, "job-6", done={"result": {}}, has_record=False)
    assert not redis_conn.exists(keys.checkpoint_key("job-6"), keys.checkpoint_segments("job-6"))
