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


class SentCommands:
    """Commands sent to Redis now, on a connection held from the pool, whose replies are read later.

    Nothing else reads or writes on that connection until the replies are read (or discarded), so
    a sender can go on with its work instead of waiting a round trip.
    """

    def __init__(self, pool: redis.ConnectionPool, commands: list[tuple]):
        self._pool = pool
        self._connection = pool.get_connection()
        try:
            self._connection.send_packed_command(self._connection.pack_commands(commands))
        except BaseException:
            self._release(broken=True)
            raise

    @property
    def pending(self) -> bool:
        """Whether the replies are still unread."""
        return self._connection is not None

    def discard(self) -> None:
        """Give the connection back without reading the replies (when leaving on an error)."""
        if self._connection is not None:
            self._release(broken=True)

    def _read_replies(self, count: int) -> list:
        """Read `count` replies, then give the connection back; raise a reply's error."""
        if self._connection is None:
            raise redis.ConnectionError("the replies were lost with their connection")
        try:
            replies = [self._connection.read_response() for _ in range(count)]
        except BaseException:
            self._release(broken=True)  # replies may still come, on a connection nobody reads
            raise
        self._release(broken=False)
        return replies

    def _release(self, broken: bool) -> None:
        connection, self._connection = self._connection, None
        if broken:
            connection.disconnect()
        self._pool.release(connection)
