"""The Redis connection: one client (with its pool) per process and URL, never one per access."""

from __future__ import annotations

import threading

import redis

_clients: dict[str, redis.Redis] = {}
_lock = threading.Lock()


def get_redis(url: str) -> redis.Redis:
    """Return this process's shared Redis client for `url` (bytes responses, as RQ needs)."""
    client = _clients.get(url)
    if client is None:
        with _lock:
            client = _clients.get(url)
            if client is None:
                client = redis.Redis.from_url(
                    url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=30
                )
                _clients[url] = client
    return client


def reset_clients() -> None:
    """Drop cached clients (after fork, or between tests that restart Redis)."""
    with _lock:
        for client in _clients.values():
            client.close()
        _clients.clear()
