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


@pytest.fixture(scope="session")
def demo_text_model(text_worker_parts, models_dir):
    """The demo text model, float32, as the worker holds it: (model, tokenizer), resident in
    `text_worker_parts`' manager, so the tests that only compute with it (test_prompt_cache, test_grammar)
    load it once with the tests that run it through the scheduler."""
    from jobs.store import resolve

    resident = text_worker_parts[0].load(resolve("smollm2-135m", load_settings({"models_dir": models_dir})))
    assert resident.float32, "the worker holds the demo model in its stored dtype on this machine"
    return resident.model, resident.processor


@pytest.fixture(scope="session")
def whisper_ref(models_dir):
    """Whisper tiny.en as a request carries it (from the store: `mlxq models pull-demo`)."""
    from jobs import contract
    from jobs.store import ModelNotFound, resolve

    try:
        info = resolve("whisper-tiny.en", load_settings({"models_dir": models_dir}))
    except ModelNotFound as exc:
        pytest.fail(f"{exc}\nImport the demo models first: mlxq models pull-demo")
    return contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


@pytest.fixture(scope="session")
def whisper_model(text_worker_parts, whisper_ref):
    """Whisper tiny.en resident in the session's model manager, beside the demo text model as in a worker:
    loaded once for every speech module (test_speech and the modules that take its fixtures), not per module."""
    return text_worker_parts[0].load(whisper_ref).model


@pytest.fixture(scope="module")
def pirate(models_dir, tmp_path_factory):
    """The demo adapter (from pull-demo's build cache: trained there the first time) in a temporary store."""
    from jobs.contract import AdapterRef
    from workers.demo.pull import pull_demo_adapter

    settings = load_settings({"models_dir": models_dir, "adapters_dir": tmp_path_factory.mktemp("adapters")})
    info = pull_demo_adapter(settings, print)
    return AdapterRef(info.name, str(info.path), info.base)
