"""The bytes of an image_url: a data URL decoded, or an http(s) URL fetched through the destination guard
(jobs/url_fetch.py: redirects vetted, size capped as the body arrives, one overall deadline, so even a
server sending a byte every few seconds cannot hold a web worker longer).
"""

from __future__ import annotations

import base64
import binascii
import io
from urllib.parse import urlsplit

from jobs import url_fetch

USER_AGENT = "mlxq-image-fetch/1"
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
        if not url_fetch.parses(url) or not urlsplit(url).hostname:
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
    """GET an image URL through jobs.url_fetch (redirects vetted, size capped, one deadline)."""
    body = io.BytesIO()
    try:
        url_fetch.fetch(url, body, limit=limit, limit_text=limit_text,
                        allow_private=settings.image_fetch_allow_private, timeout_s=settings.image_fetch_timeout_s,
                        user_agent=USER_AGENT, what="the image", accept="image/*")
    except url_fetch.FetchFailed as exc:
        code = {"unsafe": "unsafe_image_url", "too_large": "image_too_large"}.get(exc.kind, "image_fetch_failed")
        hint = " (MLXQ_IMAGE_FETCH_TIMEOUT_S)" if exc.kind == "timeout" else ""
        raise PartRefused(code, f"{exc}{hint}") from None
    return body.getvalue()
