"""Fixtures of the web-tier tests: one app per module and settings, each test with the app's per-app state new.

Building the app (blueprints, the OpenAPI document, the dashboard) takes about 0.2 s; a module of a hundred
tests that each built one spent most of its time there. The app itself holds no request state; what it
keeps between requests is its Services (the live workers it has seen, the event hub), and each test gets
a new one, as a freshly built app has.
"""

from __future__ import annotations

import pytest

from jobs.settings import load_settings
from web.app import create_app
from web.services import Services


@pytest.fixture(scope="module")
def module_settings(redis_url, models_dir, tmp_path_factory):
    """Settings shared by one module's tests: the test Redis, the real model store, one spool directory."""
    return load_settings({"redis_url": redis_url, "models_dir": models_dir,
                          "spool_dir": tmp_path_factory.mktemp("spool")})


@pytest.fixture(scope="module")
def app_for(module_settings):
    """`app_for(**overrides)`: the app on `module_settings` with `overrides`, built once per module and
    overrides, its Services new on each call (so no test sees the workers an earlier one announced)."""
    apps = {}

    def build(**overrides):
        key = tuple(sorted(overrides.items()))
        if key not in apps:
            apps[key] = create_app(module_settings.with_overrides(**overrides))
        app = apps[key]
        app.extensions["mlxq"].close()  # an earlier test's hub: its thread would outlive the test Redis
        app.extensions["mlxq"] = Services(app.extensions["mlxq"].settings)
        return app

    yield build
    for app in apps.values():
        app.extensions["mlxq"].close()
