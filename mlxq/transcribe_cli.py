"""`mlxq transcribe FILE`: send an audio file to a running mlxq and write its transcript.

The upload streams from disk (httpx's multipart, with its Content-Length, so the server can refuse
a file too large before reading it); with --async the job's Server-Sent Events feed a progress bar
until the transcript is ready.
"""

from __future__ import annotations

import mimetypes
import sys
from pathlib import Path

import click
import httpx

from jobs.formats import FORMATS
from mlxq.client import DEFAULT_URL, connect, sse


def _post_file(client: httpx.Client, path: str, file: Path, fields: dict) -> httpx.Response:
    """POST `file` and the non-empty `fields` as a multipart form; the server's answer, read."""
    mime = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
    # Connection: close lets the server refuse (401, 413) without reading the whole file first (on a
    # kept-alive connection gunicorn would read and discard it all); httpcore then reads its answer
    # after the write fails, instead of reporting a broken pipe.
    with open(file, "rb") as f:
        return client.post(path, data={k: v for k, v in fields.items() if v is not None},
                           files={"file": (file.name, f, mime)}, headers={"Connection": "close"})


def _follow(client: httpx.Client, events_path: str) -> None:
    """Follow a job's events with a progress bar until it ends; raise on its error event."""
    with click.progressbar(length=100, label="transcribing", file=sys.stderr) as bar:
        shown = 0
        for name, data in sse(client, "GET", events_path):
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
@click.option("--url", default=DEFAULT_URL, show_default=True, envvar="MLXQ_URL")
@click.option("--model", default="whisper-tiny.en", show_default=True)
@click.option("--language", default=None, help="ISO-639-1 code, e.g. en")
@click.option("--output", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Write here, not stdout.")
@click.option("--api-key", envvar="MLXQ_API_KEY", default=None, help="Bearer key (env MLXQ_API_KEY).")
@click.option("--diarize", is_flag=True, help="Label who speaks (srt, vtt, verbose_json; --format diarized_json "
                                              "implies it).")
def transcribe(file, fmt, run_async, url, model, language, output, api_key, diarize):
    """Transcribe FILE with a running mlxq server and write the transcript."""
    fields = {"model": model, "language": language, "response_format": fmt, "diarize": "true" if diarize else None}
    with connect(url, api_key) as client:
        if not run_async:
            _write(_post_file(client, "/v1/audio/transcriptions", file, fields).content, output)
            return
        job = _post_file(client, "/v1/jobs/transcriptions", file, fields).json()
        click.echo(f"job {job['id']} queued", err=True)
        try:
            _follow(client, job["links"]["events"])
        except KeyboardInterrupt:
            raise click.ClickException(f"stopped following; job {job['id']} keeps running "
                                       f"({url.rstrip('/')}{job['links']['self']})") from None
        _write(client.get(job["links"]["result"], params={"format": fmt}).content, output)
