"""Audio by URL: a job's `file_url` fetched into the spool by the worker, before it is transcribed.

The fetch runs on a thread of its own through jobs/url_fetch.py (the destination guard at every redirect,
MLXQ_MAX_UPLOAD_MB as the size cap, MLXQ_AUDIO_FETCH_TIMEOUT_S as the deadline), while the run on the
MLX thread yields to the scheduler between short waits, so text keeps decoding meanwhile. The body goes
to `<audio_path>.part` and is renamed when whole: a run resumed after its worker died finds the file
there, or fetches it again from the start.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from jobs import url_fetch
from jobs.errors import Canceled, InvalidRequest
from jobs.lifecycle import JobRun

USER_AGENT = "mlxq-audio-fetch/1"
MIB = 1024 * 1024

WAIT_S = 0.02
"""How long one turn of the run waits for the fetch before it yields (while text decodes, a solo task's turn
comes once a second: this is what the fetch takes from it)."""

PROGRESS_EVERY_S = 1.0
"""How often a fetch publishes its progress (and looks for a cancel)."""

READ_TIMEOUT_S = 60.0
"""Longest wait for the next bytes from the server (the whole fetch has its own deadline)."""


def fetched(file_url: str, audio_path: str, job: JobRun) -> Iterator[None]:
    """Fetch `file_url` into `audio_path` unless a finished fetch left it there; yield while it downloads.

    Publishes `progress` {"stage": "download", "bytes", "total_bytes", "percent"} about once a second.
    """
    path = Path(audio_path)
    if path.exists():  # a resumed run: fetched before the worker died
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    download = _Download(file_url, path.with_name(path.name + ".part"), job.settings)
    last = time.monotonic()
    try:
        while not download.done.wait(WAIT_S):
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                job.check_cancel()
                job.progress(download.progress())
            yield
        download.raise_failure()
        os.replace(download.part, path)
        job.progress(download.progress())
    finally:
        download.stop()


class _Download:
    """One fetch on its own thread: `done` is set when it ends, whole or not."""

    def __init__(self, url: str, part: Path, settings):
        self.url, self.part, self.settings = url, part, settings
        self.done, self._stopping = threading.Event(), threading.Event()
        self.bytes, self.total = 0, None
        self._failure: BaseException | None = None
        threading.Thread(target=self._run, name="audio-fetch", daemon=True).start()

    def _run(self) -> None:
        settings = self.settings
        try:
            with open(self.part, "wb") as sink:
                url_fetch.fetch(self.url, sink, limit=settings.max_upload_mb * MIB,
                                limit_text=f"{settings.max_upload_mb} MB (MLXQ_MAX_UPLOAD_MB)",
                                allow_private=settings.audio_fetch_allow_private,
                                timeout_s=settings.audio_fetch_timeout_s, user_agent=USER_AGENT, what="the file",
                                accept="audio/*, video/*, */*;q=0.5", read_timeout_s=READ_TIMEOUT_S,
                                on_chunk=self._on_chunk)
        except BaseException as exc:  # noqa: BLE001 (told to the run on the MLX thread)
            self._failure = exc
        finally:
            self.done.set()

    def _on_chunk(self, done: int, declared: int | None) -> None:
        self.bytes, self.total = done, declared
        if self._stopping.is_set():
            raise Canceled("the fetch was stopped")

    def progress(self) -> dict:
        """The progress event's data now."""
        percent = round(100.0 * self.bytes / self.total, 1) if self.total else None
        return {"stage": "download", "bytes": self.bytes, "total_bytes": self.total, "percent": percent}

    def raise_failure(self) -> None:
        """Raise what ended the fetch early, as the error its job fails with."""
        exc = self._failure
        if exc is None:
            return
        if isinstance(exc, url_fetch.FetchFailed):
            code, status = {"unsafe": ("unsafe_file_url", 400), "too_large": ("file_too_large", 413)}.get(
                exc.kind, ("file_fetch_failed", 400))
            raise InvalidRequest(str(exc), code=code, status=status, param="file_url") from None
        raise exc

    def stop(self) -> None:
        """Stop the fetch at its next piece (the run ended first: canceled, handed back or failed); its part goes."""
        self._stopping.set()
        if self.done.wait(1.0):
            self.part.unlink(missing_ok=True)
        # else the thread is blocked on a silent server: it ends at its read timeout, and the spool directory
        # is removed with the job
