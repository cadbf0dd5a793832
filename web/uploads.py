"""Audio uploads: a per-route size limit checked before the body is read, and spooling to disk.

Multipart file parts are written by werkzeug's parser straight into a temporary file inside
`settings.spool_dir` (chunk by chunk, never whole in memory), then renamed into
`spool_dir/<job_id>/<safe filename>`, the directory web and worker share. Nothing goes into Redis.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from flask import g, request
from werkzeug.datastructures import FileStorage
from werkzeug.utils import secure_filename

from jobs.settings import Settings
from jobs.spool import discard as discard_spooled
from web.errors import APIError
from web.services import services

MIB = 1024 * 1024
FORM_OVERHEAD_BYTES = MIB
"""Room above the file limit for the multipart framing and the small text fields around the file."""

FORM_FIELDS_BYTES = 18 * MIB
"""Most bytes of one text field of an upload form (werkzeug's default, 500 kB, is less than a reference clip)."""

COPY_CHUNK_BYTES = MIB
"""Chunk size when a file part has to be copied rather than renamed into the spool."""

_TEMP_PREFIX = ".upload-"


@dataclass(frozen=True)
class Upload:
    """One spooled upload."""

    job_id: str
    path: Path
    filename: str  # as the client named it (for display only; never used as a path)
    size: int

    @property
    def directory(self) -> Path:
        """The job's spool directory (removed as a whole)."""
        return self.path.parent


def upload_limit(settings: Settings) -> int:
    """The largest request body accepted on an upload route, in bytes."""
    return settings.max_upload_mb * MIB + FORM_OVERHEAD_BYTES


def too_large(settings: Settings) -> APIError:
    """The 413 answered when an upload exceeds settings.max_upload_mb."""
    return APIError(413, f"The upload is larger than the limit of {settings.max_upload_mb} MB "
                         "(MLXQ_MAX_UPLOAD_MB).", "file_too_large", "file")


def accepts_upload(view):
    """Decorate a view taking a multipart upload: size limit, spooling parser, cleanup on failure.

    Put it under `@blp.route` and above `@blp.arguments`, so the limit and the parser are in place
    before the body is parsed.
    """

    @functools.wraps(view)
    def wrapper(*args, **kwargs):
        settings = services().settings
        limit = upload_limit(settings)
        # Flask 3.1: a per-request limit. Declared lengths are refused here, unread; chunked bodies
        # are cut off by werkzeug when they pass it.
        request.max_content_length = limit
        # Text fields are held in memory: room for four known speakers' reference clips as data URLs.
        request.max_form_memory_size = FORM_FIELDS_BYTES
        if request.content_length is not None and request.content_length > limit:
            raise too_large(settings)
        temps = _install_spooling_parser(settings.spool_dir)
        g.mlxq_spooled = []
        try:
            return view(*args, **kwargs)
        except BaseException:
            for directory in g.mlxq_spooled:
                discard(directory)
            raise
        finally:
            for name in temps:  # parts never spooled (or refused): remove their temporary files
                Path(name).unlink(missing_ok=True)

    return wrapper


def _install_spooling_parser(spool_dir: Path) -> list[str]:
    """Make this request's form parser write file parts into `spool_dir`; return their temp names."""
    temps: list[str] = []

    def stream_factory(total_content_length, content_type, filename=None, content_length=None):
        spool_dir.mkdir(parents=True, exist_ok=True)
        handle = tempfile.NamedTemporaryFile("wb+", dir=spool_dir, prefix=_TEMP_PREFIX, delete=False)
        temps.append(handle.name)
        return handle

    # Werkzeug asks `request._get_file_stream` for each file part's buffer; setting it on this
    # request object (not the class) affects only upload routes, and needs no app-wide Request class.
    request._get_current_object()._get_file_stream = stream_factory
    return temps


def safe_filename(name: str | None) -> str:
    """A file name safe to create in the spool: ASCII, no path parts, extension kept when possible."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]  # browsers on Windows may send full paths
    cleaned = secure_filename(base)
    suffix = secure_filename(Path(base).suffix.lstrip("."))[:16]
    if not cleaned or cleaned == suffix:
        cleaned = f"upload.{suffix}" if suffix else "upload"
    stem, dot, ext = cleaned.rpartition(".")
    return f"{stem[:100]}.{ext[:16]}" if dot and stem else cleaned[:120]


def spool(storage: FileStorage, job_id: str) -> Upload:
    """Move the uploaded part into `spool_dir/<job_id>/<safe filename>` and describe it."""
    directory = services().settings.spool_dir / job_id
    directory.mkdir(parents=True)
    g.mlxq_spooled.append(directory)
    path = directory / safe_filename(storage.filename)
    stream = storage.stream
    name = getattr(stream, "name", None)
    if isinstance(name, str) and Path(name).name.startswith(_TEMP_PREFIX) and os.path.exists(name):
        stream.flush()
        os.replace(name, path)  # same filesystem: a rename, not a copy
    else:  # a part werkzeug kept in memory elsewhere (tests building requests by hand)
        storage.save(path, buffer_size=COPY_CHUNK_BYTES)
    filename = (storage.filename or path.name)[:255]
    return Upload(job_id, path, filename, path.stat().st_size)


def keep(upload: Upload) -> None:
    """Leave the upload in place even if the view fails (its job still runs and reads it)."""
    if upload.directory in g.mlxq_spooled:
        g.mlxq_spooled.remove(upload.directory)


def discard(directory: Path) -> None:
    """Remove a job's spool directory (refused uploads, finished sync jobs, canceled jobs).

    Needs no app context, so it can run when a streamed response closes.
    """
    target = Path(directory)
    if target.name and not target.name.startswith("."):  # a job's directory, never the spool itself
        shutil.rmtree(target, ignore_errors=True)


def discard_job(job_id: str) -> None:
    """Remove the spool directory of `job_id`, if any (ids come from URLs: jobs.spool vets them)."""
    discard_spooled(services().settings.spool_dir, job_id)
