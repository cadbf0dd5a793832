"""The bytes of an image_url: a data URL decoded, or an http(s) URL fetched through the destination guard.

A fetch connects only to addresses jobs.destinations vets (again at every redirect), sends no
cookies, asks for no compression (so the bytes counted are the bytes stored), stops reading as soon
as the body passes the size limit, and gives up at one overall deadline: a watchdog shuts the
socket, so even a server sending a byte every few seconds cannot hold a web worker longer.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import socket
import threading
import time
from urllib.parse import urljoin, urlsplit

from jobs.destinations import UnresolvableHost, UnsafeDestination, check_destination, pinned_connection

MAX_REDIRECTS = 3
"""Most redirects followed for one image URL."""

REDIRECTS = (301, 302, 303, 307, 308)
USER_AGENT = "mlxq-image-fetch/1"
READ_CHUNK_BYTES = 64 * 1024
_MAX_DATA_HEADER = 256  # "data:image/png;base64" and a few parameters; anything longer is not a data URL


class PartRefused(Exception):
    """A content part refused with an API error `code` (the caller adds the part's param)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def image_bytes(url: str, limit: int, limit_text: str, settings) -> bytes:
    """The bytes an image_url names: at most `limit` of them, else image_too_large naming `limit_text`."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return decode_data_url(url, limit, limit_text)
    if scheme in ("http", "https"):
        if not _parses(url) or not urlsplit(url).hostname:
            raise PartRefused("invalid_image_url", "the image URL is malformed or has no host")
        return fetch(url, limit, limit_text, settings)
    raise PartRefused("invalid_image_url", "the image URL must be a data:image/...;base64 URL or an http(s) URL")


def decode_data_url(url: str, limit: int, limit_text: str) -> bytes:
    """Decode `data:image/<type>[;params];base64,<data>` strictly; its size is checked before decoding."""
    header, comma, payload = url[5:].partition(",")
    media = header.split(";")
    if not comma or len(header) > _MAX_DATA_HEADER or not media[0].lower().startswith("image/") \
            or media[-1].lower() != "base64":
        raise PartRefused("invalid_image_url", "malformed data URL: expected data:image/<type>;base64,<data>")
    if decoded_size(payload) > limit:
        raise PartRefused("image_too_large", f"the image is larger than {limit_text}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):  # ValueError: non-ASCII characters
        raise PartRefused("invalid_image_url", "the data URL's base64 data is malformed") from None
    if not data:
        raise PartRefused("invalid_image", "the data URL holds no data")
    return data


def decoded_size(payload: str) -> int:
    """The number of bytes a base64 string decodes to (what it would be if it is valid)."""
    return len(payload) * 3 // 4 - payload[-2:].count("=")


def fetch(url: str, limit: int, limit_text: str, settings) -> bytes:
    """GET an image URL, following at most MAX_REDIRECTS redirects, each one vetted by the guard."""
    timeout_s = settings.image_fetch_timeout_s
    deadline = time.monotonic() + timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        try:
            address = check_destination(url, settings.image_fetch_allow_private)[0]
        except UnresolvableHost as exc:
            raise PartRefused("image_fetch_failed", f"the image could not be fetched: {exc}") from None
        except UnsafeDestination as exc:
            raise PartRefused("unsafe_image_url", f"the image URL is refused: {exc}") from None
        status, location, body = _get(url, address, limit, limit_text, deadline, timeout_s)
        if status in REDIRECTS:
            if not location:
                raise PartRefused("image_fetch_failed", f"the image server answered HTTP {status} without a "
                                                        "Location")
            url = urljoin(url, location)
            if not _parses(url):  # the guard refuses what parses but is not http(s) with a host
                raise PartRefused("image_fetch_failed", f"the image server redirected to a malformed URL "
                                                        f"({location[:200]!r})")
            continue
        if not 200 <= status < 300:
            raise PartRefused("image_fetch_failed", f"the image server answered HTTP {status}")
        return body
    raise PartRefused("image_fetch_failed", f"too many redirects (more than {MAX_REDIRECTS})")


def _parses(url: str) -> bool:
    """Whether `url` parses, port included (a bad IPv6 literal or port raises ValueError)."""
    try:
        return (urlsplit(url).port or 0) >= 0
    except ValueError:
        return False


def _get(url: str, address: str, limit: int, limit_text: str, deadline: float,
         timeout_s: float) -> tuple[int, str | None, bytes]:
    """One GET to the vetted `address`: (status, Location, body); the body is read only on a 2xx."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timed_out(timeout_s)
    conn, target = pinned_connection(url, address, remaining)
    watchdog = _Watchdog(remaining)
    response = None
    try:
        conn.connect()
        watchdog.watch(conn.sock)
        conn.request("GET", target, headers={"User-Agent": USER_AGENT, "Accept": "image/*"})
        response = conn.getresponse()
        body = _read_capped(response, limit, limit_text) if 200 <= response.status < 300 else b""
        if watchdog.fired.is_set():  # the socket was shut at the deadline: what was read may be cut short
            raise _timed_out(timeout_s)
        return response.status, response.getheader("Location"), body
    # socket.timeout is an OSError; ValueError: a URL http.client cannot send (non-ASCII, control characters)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if watchdog.fired.is_set() or isinstance(exc, TimeoutError):
            raise _timed_out(timeout_s) from None
        raise PartRefused("image_fetch_failed", f"the image could not be fetched: {exc!r}") from None
    finally:
        watchdog.cancel()
        if response is not None:
            response.close()  # it holds the socket once the connection hands it over (Connection: close)
        conn.close()


def _read_capped(response: http.client.HTTPResponse, limit: int, limit_text: str) -> bytes:
    """Read the body, refusing it (and reading no further) once it passes `limit` bytes."""
    declared = response.getheader("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PartRefused("image_too_large", f"the image is larger than {limit_text} (it declares "
                                             f"{int(declared)} bytes)")
    body = bytearray()
    while chunk := response.read(min(READ_CHUNK_BYTES, limit + 1 - len(body))):
        body += chunk
        if len(body) > limit:
            raise PartRefused("image_too_large", f"the image is larger than {limit_text}")
    return bytes(body)


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


def _timed_out(timeout_s: float) -> PartRefused:
    """The error for a fetch that passed its deadline."""
    return PartRefused("image_fetch_failed", f"fetching the image timed out after {timeout_s:g} s "
                                             "(MLXQ_IMAGE_FETCH_TIMEOUT_S)")
