"""kill -9 of the real worker in the middle of a real transcription, then a restart: nothing is lost."""

from __future__ import annotations

from tests.conftest import wait_until
from tests.integration.test_transcription import long_wav, submit_job


def _record(api, job: dict) -> dict:
    return api.get(job["links"]["self"]).json()


def _finished(api, job: dict, timeout: float) -> dict:
    """Wait for the job's terminal status and return its record."""
    return wait_until(lambda: (r := _record(api, job))["status"] in ("succeeded", "failed", "canceled") and r,
                      timeout, interval=0.5, what=f"job {job['id']} to finish")


def test_worker_killed_mid_transcription_resumes_with_the_same_text(api, service):
    # The one end-to-end kill -9 of a transcription, on the batched path: the only one whose resume state
    # is otherwise never written to Redis and read back by another process. The sequential path's resume
    # goes through Redis in process (tests/workers/test_speech.py: recover() after a dead worker, and a
    # warm stop's hand-back); both paths' resume from a state are in tests/workers/test_speech*.py.
    audio = long_wav(repeats=1)  # about a minute: three speech pieces, two batches of two (MLXQ_SPEECH_BATCH)
    form = {"chunking_strategy": "auto"}
    reference = _finished(api, submit_job(api, "minute.wav", content=audio, **form), 300)
    assert reference["status"] == "succeeded", reference

    job = submit_job(api, "minute.wav", content=audio, **form)
    # Kill the worker once the first window's segments are checkpointed and published.
    wait_until(lambda: ((_record(api, job).get("progress") or {}).get("done_s") or 0) > 0, 300, interval=0.2,
               what="the first chunk to be transcribed")
    service.worker.kill9()
    assert _record(api, job)["status"] == "running"
    service.restart_worker()

    record = _finished(api, job, 300)
    assert record["status"] == "succeeded", record
    assert record["attempts"] >= 2, "the job should have been resumed by the restarted worker"
    assert record["result"]["text"] == reference["result"]["text"]
    starts = [s["start"] for s in record["result"]["segments"]]
    assert starts == sorted(starts), "timestamps must continue across the resume"
