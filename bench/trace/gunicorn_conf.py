"""gunicorn settings for a traced web tier (bench/trace_text.py)."""


def post_fork(server, worker):
    """Patch the web tier in the forked gunicorn worker."""
    import tracehook

    tracehook.patch_web()
