"""`mlxq transcribe FILE`: send an audio file to a running mlxq and write its transcript.

Plain urllib (no extra dependency): the upload is streamed from disk in chunks, and with --async
the job's Server-Sent Events feed a progress bar until the transcript is ready.
"""

from __future__ import annotations

import json
import mimetypes
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import urljoin

import click

from jobs.formats import FORMATS

CHUNK_BYTES = 1024 * 1024


def _multipart(path: Path, fields: dict) -> tuple[str, int, object]:
    """(content type, length, body iterator) of a multipart form streaming `path` from disk."""
    boundary = uuid.uuid4().hex
    head = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
                    for name, value in fields.items() if value is not None)
    mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
    file_head = (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{path.name}"\r\n'
                 f"Content-Type: {mime}\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def body():
        yield head + file_head
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk
        yield tail

    length = len(head) + len(file_head) + path.stat().st_size + len(tail)
    return f"multipart/form-data; boundary={boundary}", length, body()


def _open(url: str, api_key: str | None, data=None, headers: dict | None = None, method: str | None = None,
          timeout: float = 600):
    """Open `url`, raising a ClickException carrying the server's error message on failure."""
    headers = dict(headers or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        raise click.ClickException(f"HTTP {exc.code}: {_error_message(exc.read())}") from None
    except urllib.error.URLError as exc:
        raise click.ClickException(f"cannot reach {url}: {exc.reason}") from None


def _error_message(body: bytes) -> str:
    """The envelope's message, or the raw body."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]


def _post_file(url: str, path: Path, fields: dict, api_key: str | None):
    """POST `path` and `fields` as multipart to `url`; return the open response."""
    content_type, length, body = _multipart(path, fields)
    headers = {"Content-Type": content_type, "Content-Length": str(length)}
    return _open(url, api_key, data=body, headers=headers, method="POST")


def sse_events(response):
    """Yield (event name, data dict) from an SSE response, ignoring comments and ids."""
    name, data = "message", []
    for raw in response:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = "message", []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


def _follow(base: str, events_url: str, api_key: str | None) -> None:
    """Follow a job's events with a progress bar until it ends; raise on its error event."""
    with _open(urljoin(base, events_url), api_key, timeout=120) as response, \
            click.progressbar(length=100, label="transcribing", file=sys.stderr) as bar:
        shown = 0
        for name, data in sse_events(response):
            if name == "progress":
                percent = int(data.get("percent") or 0)
                bar.update(max(0, percent - shown))
                shown = max(shown, percent)
            elif name == "done":
                bar.update(100 - shown)
                return
            elif name == "error":
                raise click.ClickException(f"the job failed: {data.get('message')}")
    raise click.ClickException("the event stream ended before the job finished")


def _write(body: bytes, output: Path | None) -> None:
    """Write the transcript to `output`, or to stdout."""
    if output is None:
        click.echo(body.decode(), nl=not body.endswith(b"\n"))
    else:
        output.write_bytes(body)
        click.echo(f"wrote {output}", err=True)


@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--format", "fmt", type=click.Choice(FORMATS), default="text", show_default=True)
@click.option("--async", "run_async", is_flag=True, help="Submit a job to `batch` and follow its progress.")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, envvar="MLXQ_URL")
@click.option("--model", default="whisper-tiny.en", show_default=True)
@click.option("--language", default=None, help="ISO-639-1 code, e.g. en")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write here, not stdout.")
@click.option("--api-key", envvar="MLXQ_API_KEY", default=None, help="Bearer key (env MLXQ_API_KEY).")
def transcribe(file, fmt, run_async, url, model, language, output, api_key):
    """Transcribe FILE with a running mlxq server and write the transcript."""
    base = url.rstrip("/") + "/"
    fields = {"model": model, "language": language, "response_format": fmt}
    if not run_async:
        with _post_file(urljoin(base, "v1/audio/transcriptions"), file, fields, api_key) as response:
            _write(response.read(), output)
        return
    with _post_file(urljoin(base, "v1/jobs/transcriptions"), file, fields, api_key) as response:
        job = json.loads(response.read())
    click.echo(f"job {job['id']} queued", err=True)
    try:
        _follow(base, job["links"]["events"], api_key)
    except KeyboardInterrupt:
        raise click.ClickException(f"stopped following; job {job['id']} keeps running "
                                   f"({urljoin(base, job['links']['self'])})") from None
    with _open(urljoin(base, job["links"]["result"]) + f"?format={fmt}", api_key) as response:
        _write(response.read(), output)
