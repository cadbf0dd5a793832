"""The CLI against a real server over real HTTP: the server's refusals shown as they are (an early 401
or 413 while a large upload is still being sent, not a broken pipe), a hint when nothing answers,
and `mlxq --version`."""

from __future__ import annotations

from importlib.metadata import version

import httpx
import pytest
from click.testing import CliRunner

from mlxq.chat_cli import chat
from mlxq.cli import gunicorn_argv, main
from mlxq.transcribe_cli import transcribe
from tests.conftest import free_port, wait_until
from tests.integration.conftest import Proc, service_env

KEY = "cli-test-key"
LIMIT_MB = 1


@pytest.fixture(scope="module")
def guarded(redis_url, models_dir, tmp_path_factory):
    """A web tier alone, with an API key and a 1 MB upload limit: it refuses these requests before any job
    exists, so no worker is needed."""
    url = redis_url.rsplit("/", 1)[0] + "/7"
    port = free_port()
    env = service_env(url, models_dir, tmp_path_factory.mktemp("spool"), MLXQ_API_KEYS=KEY,
                      MLXQ_MAX_UPLOAD_MB=LIMIT_MB)
    web = Proc("web-cli", gunicorn_argv("127.0.0.1", port, 1), env).start()
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(base, web), 60, interval=0.1, what="the web tier to answer")
    yield base
    web.stop()


def _answers(base: str, web: Proc) -> bool:
    assert web.alive(), web.tail()
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def big_file(tmp_path_factory):
    """40 MB, far more than the sockets' buffers hold: a server that answers without reading it closes
    its end while the body is still being sent."""
    path = tmp_path_factory.mktemp("upload") / "big.wav"
    with open(path, "wb") as f:
        f.truncate(40 * 2**20)
    return path


def _run(command, args: list[str]):
    return CliRunner().invoke(command, args, catch_exceptions=False)


@pytest.mark.parametrize("mode", [[], ["--async"]])
def test_transcribe_shows_the_servers_401_while_uploading(guarded, big_file, mode):
    result = _run(transcribe, [str(big_file), *mode, "--url", guarded, "--api-key", "wrong-key"])
    assert result.exit_code == 1, result.output
    assert "HTTP 401: Missing or invalid API key" in result.output, result.output
    assert "--api-key" in result.output and "MLXQ_API_KEY" in result.output
    assert "Broken pipe" not in result.output


@pytest.mark.parametrize("mode", [[], ["--async"]])
def test_transcribe_shows_the_servers_413_while_uploading(guarded, big_file, mode):
    result = _run(transcribe, [str(big_file), *mode, "--url", guarded, "--api-key", KEY])
    assert result.exit_code == 1, result.output
    assert f"HTTP 413: The upload is larger than the limit of {LIMIT_MB} MB (MLXQ_MAX_UPLOAD_MB)." in result.output
    assert "Broken pipe" not in result.output


def test_chat_shows_the_servers_401_with_the_key_options(guarded):
    result = _run(chat, ["Hi", "--url", guarded])
    assert result.exit_code == 1, result.output
    assert "HTTP 401: Missing or invalid API key" in result.output and "(invalid_api_key)" in result.output
    assert "--api-key or set MLXQ_API_KEY" in result.output


def test_nothing_listening_gets_a_hint(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    result = _run(chat, ["Hi", "--url", url])
    assert result.exit_code == 1, result.output
    assert f"cannot reach {url}: connection refused" in result.output
    assert "mlxq up" in result.output and "--url" in result.output


def test_version_comes_from_the_package():
    result = _run(main, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"mlxq, version {version('mlxq')}"


def test_chat_shows_no_worker(guarded):
    """No worker runs behind this web tier: the chat is refused at once, and the CLI says why."""
    result = _run(chat, ["Hi", "--url", guarded, "--api-key", KEY])
    assert result.exit_code == 1, result.output
    assert "HTTP 503: No MLX worker is running" in result.output and "(no_worker)" in result.output, result.output
    assert "retry after" in result.output
