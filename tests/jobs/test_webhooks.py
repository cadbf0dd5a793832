"""Webhook signing, the private-address check, and delivery through a real RQ worker to a real receiver."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from jobs import queues, records
from jobs.webhooks import (
    RETRY_INTERVALS_S,
    SIGNATURE_HEADER,
    UnsafeDestination,
    check_destination,
    deliver,
    delivery_id,
    enqueue_delivery,
    is_public,
    sign,
    verify,
)
from tests.conftest import wait_until

SECRET = "test-secret"


def test_signature_is_hmac_sha256_of_timestamp_dot_body():
    body = b'{"id":"job-1","status":"succeeded"}'
    header = sign(SECRET, body, 1700000000)
    expected = hmac.new(SECRET.encode(), b"1700000000." + body, hashlib.sha256).hexdigest()
    assert header == f"t=1700000000,v1={expected}"


def test_verify_accepts_fresh_and_refuses_tampered_stale_or_garbled():
    body = b'{"id":"job-1","status":"failed"}'
    header = sign(SECRET, body, 1700000000)
    assert verify(SECRET, body, header, now=1700000010)
    assert not verify(SECRET, body + b" ", header, now=1700000010)
    assert not verify("other", body, header, now=1700000010)
    assert not verify(SECRET, body, header, now=1700000000 + 3600)
    assert not verify(SECRET, body, "v1=abc", now=1700000000)
    assert not verify(SECRET, body, "t=soon,v1=abc", now=1700000000)


@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("2606:4700:4700::1111", True),
    ("127.0.0.1", False), ("::1", False), ("10.1.2.3", False), ("172.16.0.9", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("fe80::1%eth0", False), ("0.0.0.0", False), ("240.0.0.1", False),
    ("224.0.0.1", False), ("fc00::1", False), ("::ffff:127.0.0.1", False), ("100.64.0.1", False),
])
def test_is_public(address, public):
    assert is_public(address) is public


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/hook", "http://localhost/hook", "https://[::1]/x",
                                 "http://169.254.169.254/latest/meta-data", "http://10.0.0.1/"])
def test_private_destinations_are_refused_unless_allowed(url):
    with pytest.raises(UnsafeDestination, match="non-public"):
        check_destination(url, allow_private=False)
    assert check_destination(url, allow_private=True)


@pytest.mark.parametrize("url", ["ftp://example.com/x", "http:///nohost", "file:///etc/passwd",
                                 "http://does-not-exist.invalid/hook"])
def test_malformed_or_unresolvable_destinations_are_refused(url):
    with pytest.raises(UnsafeDestination):
        check_destination(url, allow_private=True)


class Receiver:
    """A local HTTP server recording every POST; answers with the statuses queued in `answers`."""

    def __init__(self, answers=()):
        self.hits: list[dict] = []
        self.answers = list(answers)
        self.arrived = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.hits.append({"path": self.path, "headers": dict(self.headers), "body": body})
                self.send_response(receiver.answers.pop(0) if receiver.answers else 204)
                self.end_headers()
                receiver.arrived.set()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/mlxq?x=1"
        # Polls for shutdown every 0.05 s (the default 0.5 s was each test's teardown).
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture()
def hook_settings(settings, monkeypatch):
    """Settings for delivery: the worker reads them from the environment, as `mlxq webhook-worker` does."""
    monkeypatch.setenv("MLXQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("MLXQ_WEBHOOK_SECRET", SECRET)
    monkeypatch.setenv("MLXQ_WEBHOOK_ALLOW_PRIVATE", "1")
    return settings.with_overrides(webhook_secret=SECRET, webhook_allow_private=True)


def _finished_job(redis_conn, settings, url, status="succeeded") -> str:
    job_id = queues.new_job_id("job")
    records.create(redis_conn, settings, job_id, "transcription", {"model": "m", "webhook_url": url})
    records.set_status(redis_conn, settings, job_id, status)
    return job_id


def _work(redis_conn):
    SimpleWorker([queues.get_queue(queues.WEBHOOKS, redis_conn)], connection=redis_conn,
                 serializer=JSONSerializer).work(burst=True, with_scheduler=True)


def test_delivery_posts_signed_status_once(redis_conn, hook_settings, receiver):
    job_id = _finished_job(redis_conn, hook_settings, receiver.url)
    job = enqueue_delivery(redis_conn, hook_settings, job_id)
    assert enqueue_delivery(redis_conn, hook_settings, job_id).id == job.id == delivery_id(job_id)
    assert job.retries_left == len(RETRY_INTERVALS_S) and job.retry_intervals == RETRY_INTERVALS_S
    _work(redis_conn)
    assert len(receiver.hits) == 1
    hit = receiver.hits[0]
    assert hit["path"] == "/hooks/mlxq?x=1"
    assert json.loads(hit["body"]) == {"id": job_id, "status": "succeeded"}
    assert hit["headers"]["Content-Type"] == "application/json"
    assert verify(SECRET, hit["body"], hit["headers"][SIGNATURE_HEADER])


def test_non_2xx_is_retried_with_backoff(redis_conn, hook_settings):
    receiver = Receiver(answers=[500])
    try:
        job_id = _finished_job(redis_conn, hook_settings, receiver.url, "failed")
        enqueue_delivery(redis_conn, hook_settings, job_id)
        _work(redis_conn)
        assert len(receiver.hits) == 1
        queue = queues.get_queue(queues.WEBHOOKS, redis_conn)
        assert delivery_id(job_id) in queue.scheduled_job_registry.get_job_ids()  # retry in 1 s
        wait_until(lambda: _work(redis_conn) or len(receiver.hits) == 2, 15, interval=0.2,
                   what="the scheduled retry")
        assert json.loads(receiver.hits[1]["body"]) == {"id": job_id, "status": "failed"}
    finally:
        receiver.close()


def test_delivery_rechecks_the_destination(redis_conn, settings, monkeypatch, receiver):
    monkeypatch.setenv("MLXQ_REDIS_URL", settings.redis_url)
    monkeypatch.setenv("MLXQ_WEBHOOK_ALLOW_PRIVATE", "0")  # accepted at submit time, refused now
    job_id = _finished_job(redis_conn, settings, receiver.url)
    outcome = deliver({"job_id": job_id})
    assert outcome["delivered"] is False and "non-public" in outcome["reason"]
    assert receiver.hits == []




def test_a_diarized_transcription_names_its_speakers(redis_conn, hook_settings, receiver):
    job_id = _finished_job(redis_conn, hook_settings, receiver.url)
    segments = [{"text": " a", "speaker": "Bob"}, {"text": " b", "speaker": "A"}, {"text": " c", "speaker": "Bob"}]
    records.set_result(redis_conn, hook_settings, job_id, {"text": "a b c", "segments": segments})
    enqueue_delivery(redis_conn, hook_settings, job_id)
    _work(redis_conn)
    assert json.loads(receiver.hits[0]["body"]) == {"id": job_id, "status": "succeeded", "speakers": ["Bob", "A"]}
