"""The Redis connection: one client (with its pool) per process, URL and policy; never one per access.

Two policies. The web tier fails fast: a request it cannot queue is answered 503 at once, and the
client retries. The worker rides out a Redis restart: every command is retried with backoff for up
to about a minute (its events are published idempotently, jobs.events), so a job in progress
carries on instead of the worker giving up on it.
"""

from __future__ import annotations

import threading

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

PATIENT_RETRIES = 40
"""Retries of a worker's command when Redis is unreachable: 0.05 s doubling up to 2 s, ~70 s in all."""

_clients: dict[tuple[str, bool], redis.Redis] = {}
_lock = threading.Lock()


def get_redis(url: str, patient: bool = False) -> redis.Redis:
    """Return this process's shared Redis client for `url` (bytes responses, as RQ needs).

    `patient`: retry each command for about a minute when Redis is unreachable (the worker).
    """
    key = (url, patient)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = _make_client(url, patient)
                _clients[key] = client
    return client


def _make_client(url: str, patient: bool) -> redis.Redis:
    options = {"socket_connect_timeout": 2, "socket_timeout": 10, "health_check_interval": 30}
    if patient:
        options.update(retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), PATIENT_RETRIES),
                       retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    else:
        options.update(retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), 1))
    return redis.Redis.from_url(url, **options)


def reset_clients() -> None:
    """Drop cached clients (after fork, or between tests that restart Redis)."""
    with _lock:
        for client in _clients.values():
            client.close()
        _clients.clear()
