"""Image and audio parts of chat messages: decoded or fetched, checked, spooled, and refused with clear 400s."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
import time
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image
from werkzeug.test import EnvironBuilder

from jobs import destinations
from tests.conftest import REPO
from tests.web.test_uploads import TrackingStream
from web.app import create_app
from web.errors import APIError
from web.media_parts import MIB, chat_body_limit, spool_parts

SPEECH = REPO / "tests" / "fixtures" / "speech"
JOB = "job-media"


def picture(fmt: str, size=(16, 12), mode="RGB") -> bytes:
    """A small image in `fmt`, made by Pillow."""
    buffer = io.BytesIO()
    Image.new(mode, size, (200, 30, 60)).save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    """`data` as a base64 data URL."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    """An image_url content part."""
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def user(*parts) -> dict:
    """A user message with a text part followed by `parts`."""
    return {"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}


def png_header_only(width: int, height: int) -> bytes:
    """A PNG declaring width x height RGB pixels, with a little IDAT: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * (1 + 3 * 1000))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def refused(messages, settings) -> APIError:
    """Call spool_parts expecting a refusal; check the job's spool directory is gone; return the error."""
    with pytest.raises(APIError) as info:
        spool_parts(messages, JOB, settings)
    assert info.value.status == 400
    assert not (settings.spool_dir / JOB).exists()
    return info.value


# -- data URLs ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_each_format_is_spooled_as_sent(settings, fmt):
    data = picture(fmt)
    parts = spool_parts([user(image_part(data_url(data, "image/whatever")))], JOB, settings)
    assert len(parts) == 1
    part = parts[0]
    assert (part.kind, part.format, part.width, part.height, part.nbytes) == ("image", fmt, 16, 12, len(data))
    assert (part.message_index, part.part_index) == (0, 1)
    assert part.path.parent == settings.spool_dir / JOB
    assert part.path.name == f"image-0.{ {'JPEG': 'jpg'}.get(fmt, fmt.lower()) }".replace(" ", "")
    assert part.path.read_bytes() == data  # the original bytes, not re-encoded


def test_two_images_in_two_messages_in_order(settings):
    first, second = picture("PNG", (10, 10)), picture("JPEG", (20, 30))
    messages = [user(image_part(data_url(first))), {"role": "assistant", "content": "ok"},
                user(image_part(data_url(second, "image/jpeg")))]
    parts = spool_parts(messages, JOB, settings)
    assert [(p.message_index, p.part_index, p.format, p.path.name) for p in parts] == [
        (0, 1, "PNG", "image-0.png"), (2, 1, "JPEG", "image-1.jpg")]
    assert parts[1].path.read_bytes() == second


def test_no_media_parts_spools_nothing(settings):
    assert spool_parts([{"role": "user", "content": "hi"}, user()], JOB, settings) == []
    assert not (settings.spool_dir / JOB).exists()


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "file:///etc/passwd", "data:image/png,iVBOR",
                                 "http://[::1/a.png", "https://host:99999/a.png", "http:///a.png",
                                 "data:text/plain;base64,aGVsbG8=", "data:image/png;base64,@@@@"])
def test_bad_urls_are_invalid_image_url(settings, url):
    error = refused([user(image_part(url))], settings)
    assert error.code == "invalid_image_url"
    assert error.param == "messages[0].content[1].image_url.url"


@pytest.mark.parametrize("data, named", [
    (b"just some text, not an image", "not an image"),
    (b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "not an image"),
    (picture("TIFF"), "TIFF images are not supported"),
])
def test_non_images_and_unsupported_formats_are_invalid_image(settings, data, named):
    error = refused([user(image_part(data_url(data)))], settings)
    assert error.code == "invalid_image" and named in error.message


def test_corrupt_png_is_invalid_image(settings):
    data = bytearray(picture("PNG", (64, 64)))
    data[data.index(b"IDAT") + 10] ^= 0xFF  # flip a byte of the pixel data: the chunk's CRC no longer matches
    error = refused([user(image_part(data_url(bytes(data))))], settings)
    assert error.code == "invalid_image" and "corrupt" in error.message


def test_truncated_jpeg_is_invalid_image(settings):
    data = picture("JPEG", (256, 256))
    error = refused([user(image_part(data_url(data[: len(data) // 2], "image/jpeg")))], settings)
    assert error.code == "invalid_image"


def test_oversized_data_url_is_refused_before_decoding(settings):
    small = settings.with_overrides(max_image_mb=1)
    # Not even base64: a refusal for size proves the size was checked first.
    error = refused([user(image_part("data:image/png;base64," + "!" * (2 * MIB)))], small)
    assert error.code == "image_too_large" and "MLXQ_MAX_IMAGE_MB" in error.message


def test_too_many_images(settings):
    url = data_url(picture("PNG"))
    messages = [user(*[image_part(url)] * 3), user(*[image_part(url)] * 3)]
    error = refused(messages, settings)
    assert error.code == "too_many_images" and "at most 5" in error.message
    assert error.param == "messages[1].content[3].image_url.url"  # the sixth image


def test_images_over_the_total_limit(settings):
    limited = settings.with_overrides(max_image_mb=1, max_images_mb=2)
    bmp = picture("BMP", (500, 500))  # 750 kB each: two fit in 2 MB, three do not
    url = data_url(bmp, "image/bmp")
    error = refused([user(image_part(url)), user(image_part(url), image_part(url))], limited)
    assert error.code == "image_too_large" and "MLXQ_MAX_IMAGES_MB" in error.message
    assert error.param == "messages[1].content[2].image_url.url"


def test_pixels_over_the_limit(settings):
    error = refused([user(image_part(data_url(picture("PNG", (20, 20)))))],
                    settings.with_overrides(max_image_pixels=399))
    assert error.code == "image_too_large" and "20x20" in error.message


def _peak_growth_kb(action) -> int:
    """How far this process's peak resident memory grew above its current size while `action` ran."""
    def status(key: str) -> int:
        line = next(line for line in open("/proc/self/status") if line.startswith(key))
        return int(line.split()[1])

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (the peak) to the current resident size
    before = status("VmRSS:")
    action()
    return status("VmHWM:") - before


def test_decompression_bomb_is_refused_from_its_header(settings):
    url = data_url(png_header_only(60_000, 60_000))  # 3.6 billion pixels; 10 GB decoded
    errors = []

    def attempt():
        try:
            spool_parts([user(image_part(url))], JOB, settings)
        except APIError as exc:
            errors.append(exc)

    growth_kb = _peak_growth_kb(attempt)
    assert [e.code for e in errors] == ["image_too_large"]
    assert growth_kb < 20 * 1024
    assert not (settings.spool_dir / JOB).exists()


def test_pillow_bomb_warning_does_not_escape(settings):
    url = data_url(png_header_only(10_000, 10_000))  # above Pillow's warning size, under its error size
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        error = refused([user(image_part(url))], settings)
    assert error.code == "image_too_large" and "10000x10000" in error.message


# -- input_audio -----------------------------------------------------------------------------------------

def audio_part(data: bytes | str, fmt: str = "wav") -> dict:
    """An input_audio content part."""
    payload = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": payload, "format": fmt}}


def test_wav_audio_is_spooled_and_probed(settings):
    wav = (SPEECH / "garden.wav").read_bytes()
    png = picture("PNG")
    parts = spool_parts([user(audio_part(wav), image_part(data_url(png)))], JOB, settings)
    audio, image = parts
    assert (audio.kind, audio.format, audio.nbytes, audio.path.name) == ("audio", "wav", len(wav), "audio-0.wav")
    assert audio.path.read_bytes() == wav
    assert 5 < audio.duration_s < 30
    assert (image.kind, image.part_index, image.path.name) == ("image", 2, "image-0.png")


@pytest.mark.parametrize("payload", [base64.b64encode(b"no audio here " * 200).decode(), "not base64!"])
def test_garbage_audio_is_invalid_audio(settings, payload):
    png = data_url(picture("PNG"))
    error = refused([user(image_part(png), audio_part(payload))], settings)  # the image is removed too
    assert error.code == "invalid_audio" and error.param == "messages[0].content[2].input_audio.data"


def test_audio_over_the_size_limit(settings):
    error = refused([user(audio_part("A" * (2 * MIB)))], settings.with_overrides(max_upload_mb=1))
    assert error.code == "audio_too_large" and "MLXQ_MAX_UPLOAD_MB" in error.message


def test_audio_over_the_duration_limit(settings):
    wav = (SPEECH / "garden.wav").read_bytes()
    error = refused([user(audio_part(wav))], settings.with_overrides(max_audio_s=1.0))
    assert error.code == "audio_too_large"


def test_too_many_audio_parts(settings):
    wav = (SPEECH / "garden.wav").read_bytes()
    error = refused([user(audio_part(wav), audio_part(wav))], settings.with_overrides(max_audio_parts=1))
    assert error.code == "too_many_audio_parts" and error.param == "messages[0].content[2].input_audio.data"


# -- http(s) URLs ----------------------------------------------------------------------------------------

class ImageServer:
    """A real HTTP server on 127.0.0.1 with one path per behaviour the fetcher must handle."""

    def __init__(self):
        self.png = picture("PNG", (8, 8))
        self.stream_stopped = threading.Event()
        self.closing = threading.Event()
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server.requests.append({"path": self.path, **{k.lower(): v for k, v in self.headers.items()}})
                server.answer(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        """The URL of `path` on this server."""
        return f"http://{host}:{self.port}{path}"

    def answer(self, handler: BaseHTTPRequestHandler) -> None:
        """Answer one GET according to its path."""
        path = handler.path
        if path == "/img.png":
            self._send(handler, 200, self.png, "image/png")
        elif path == "/text":
            self._send(handler, 200, b"hello, not an image", "text/plain")
        elif path.startswith("/hop/"):
            left = int(path.rsplit("/", 1)[1])
            handler.send_response(302)
            handler.send_header("Location", f"/hop/{left - 1}" if left > 1 else "../img.png")  # relative
            handler.end_headers()
        elif path.startswith("/to?"):
            handler.send_response(307)
            handler.send_header("Location", path.split("?", 1)[1])
            handler.end_headers()
        elif path == "/declares-big":
            handler.send_response(200)
            handler.send_header("Content-Length", str(100 * MIB))
            handler.end_headers()
        elif path == "/forever":
            self._stream_forever(handler)
        elif path == "/drip":
            self._drip(handler)
        else:
            self._send(handler, 404, b"not found", "text/plain")

    @staticmethod
    def _send(handler, status: int, body: bytes, content_type: str) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _stream_forever(self, handler) -> None:
        """A body with no length that never ends: only the client hanging up stops it."""
        handler.send_response(200)
        handler.send_header("Content-Type", "image/png")
        handler.end_headers()
        chunk = self.png + b"\0" * (64 * 1024)
        try:
            while True:
                handler.wfile.write(chunk)
        except OSError:
            self.stream_stopped.set()

    def _drip(self, handler) -> None:
        """Headers sent a byte every 0.1 s, each read well within a socket timeout, never finishing."""
        try:
            for byte in b"HTTP/1.0 200 OK\r\nX-Slow: " + b"a" * 1000:
                if self.closing.wait(0.1):
                    return
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
        except OSError:
            pass

    def close(self) -> None:
        """Stop serving."""
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server():
    """The image server, shared by this module's tests."""
    srv = ImageServer()
    yield srv
    srv.close()


@pytest.fixture()
def fetching(settings):
    """Settings that allow fetching from 127.0.0.1, with small limits and a short deadline."""
    return settings.with_overrides(image_fetch_allow_private=True, max_image_mb=1, image_fetch_timeout_s=5.0)


def test_fetched_image_is_spooled(server, fetching):
    parts = spool_parts([user(image_part(server.url("/img.png")))], JOB, fetching)
    assert [(p.format, p.nbytes) for p in parts] == [("PNG", len(server.png))]
    assert parts[0].path.read_bytes() == server.png
    sent = server.requests[-1]
    assert sent["user-agent"].startswith("mlxq-image-fetch/") and "cookie" not in sent


def test_redirects_are_followed_up_to_three(server, fetching):
    parts = spool_parts([user(image_part(server.url("/hop/3")))], JOB, fetching)
    assert parts[0].path.read_bytes() == server.png
    error = refused([user(image_part(server.url("/hop/4")))], fetching)
    assert error.code == "image_fetch_failed" and "redirects" in error.message


def test_not_found_is_image_fetch_failed(server, fetching):
    error = refused([user(image_part(server.url("/missing.png")))], fetching)
    assert error.code == "image_fetch_failed" and "404" in error.message


def test_non_image_body_is_invalid_image(server, fetching):
    assert refused([user(image_part(server.url("/text")))], fetching).code == "invalid_image"


def test_private_address_is_refused_when_not_allowed(server, fetching):
    error = refused([user(image_part(server.url("/img.png")))],
                    fetching.with_overrides(image_fetch_allow_private=False))
    assert error.code == "unsafe_image_url" and "127.0.0.1" in error.message


def test_redirect_to_a_refused_scheme(server, fetching):
    error = refused([user(image_part(server.url("/to?file:///etc/passwd")))], fetching)
    assert error.code == "unsafe_image_url"


def test_redirect_to_a_refused_address_is_checked_again(server, fetching, monkeypatch):
    # 127.0.0.1 plays a public image host; a redirect from it to 127.0.0.2 must be vetted (and refused).
    monkeypatch.setattr(destinations, "is_public", lambda address: address == "127.0.0.1")
    strict = fetching.with_overrides(image_fetch_allow_private=False)
    assert spool_parts([user(image_part(server.url("/img.png")))], JOB, strict)[0].format == "PNG"
    error = refused([user(image_part(server.url(f"/to?{server.url('/img.png', '127.0.0.2')}")))], strict)
    assert error.code == "unsafe_image_url" and "127.0.0.2" in error.message


def test_declared_oversize_is_refused_unread(server, fetching):
    error = refused([user(image_part(server.url("/declares-big")))], fetching)
    assert error.code == "image_too_large" and "MLXQ_MAX_IMAGE_MB" in error.message


def test_endless_body_is_cut_at_the_cap(server, fetching):
    server.stream_stopped.clear()
    started = time.monotonic()
    error = refused([user(image_part(server.url("/forever")))], fetching)
    assert error.code == "image_too_large"  # not a timeout: reading stopped at the cap
    assert time.monotonic() - started < fetching.image_fetch_timeout_s
    assert server.stream_stopped.wait(5)  # the fetcher hung up


def test_server_that_never_answers_times_out(settings):
    listener = socket.create_server(("127.0.0.1", 0))  # connections complete in the backlog, never served
    try:
        quick = settings.with_overrides(image_fetch_allow_private=True, image_fetch_timeout_s=0.5)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/img.png"
        started = time.monotonic()
        error = refused([user(image_part(url))], quick)
        assert error.code == "image_fetch_failed" and "timed out" in error.message
        assert time.monotonic() - started < 3
    finally:
        listener.close()


def test_slow_server_is_cut_at_the_overall_deadline(server, fetching):
    slow = fetching.with_overrides(image_fetch_timeout_s=1.0)
    started = time.monotonic()
    error = refused([user(image_part(server.url("/drip")))], slow)
    assert error.code == "image_fetch_failed" and "timed out" in error.message
    assert time.monotonic() - started < 3


def test_unresolvable_host_is_image_fetch_failed(fetching):
    error = refused([user(image_part("http://no-such-host.invalid/a.png"))], fetching)
    assert error.code == "image_fetch_failed"


# -- the chat routes' body limit ---------------------------------------------------------------------------

def test_chat_body_limit_covers_images_and_audio(settings):
    limit = chat_body_limit(settings)
    assert limit == 1024 * 1024 + (50 * MIB * 4 + 2) // 3 + 25 * MIB
    assert limit > 50 * MIB * 4 / 3


def test_chat_routes_take_larger_bodies_than_other_routes(settings):
    client = create_app(settings).test_client()
    body = json.dumps({"model": "smollm2-135m", "messages": "x" * (2 * MIB)})  # over 1 MiB, and invalid
    for path in ("/v1/chat/completions", "/v1/jobs/chat/completions"):
        answer = client.post(path, data=body, content_type="application/json")
        assert answer.status_code == 400, (path, answer.get_json())
        assert answer.get_json()["error"]["param"] == "messages"
    other = client.post("/v1/completions", data=body, content_type="application/json")
    assert other.status_code == 413


def test_chat_body_over_its_limit_is_refused_unread(settings):
    app = create_app(settings)
    limit = chat_body_limit(settings)
    stream = TrackingStream(b"{" * MIB)
    environ = EnvironBuilder(path="/v1/chat/completions", method="POST", input_stream=stream,
                             content_type="application/json").get_environ()
    environ["CONTENT_LENGTH"] = str(limit + 1)  # declared, not sent: nothing may be read
    statuses = []
    body = b"".join(app(environ, lambda status, headers, exc_info=None: statuses.append(status)))  # WSGI
    assert statuses[0].startswith("413") and json.loads(body)["error"]["code"] == "request_too_large"
    assert str(limit) in json.loads(body)["error"]["message"]
    assert stream.bytes_read == 0
