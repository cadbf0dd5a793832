"""Canceling a background response through the real app on a real Redis, at each point of its life a worker
can be at (no worker runs here: a test takes the job off the queue with RQ as a worker does)."""

from __future__ import annotations

import pytest

from jobs import keys, queues
from workers import rqjobs

MODEL = "smollm2-135m"


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis."""
    return app_for().test_client()


def _background(client) -> str:
    response = client.post("/v1/responses", json={"model": MODEL, "input": "Write a long story.", "background": True})
    assert response.status_code == 200, response.get_data(as_text=True)
    assert response.get_json()["status"] == "queued"
    return response.get_json()["id"]


def test_a_queued_background_response_is_canceled_at_once(client, redis_conn):
    response_id = _background(client)
    canceled = client.post(f"/v1/responses/{response_id}/cancel")
    assert canceled.status_code == 200 and canceled.get_json()["status"] == "cancelled"
    assert client.get(f"/v1/responses/{response_id}").get_json()["status"] == "cancelled"


def test_one_a_worker_is_starting_reads_in_progress_and_its_worker_is_told(client, redis_conn):
    # The worker has taken it off the queue (and recorded it started in RQ) but not yet marked it running:
    # the cancel answered "queued" there, as if nothing had happened (seen once in a full run).
    response_id = _background(client)
    queue = next(q for q in (queues.get_queue(name, redis_conn) for name in queues.WORKER_QUEUES)
                 if response_id in q.get_job_ids())
    [job] = rqjobs.claim_many(queue, [response_id])
    rqjobs.start(job, "test-worker")
    canceled = client.post(f"/v1/responses/{response_id}/cancel")
    assert canceled.status_code == 200 and canceled.get_json()["status"] == "in_progress"
    assert redis_conn.exists(keys.cancel_flag(response_id))  # the worker stops it at its first piece
