"""The per-app clients (Redis, the event hub), kept in app.extensions["mlxq"]."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import redis
from flask import current_app

from jobs import limits
from jobs.connection import get_redis
from jobs.settings import Settings
from jobs.subscriber import EventHub


@dataclass
class Services:
    """What views need, built once per app (the hub lazily, after gunicorn forks)."""

    settings: Settings
    started_at: float = field(default_factory=time.time)
    _hub: EventHub | None = None
    _routes: tuple | None = None  # (expires, live workers' states): web/routing.py
    _lock: threading.Lock = field(default_factory=threading.Lock)
    key_limits: dict = field(default_factory=dict)  # MLXQ_KEY_LIMITS's entries (jobs.limits), read once

    def __post_init__(self):
        self.key_limits = limits.load_file(self.settings.key_limits)  # a bad file stops the app from starting

    @property
    def redis(self):
        """This process's Redis client."""
        return get_redis(self.settings.redis_url)

    @property
    def hub(self) -> EventHub:
        """The process's single pub/sub fan-out."""
        with self._lock:
            if self._hub is None:
                self._hub = EventHub(self.redis)
            return self._hub

    def close(self) -> None:
        """Stop the event hub, if it was started (an app that is done with, such as a test's)."""
        if self._hub is not None:
            self._hub.close()

    def warm(self, wait_s: float = 2.0) -> bool:
        """Before the first call: the hub subscribed and a Redis connection open (whether both are, within
        `wait_s`; a Redis that is down now is no reason not to serve, the calls will wait for it as usual)."""
        try:
            self.redis.ping()
        except (redis.ConnectionError, redis.TimeoutError):
            return False
        return self.hub.start(wait_s)


def services() -> Services:
    """The current app's Services."""
    return current_app.extensions["mlxq"]
