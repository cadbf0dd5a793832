"""Upload limits (refused before the body is read), spooling to disk, cleanup, and the audio check."""

from __future__ import annotations

import io
import wave
from pathlib import Path

import pytest
from flask import jsonify, request
from werkzeug.test import EnvironBuilder

from tests.conftest import REPO
from web.app import create_app
from web.audio_check import check_audio
from web.errors import APIError
from web.uploads import MIB, accepts_upload, safe_filename, spool

SPEECH = REPO / "tests" / "fixtures" / "speech"


class TrackingStream(io.BytesIO):
    """A request body that remembers how much of it was read."""

    def __init__(self, data: bytes):
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size=-1):
        chunk = super().read(size)
        self.bytes_read += len(chunk)
        return chunk

    def read1(self, size=-1):
        return self.read(size)

    def readline(self, size=-1):
        line = super().readline(size)
        self.bytes_read += len(line)
        return line


@pytest.fixture()
def app(settings):
    """The real app with a 1 MB upload limit and a test view that spools what it receives."""
    app = create_app(settings.with_overrides(max_upload_mb=1))

    @accepts_upload
    def upload_view():
        upload = spool(request.files["file"], request.form.get("job_id", "job-test"))
        if request.form.get("fail"):
            raise APIError(400, "refused after spooling", "test")
        return jsonify({"path": str(upload.path), "size": upload.size, "filename": upload.filename})

    app.add_url_rule("/test-upload", "test_upload", upload_view, methods=["POST"])
    return app


def _leftovers(settings) -> list[Path]:
    root = settings.spool_dir
    return sorted(root.iterdir()) if root.exists() else []


def test_declared_oversize_is_refused_before_reading(app, settings):
    body = TrackingStream(b"x" * (3 * MIB))
    environ = EnvironBuilder(path="/test-upload", method="POST", input_stream=body, content_length=3 * MIB,
                             content_type="multipart/form-data; boundary=b").get_environ()
    response = app.test_client().open(environ)
    assert response.status_code == 413
    error = response.get_json()["error"]
    assert error["code"] == "file_too_large" and error["param"] == "file" and "1 MB" in error["message"]
    assert body.bytes_read == 0
    assert _leftovers(settings) == []


def test_undeclared_oversize_is_cut_off_while_streaming(app, settings):
    boundary = "b"
    payload = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.wav"\r\n'
               "Content-Type: audio/wav\r\n\r\n").encode() + b"\0" * (3 * MIB) + f"\r\n--{boundary}--\r\n".encode()
    body = TrackingStream(payload)
    builder = EnvironBuilder(path="/test-upload", method="POST", input_stream=body,
                             content_type=f"multipart/form-data; boundary={boundary}")
    environ = builder.get_environ()
    environ.pop("CONTENT_LENGTH", None)
    environ["wsgi.input_terminated"] = True  # what gunicorn sets for chunked bodies
    response = app.test_client().open(environ)
    assert response.status_code == 413
    assert body.bytes_read <= 2 * MIB + 64 * 1024  # stopped near the limit, not at the end
    assert _leftovers(settings) == []


def test_upload_is_spooled_under_the_job_id_with_a_safe_name(app, settings):
    data = (SPEECH / "weather.ogg").read_bytes()
    response = app.test_client().post("/test-upload", data={
        "job_id": "job-abc", "file": (io.BytesIO(data), "../../etc/wéather report.ogg")})
    assert response.status_code == 200, response.get_json()
    body = response.get_json()
    path = Path(body["path"])
    assert path == settings.spool_dir / "job-abc" / "weather_report.ogg"
    assert path.read_bytes() == data and body["size"] == len(data)
    assert body["filename"] == "../../etc/wéather report.ogg"  # kept for display only
    assert _leftovers(settings) == [settings.spool_dir / "job-abc"]  # no temporary file left behind


def test_failure_after_spooling_removes_the_spool_dir(app, settings):
    response = app.test_client().post("/test-upload", data={
        "job_id": "job-fail", "fail": "1", "file": (io.BytesIO(b"RIFF...."), "a.wav")})
    assert response.status_code == 400
    assert _leftovers(settings) == []


@pytest.mark.parametrize("name, expected", [
    ("meeting.mp3", "meeting.mp3"), ("../../x.wav", "x.wav"), ("会议.m4a", "upload.m4a"), ("", "upload"),
    (None, "upload"), ("a" * 300 + ".flac", "a" * 100 + ".flac"), ("no extension", "no_extension"),
])
def test_safe_filename(name, expected):
    assert safe_filename(name) == expected


def _check_error(path: Path) -> APIError:
    with pytest.raises(APIError) as info:
        check_audio(path)
    return info.value


def test_audio_check_accepts_real_audio():
    for name in ("weather.ogg", "garden.wav"):
        info = check_audio(SPEECH / name)
        assert 10 < info.duration_s < 30 and info.codec


def test_audio_check_names_what_is_wrong(tmp_path):
    empty = tmp_path / "empty.wav"
    empty.write_bytes(b"")
    error = _check_error(empty)
    assert (error.status, error.code, error.extra["reason"]) == (400, "invalid_audio", "empty")

    no_frames = tmp_path / "silent.wav"
    with wave.open(str(no_frames), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
    error = _check_error(no_frames)
    assert (error.status, error.extra["reason"]) == (400, "empty")

    header_only = tmp_path / "cut.wav"  # a header promising samples that never come
    header_only.write_bytes((SPEECH / "garden.wav").read_bytes()[:44])
    error = _check_error(header_only)
    assert (error.status, error.code, error.extra["reason"]) == (400, "invalid_audio", "truncated")

    corrupt = tmp_path / "corrupt.ogg"
    ogg = (SPEECH / "weather.ogg").read_bytes()
    corrupt.write_bytes(ogg[:60] + bytes(reversed(ogg[60:])))
    error = _check_error(corrupt)
    assert (error.status, error.code, error.extra["reason"]) == (400, "invalid_audio", "corrupt")
    assert "corrupt" in error.message

    text = tmp_path / "notes.txt"
    text.write_text("this is not audio\n" * 50)
    error = _check_error(text)
    assert (error.status, error.code, error.extra["reason"]) == (415, "unsupported_media_type", "not_audio")
    assert "no audio stream" in error.message

    blob = tmp_path / "blob.bin"
    blob.write_bytes(bytes(range(256)) * 20)
    assert _check_error(blob).status == 415

