"""The spool: uploads shared by web and workers, one directory per job (`<spool_dir>/<job_id>/<file>`).

Nothing a job reads from the spool is needed once the job has ended, however it ended: the web tier
removes an upload it refused, and whoever ends a job (its worker, a reader noticing its worker
died, a cancel before it started) removes the job's directory.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


def job_dir(spool_dir: Path, job_id: str) -> Path | None:
    """The job's spool directory; None for an id that could name something else (".." or a path)."""
    return Path(spool_dir) / job_id if _JOB_ID.match(job_id or "") else None


def discard(spool_dir: Path, job_id: str) -> bool:
    """Remove the job's spool directory and everything in it; True if there was one."""
    directory = job_dir(spool_dir, job_id)
    if directory is None or not directory.is_dir():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return True
