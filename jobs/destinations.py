"""The outbound-URL guard: resolve a URL's host, refuse non-public addresses, connect to the vetted one.

Used wherever mlxq calls a URL a client gave it (webhooks, image_url parts), so a client cannot make
the server reach loopback, private networks or cloud metadata addresses (SSRF). The connection is
made to the address that was checked, so DNS cannot answer differently between check and use.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from urllib.parse import urlsplit


class UnsafeDestination(ValueError):
    """A URL that is malformed or resolves to an address we refuse to call."""


class UnresolvableHost(UnsafeDestination):
    """A URL whose host name does not resolve (a lookup failure rather than a refusal)."""


def is_public(address: str) -> bool:
    """Whether an IP address is a public unicast one (not loopback, private, link-local, reserved...)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone id
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    # is_global is False for private, loopback, link-local, reserved, shared (CGNAT) and documentation
    # ranges; the explicit checks keep the intent readable and cover multicast, which can be "global".
    return ip.is_global and not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved
                                 or ip.is_multicast or ip.is_unspecified)


def check_destination(url: str, allow_private: bool) -> list[str]:
    """Resolve the URL's host; return its addresses, or raise UnsafeDestination saying why."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeDestination("must be an http:// or https:// URL with a host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError) as exc:
        raise UnresolvableHost(f"host {parts.hostname!r} cannot be resolved ({exc})") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not allow_private:
        blocked = [a for a in addresses if not is_public(a)]
        if blocked:
            raise UnsafeDestination(f"host {parts.hostname!r} resolves to a non-public address ({blocked[0]})")
    return addresses


class PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a vetted IP address, with SNI and certificate checks against the URL's host name."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self._address = address

    def connect(self):
        """Connect to the pinned address instead of resolving the host again."""
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


class PinnedHTTPConnection(http.client.HTTPConnection):
    """Plain HTTP to a vetted IP address, sending the URL's host in the Host header."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self):
        """Connect to the pinned address instead of resolving the host again."""
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


def pinned_connection(url: str, address: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """An unopened connection for `url` that will connect to `address`, and the request target (path?query)."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    cls = PinnedHTTPSConnection if https else PinnedHTTPConnection
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return cls(parts.hostname, address, port, timeout), target
