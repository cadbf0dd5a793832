"""Webhooks: tell a client's URL that its async job finished, signed, retried, never to private hosts.

`deliver` runs on a plain RQ worker listening on the `webhooks` queue (never the GPU worker). It
POSTs `{"id", "status"}` as JSON with the header

    X-Mlxq-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, f"{t}.{body}")>

and raises on a non-2xx answer or a connection error, so RQ retries it with backoff.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time

import redis
from rq import Retry, get_current_job

from jobs import queues, records
from jobs.connection import get_redis
from jobs.destinations import (  # noqa: F401 (re-exported: the guard's home was here)
    UnsafeDestination,
    check_destination,
    is_public,
    pinned_connection,
)
from jobs.settings import Settings, load_settings

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Mlxq-Signature"
RETRY_INTERVALS_S = [1, 5, 30, 120, 600]
"""Backoff between delivery attempts (seconds); one retry per entry."""
TIMEOUT_S = 10.0
"""Connect and read timeout of one delivery attempt."""
DELIVER = "jobs.webhooks.deliver"


class DeliveryFailed(RuntimeError):
    """The receiver answered with a non-2xx status (RQ retries the delivery)."""


def sign(secret: str, body: bytes, timestamp: int) -> str:
    """The signature header value for `body` sent at `timestamp`."""
    message = f"{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def verify(secret: str, body: bytes, header: str, tolerance_s: float = 300, now: float | None = None) -> bool:
    """Whether `header` is a valid, fresh signature of `body` (what a receiver should check)."""
    parts = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
    try:
        timestamp = int(parts["t"])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, body, timestamp), f"t={timestamp},v1={parts.get('v1', '')}")


def post(url: str, address: str, body: bytes, headers: dict, timeout: float = TIMEOUT_S) -> int:
    """POST `body` to `url`, connecting to `address` (so DNS can't change between check and use)."""
    conn, target = pinned_connection(url, address, timeout)
    try:
        conn.request("POST", target, body=body, headers=headers)
        response = conn.getresponse()
        response.read(64 * 1024)  # drain a little so the connection closes cleanly; the body is unused
        return response.status
    finally:
        conn.close()


def delivery_body(record: dict, result: dict | None = None) -> bytes:
    """The JSON body sent for a finished job: its id and status, and a diarized transcription's speakers (in the
    order they first speak), so a receiver knows who is in it before it fetches the rest."""
    body = {"id": record["id"], "status": record["status"]}
    said = [seg.get("speaker") for seg in (result or {}).get("segments", ()) if isinstance(seg, dict)]
    if any(said):
        body["speakers"] = list(dict.fromkeys(s for s in said if s))
    return json.dumps(body, separators=(",", ":")).encode()


def _connection(settings: Settings) -> redis.Redis:
    """The running RQ job's connection (the worker's --url), else the settings' Redis."""
    job = get_current_job()
    return job.connection if job is not None else get_redis(settings.redis_url)


def deliver(payload: dict) -> dict:
    """RQ job: POST the signed outcome of `payload["job_id"]` to its webhook_url (raises to retry)."""
    settings = load_settings()
    connection = _connection(settings)
    record = records.get(connection, payload["job_id"])
    if record is None or not record.get("webhook_url"):
        return {"delivered": False, "reason": "no record or no webhook_url"}
    url = record["webhook_url"]
    try:  # checked again now: the name may resolve elsewhere than when the job was submitted
        address = check_destination(url, settings.webhook_allow_private)[0]
    except UnsafeDestination as exc:
        log.warning("webhook for %s not sent: %s", record["id"], exc)
        return {"delivered": False, "reason": str(exc)}
    result = records.get_result(connection, record["id"]) if record["kind"] == "transcription" else None
    body = delivery_body(record, result)
    headers = {"Content-Type": "application/json", "User-Agent": "mlxq-webhooks/1",
               SIGNATURE_HEADER: sign(settings.webhook_secret, body, int(time.time()))}
    status = post(url, address, body, headers)
    if not 200 <= status < 300:
        raise DeliveryFailed(f"webhook receiver {url} answered HTTP {status}")
    return {"delivered": True, "status": status}


def delivery_id(job_id: str) -> str:
    """The RQ id of a job's webhook delivery (one per job)."""
    return f"webhook-{job_id}"


def enqueue_delivery(connection: redis.Redis, settings: Settings, job_id: str):
    """Enqueue the webhook delivery of a finished job once (a second call is a no-op); return it."""
    existing = queues.fetch_job(connection, delivery_id(job_id))
    if existing is not None:
        return existing
    queue = queues.get_queue(queues.WEBHOOKS, connection)
    return queue.enqueue(DELIVER, {"job_id": job_id}, job_id=delivery_id(job_id),
                         retry=Retry(max=len(RETRY_INTERVALS_S), interval=RETRY_INTERVALS_S),
                         description=f"webhook for {job_id}", job_timeout=int(TIMEOUT_S * 3),
                         result_ttl=settings.result_ttl_s, failure_ttl=settings.result_ttl_s)
