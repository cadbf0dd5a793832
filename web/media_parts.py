"""Image and audio parts of chat messages: fetched or decoded, checked, and spooled before anything is queued.

Every `image_url` and `input_audio` part of a request is written to `<spool_dir>/<job_id>/` (as
`image-<n>.<ext>` or `audio-<n>.<ext>`, the original bytes) and described by a SpooledPart; nothing
goes into Redis. A part that cannot be used is answered 400 with a code and the part's `param`, and
everything already spooled for the request is removed.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from flask import request
from PIL import Image, UnidentifiedImageError

from jobs.spool import discard, job_dir
from web.audio_check import check_audio
from web.errors import APIError
from web.image_fetch import PartRefused, decoded_size, image_bytes
from web.services import services

MIB = 1024 * 1024

EXTENSIONS = {"JPEG": "jpg", "PNG": "png", "GIF": "gif", "WEBP": "webp", "BMP": "bmp"}
"""The image formats accepted (Pillow's names) and the extension each is spooled with."""

AUDIO_BODY_BYTES = 25 * MIB
"""Room in a chat request body for the base64 of its input_audio parts (see chat_body_limit)."""

MEDIA_PARTS_SLACK = 256
"""Media parts whose own quotes and comma (two quotes, a data URL's comma) the early size check allows for."""

_AUDIO_EXTENSION = re.compile(r"^[a-z0-9]{1,8}$")


@dataclass(frozen=True)
class SpooledPart:
    """One image or audio part of a chat request, checked and written to the spool."""

    kind: str  # "image" | "audio"
    message_index: int  # index in `messages`
    part_index: int  # index in that message's content list
    path: Path  # <spool_dir>/<job_id>/image-<n>.<ext> or audio-<n>.<ext>
    format: str  # image: Pillow's format name ("PNG", "JPEG", ...); audio: the container ("wav", "mp3", ...)
    nbytes: int
    width: int = 0  # images
    height: int = 0
    duration_s: float = 0.0  # audio


def spool_parts(messages: list[dict], job_id: str, settings) -> list[SpooledPart]:
    """Fetch or decode, check and spool every image_url / input_audio part, in document order."""
    parts = list(media_parts(messages))
    if not parts:
        return []
    directory = job_dir(settings.spool_dir, job_id)
    if directory is None:
        raise ValueError(f"not a job id: {job_id!r}")
    try:
        _check_counts(parts, settings)
        directory.mkdir(parents=True, exist_ok=True)
        return _spool_all(parts, directory, settings)
    except BaseException:
        discard(settings.spool_dir, job_id)
        raise


def media_parts(messages: list[dict]):
    """(message index, part index, part) of every image_url and input_audio part, in document order."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") in ("image_url", "input_audio"):
                    yield i, j, part


def _param(i: int, j: int, part: dict) -> str:
    """The request field a part's error names."""
    field = "image_url.url" if part["type"] == "image_url" else "input_audio.data"
    return f"messages[{i}].content[{j}].{field}"


def _check_counts(parts: list, settings) -> None:
    """Refuse too many images or audio parts before fetching anything; the error names the first extra."""
    limits = {"image_url": (settings.max_images, "too_many_images", "images", "MLXQ_MAX_IMAGES"),
              "input_audio": (settings.max_audio_parts, "too_many_audio_parts", "audio parts",
                              "MLXQ_MAX_AUDIO_PARTS")}
    seen = {"image_url": 0, "input_audio": 0}
    for i, j, part in parts:
        seen[part["type"]] += 1
        limit, code, what, env = limits[part["type"]]
        if seen[part["type"]] > limit:
            raise APIError(400, f"Too many {what} in one request: at most {limit} ({env}).", code,
                           _param(i, j, part))


def _spool_all(parts: list, directory: Path, settings) -> list[SpooledPart]:
    """Spool each part in turn; a refused part becomes the API's 400 naming it."""
    spooled: list[SpooledPart] = []
    for i, j, part in parts:
        images = [s for s in spooled if s.kind == "image"]
        try:
            if part["type"] == "image_url":
                used = sum(s.nbytes for s in images)
                item = _spool_image(part["image_url"]["url"], (i, j), directory / f"image-{len(images)}", used,
                                    settings)
            else:
                stem = directory / f"audio-{len(spooled) - len(images)}"
                item = _spool_audio(part["input_audio"], (i, j), stem, settings)
        except PartRefused as exc:
            raise APIError(400, f"messages[{i}].content[{j}]: {exc}", exc.code, _param(i, j, part)) from None
        spooled.append(item)
    return spooled


def _spool_image(url: str, where: tuple[int, int], stem: Path, used: int, settings) -> SpooledPart:
    """Get an image's bytes, check them, and write them as `<stem>.<ext>`."""
    limit, limit_text = _image_limit(settings, used)
    data = image_bytes(url, limit, limit_text, settings)
    fmt, width, height = inspect_image(data, settings.max_image_pixels)
    path = stem.with_name(f"{stem.name}.{EXTENSIONS[fmt]}")
    path.write_bytes(data)  # the original bytes: no re-encoding
    return SpooledPart("image", *where, path, fmt, len(data), width, height)


def _image_limit(settings, used: int) -> tuple[int, str]:
    """The most bytes the next image may have (`used` bytes of images already taken), and that limit in words."""
    each = settings.max_image_mb * MIB
    left = max(0, settings.max_images_mb * MIB - used)
    if left < each:
        return left, (f"what is left ({left} bytes) of the limit of {settings.max_images_mb} MB for all images "
                      "of a request (MLXQ_MAX_IMAGES_MB)")
    return each, f"the limit of {settings.max_image_mb} MB per image (MLXQ_MAX_IMAGE_MB)"


def inspect_image(data: bytes, max_pixels: int) -> tuple[str, int, int]:
    """(format, width, height) of an image: pixels counted from its header, then its data checked whole."""
    with warnings.catch_warnings():
        # Pillow warns about large images, and raises DecompressionBombError above twice its own limit:
        # our limit decides, and neither may escape as a 500.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=list(EXTENSIONS)) as image:
                fmt, (width, height) = image.format, image.size
                if width * height > max_pixels:
                    raise PartRefused("image_too_large", f"the image has {width}x{height} pixels, more than the "
                                                         f"limit of {max_pixels} (MLXQ_MAX_IMAGE_PIXELS)")
                _verify(image)
        except PartRefused:
            raise
        except Image.DecompressionBombError:
            raise PartRefused("image_too_large", f"the image has more pixels than the limit of {max_pixels} "
                                                 "(MLXQ_MAX_IMAGE_PIXELS)") from None
        except UnidentifiedImageError:
            raise PartRefused("invalid_image", f"{_unsupported(data)}: send a JPEG, PNG, GIF, WebP or BMP "
                                               "image") from None
        except Exception as exc:  # Pillow reports bad data as OSError, SyntaxError, ValueError, EOFError...
            raise PartRefused("invalid_image", f"corrupt or truncated image data ({exc})") from None
    return fmt, width, height


def _verify(image: Image.Image) -> None:
    """Check the image data is whole, decoding as little as the format allows."""
    if image.format == "PNG":
        image.verify()  # every chunk's CRC, through to IEND, without decoding pixels
        return
    if image.format == "JPEG":  # decoding at 1/8 scale still reads every scan, in 1/64 of the memory
        image.draft(None, (max(1, image.width // 8), max(1, image.height // 8)))
    image.load()  # GIF (first frame), WebP and BMP: a full decode, within max_image_pixels


def _unsupported(data: bytes) -> str:
    """Why Pillow could not open the data as an accepted format: another format, or not an image."""
    try:
        with Image.open(io.BytesIO(data)) as other:
            return f"{other.format} images are not supported"
    except Exception:  # only naming the problem: any failure means "not an image"
        return "the data is not an image"


def _spool_audio(audio: dict, where: tuple[int, int], stem: Path, settings) -> SpooledPart:
    """Decode an input_audio part, write it as `<stem>.<format>`, and probe it."""
    payload = audio["data"]
    if decoded_size(payload) > settings.max_upload_mb * MIB:
        raise PartRefused("audio_too_large", f"the audio is larger than the limit of {settings.max_upload_mb} MB "
                                             "(MLXQ_MAX_UPLOAD_MB)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise PartRefused("invalid_audio", "the audio's base64 data is malformed") from None
    fmt = (audio.get("format") or "").lower()
    path = stem.with_name(f"{stem.name}.{fmt if _AUDIO_EXTENSION.match(fmt) else 'bin'}")
    path.write_bytes(data)
    try:
        info = check_audio(path, path.name, settings.max_audio_s)
    except APIError as exc:
        code = "audio_too_large" if exc.extra.get("reason") == "too_long" else "invalid_audio"
        raise PartRefused(code, exc.message) from None
    return SpooledPart("audio", *where, path, info.container, len(data), duration_s=info.duration_s)


def check_text_size(messages: list[dict], settings) -> None:
    """413 for a chat body whose text alone passes max_body_kb: only image and audio data get more room."""
    data = [part["image_url"]["url"] if part["type"] == "image_url" else part["input_audio"]["data"]
            for _, _, part in media_parts(messages)]
    # In the body, base64's slashes may have been written escaped ("\/"): count each as two bytes.
    _refuse_text_over(len(request.get_data(cache=True)) - sum(len(text) + text.count("/") for text in data),
                      settings)


def _refuse_text_over(size: int, settings) -> None:
    """413 when `size` (bytes of a chat body that are not image or audio data) passes max_body_kb."""
    limit = settings.max_body_kb * 1024
    if size > limit:
        raise APIError(413, f"Request body too large: besides its image and audio data, a chat body may have at "
                            f"most {limit} bytes (MLXQ_MAX_BODY_KB).", "request_too_large")


def chat_body_limit(settings) -> int:
    """The largest chat request body, in bytes: max_body_kb, plus max_images_mb as base64 (4/3 of it),
    plus a fixed 25 MiB (AUDIO_BODY_BYTES) of base64 for input_audio parts, about 18.7 MiB of audio."""
    return settings.max_body_kb * 1024 + math.ceil(settings.max_images_mb * MIB * 4 / 3) + AUDIO_BODY_BYTES


def accepts_media_parts(view):
    """Decorate a chat view: its body may be chat_body_limit bytes (above that 413, before reading).

    Put it under `@blp.route` and above `@blp.arguments`, so the limit is set before the body is parsed.
    A body larger than max_body_kb is looked at before it is parsed: its image and audio data (base64)
    hold no commas or quotes, so more of those than max_body_kb is text or structure beyond the limit,
    refused at C speed. Parsing it would hold the process's event loop (every other request it serves)
    for seconds; intake then checks the text's size exactly (check_text_size).
    """

    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        settings = services().settings
        limit = chat_body_limit(settings)
        # Flask 3.1: a per-request limit, replacing the app-wide MAX_CONTENT_LENGTH for this request only.
        # A chunked body is cut off by werkzeug when it passes it.
        request.max_content_length = limit
        if request.content_length is not None and request.content_length > limit:
            raise APIError(413, f"Request body too large (limit {limit} bytes).", "request_too_large")
        if request.content_length is None or request.content_length > settings.max_body_kb * 1024:
            body = request.get_data(cache=True)
            if len(body) > settings.max_body_kb * 1024:
                _refuse_text_over(body.count(b",") + body.count(b'"') - 3 * MEDIA_PARTS_SLACK, settings)
        return view(*args, **kwargs)

    return wrapper
