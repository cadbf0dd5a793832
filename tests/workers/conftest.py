"""Fixtures shared by the worker tests that run the demo text model in this process."""

from __future__ import annotations

import pytest

from jobs.settings import load_settings


@pytest.fixture(scope="session")
def text_worker_parts(models_dir):
    """One model manager and set of backends for the session (built once, models stay loaded): the text
    tests (test_batching, test_text_backend) share the demo model instead of loading it each."""
    from workers.main import build_scheduler  # MLX only for the tests that use it

    scheduler = build_scheduler(load_settings({"models_dir": models_dir}), "test-text")
    return scheduler.models, scheduler.backends
