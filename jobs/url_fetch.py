"""GET a URL a client gave: through the destination guard, streamed into a file, capped, within one deadline.

Used for image_url parts (the web tier, into memory) and for `file_url` audio (the worker, into the
spool). A fetch connects only to addresses jobs.destinations vets (again at every redirect), sends no
cookies, asks for no compression (so the bytes counted are the bytes stored), stops reading as soon as
the body passes the size limit, and gives up at one overall deadline: a watchdog shuts the socket, so
even a server sending a byte every few seconds cannot hold the fetcher longer.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

from jobs.destinations import UnresolvableHost, UnsafeDestination, check_destination, pinned_connection

MAX_REDIRECTS = 3
"""Most redirects followed for one URL."""

REDIRECTS = (301, 302, 303, 307, 308)
READ_CHUNK_BYTES = 64 * 1024


class FetchFailed(Exception):
    """A fetch that did not bring the body: `kind` is "unsafe" (the guard refused an address or scheme),
    "too_large", "timeout" or "failed" (anything else: HTTP status, connection, redirects)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def parses(url: str) -> bool:
    """Whether `url` parses, port included (a bad IPv6 literal or port raises ValueError)."""
    try:
        return (urlsplit(url).port or 0) >= 0
    except ValueError:
        return False


def fetch(url: str, sink: BinaryIO, *, limit: int, limit_text: str, allow_private: bool, timeout_s: float,
          user_agent: str, what: str, accept: str = "*/*", read_timeout_s: float | None = None,
          on_chunk: Callable[[int, int | None], None] | None = None) -> None:
    """Write the body `url` names into `sink` (at most `limit` bytes, else too_large naming `limit_text`),
    following at most MAX_REDIRECTS redirects, each vetted by the guard; all of it within `timeout_s`.

    `what` names the thing in messages ("the image"); `read_timeout_s` bounds each wait for bytes (default:
    the whole deadline); `on_chunk(bytes_so_far, declared_length)` is called after each piece is written
    (it may raise to stop the fetch).
    """
    failed = f"{what} could not be fetched"
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        try:
            address = check_destination(url, allow_private)[0]
        except UnresolvableHost as exc:
            raise FetchFailed("failed", f"{failed}: {exc}") from None
        except UnsafeDestination as exc:
            raise FetchFailed("unsafe", f"{what}'s URL is refused: {exc}") from None
        status, location = _get(url, address, sink, deadline, timeout_s, limit, limit_text, user_agent, accept,
                                read_timeout_s, on_chunk, what)
        if status in REDIRECTS:
            if not location:
                raise FetchFailed("failed", f"{failed}: the server answered HTTP {status} without a Location")
            url = urljoin(url, location)
            if not parses(url):  # the guard refuses what parses but is not http(s) with a host
                raise FetchFailed("failed", f"{failed}: the server redirected to a malformed URL "
                                            f"({location[:200]!r})")
            continue
        if not 200 <= status < 300:
            raise FetchFailed("failed", f"{failed}: the server answered HTTP {status}")
        return
    raise FetchFailed("failed", f"{failed}: too many redirects (more than {MAX_REDIRECTS})")


def _get(url: str, address: str, sink: BinaryIO, deadline: float, timeout_s: float, limit: int, limit_text: str,
         user_agent: str, accept: str, read_timeout_s: float | None, on_chunk, what: str) -> tuple[int, str | None]:
    """One GET to the vetted `address`: (status, Location); the body is written to `sink` only on a 2xx."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timed_out(what, timeout_s)
    conn, target = pinned_connection(url, address, min(remaining, read_timeout_s or remaining))
    watchdog = _Watchdog(remaining)
    response = None
    try:
        conn.connect()
        watchdog.watch(conn.sock)
        # (http.client asks for Accept-Encoding: identity on its own: no compressed bodies.)
        conn.request("GET", target, headers={"User-Agent": user_agent, "Accept": accept})
        response = conn.getresponse()
        if 200 <= response.status < 300:
            _read_capped(response, sink, limit, limit_text, on_chunk, what)
        if watchdog.fired.is_set():  # the socket was shut at the deadline: what was read may be cut short
            raise _timed_out(what, timeout_s)
        return response.status, response.getheader("Location")
    # socket.timeout is an OSError; ValueError: a URL http.client cannot send (non-ASCII, control characters)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if watchdog.fired.is_set() or isinstance(exc, TimeoutError):
            raise _timed_out(what, timeout_s) from None
        raise FetchFailed("failed", f"{what} could not be fetched: {exc!r}") from None
    finally:
        watchdog.cancel()
        if response is not None:
            response.close()  # it holds the socket once the connection hands it over (Connection: close)
        conn.close()


def _read_capped(response: http.client.HTTPResponse, sink: BinaryIO, limit: int, limit_text: str,
                 on_chunk, what: str) -> None:
    """Copy the body into `sink`, refusing it (and reading no further) once it passes `limit` bytes."""
    header = response.getheader("Content-Length", "")
    declared = int(header) if header.isdigit() else None
    if declared is not None and declared > limit:
        raise FetchFailed("too_large", f"{what} is larger than {limit_text} (it declares {declared} bytes)")
    done = 0
    while chunk := response.read(min(READ_CHUNK_BYTES, limit + 1 - done)):
        done += len(chunk)
        if done > limit:
            raise FetchFailed("too_large", f"{what} is larger than {limit_text}")
        sink.write(chunk)
        if on_chunk is not None:
            on_chunk(done, declared)


class _Watchdog:
    """Shuts a socket when the deadline passes, so a read blocked on a slow server returns at once.

    A socket timeout bounds each read, not their sum: a server sending a byte every few seconds would
    never trip it. (Under gevent the timer is a greenlet, as the web tier runs it.)
    """

    def __init__(self, seconds: float):
        self.fired = threading.Event()
        self._sock: socket.socket | None = None
        self._timer = threading.Timer(seconds, self._shut)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket | None) -> None:
        """Shut `sock` at the deadline (at once if it has passed already)."""
        self._sock = sock
        if self.fired.is_set():
            self._shut()

    def cancel(self) -> None:
        """Stop the timer (the fetch is over)."""
        self._timer.cancel()

    def _shut(self) -> None:
        self.fired.set()
        if self._sock is not None:
            try:  # socket.socket's own shutdown, also for an SSL socket: no TLS close_notify exchange
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass


def _timed_out(what: str, timeout_s: float) -> FetchFailed:
    """The error for a fetch that passed its deadline."""
    return FetchFailed("timeout", f"fetching {what} timed out after {timeout_s:g} s")
