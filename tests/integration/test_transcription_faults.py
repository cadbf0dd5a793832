"""kill -9 of the real worker in the middle of a real transcription, then a restart: nothing is lost."""

from __future__ import annotations

import pytest

from tests.conftest import wait_until
from tests.integration.test_transcription import long_wav, submit_job


def _record(api, job: dict) -> dict:
    return api.get(job["links"]["self"]).json()


def _finished(api, job: dict, timeout: float) -> dict:
    """Wait for the job's terminal status and return its record."""
    return wait_until(lambda: (r := _record(api, job))["status"] in ("succeeded", "failed", "canceled") and r,
                      timeout, interval=0.5, what=f"job {job['id']} to finish")


@pytest.mark.parametrize("chunking", [None, "auto"], ids=["sequential", "batched"])
def test_worker_killed_mid_transcription_resumes_with_the_same_text(api, service, chunking):
    audio = long_wav(repeats=1)  # about a minute: two or three 30 s windows (or batches of two pieces)
    form = {"chunking_strategy": chunking} if chunking else {}
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
