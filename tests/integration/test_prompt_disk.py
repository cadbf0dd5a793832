"""The prompt cache's disk tier under `mlxq up`: a long prompt answered, the worker killed with -9 and
restarted by the supervisor, the same prompt again resumes from disk (cached tokens, a far quicker first
token), reported in OpenAI's and Anthropic's usage and in /metrics."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from urllib.parse import urlsplit

import httpx
import pytest

from mlxq.devstack import free_port
from tests.conftest import REPO, wait_until
from tests.integration.test_up import READY_WITHIN_S, RESTARTED_WITHIN_S, _chat_answered, _worker_pid

PROMPT_TOKENS = 2000
"""About how long the prompt is (the issue's figure): its processing takes seconds on a CPU, a load tens of ms."""


def long_prompt() -> str:
    """A prompt of about PROMPT_TOKENS tokens of the demo model, unlike any other test's."""
    return "Remember these facts. " + " ".join(f"Fact {i}: the box {i} holds {i * 7 % 13} red stones."
                                                for i in range(117))


def first_token_and_usage(api: httpx.Client, prompt: str) -> tuple[float, dict]:
    """Stream a greedy chat: the seconds to its first chunk of text, and its usage."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    began, first, usage = time.monotonic(), None, None
    with api.stream("POST", "/v1/chat/completions", json=body, timeout=300) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"]:
                first = time.monotonic() - began
            usage = chunk.get("usage") or usage
    return first, usage


@pytest.fixture()
def up_env(tmp_path, models_dir):
    """`mlxq up`'s environment with a store of its own (linking to the demo models), so the prompt cache's
    directory it derives (<store>/../prompt-cache/<Redis port>-<db>) is this test's."""
    store = tmp_path / "mlxq" / "models"
    store.mkdir(parents=True)
    for entry in models_dir.iterdir():
        if entry.is_dir() and not entry.name.startswith("."):
            (store / entry.name).symlink_to(entry)
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "MLXQ_MODELS_DIR": str(store),
           "MLXQ_SPOOL_DIR": str(tmp_path / "spool"), "PYTHONUNBUFFERED": "1"}
    env.pop("MLXQ_PROMPT_CACHE_DIR", None)
    return env


def test_a_long_prompt_resumes_from_disk_after_the_worker_is_killed(up_env, tmp_path):
    port = free_port()
    cache_dir = tmp_path / "mlxq" / "prompt-cache" / f"{urlsplit(up_env['REDIS_URL']).port}-0"
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "mlxq.cli", "up", "--port", str(port), "--web-workers", "1"],
                              env=up_env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
    try:
        wait_until(lambda: _answered(api, up), READY_WITHIN_S, interval=0.5, what="a chat to be answered")
        prompt = long_prompt()
        cold_s, cold = first_token_and_usage(api, prompt)
        assert PROMPT_TOKENS * 0.9 < cold["prompt_tokens"] < PROMPT_TOKENS * 1.2, cold
        assert cold["prompt_tokens_details"]["cached_tokens"] < 100  # at most the chat template's start
        # Written by the worker's disk thread once the answer is kept: waited for, then the worker dies.
        # (Its name: a hash. While it is written it has a temporary one, which a restart removes.)
        wait_until(lambda: any(cache_dir.glob("[0-9a-f]*.safetensors")), 60, what="the entry to reach the disk")

        old = _worker_pid(up.pid)
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: (p := _worker_pid(up.pid)) not in (None, old) and p, RESTARTED_WITHIN_S,
                   interval=0.2, what="a new worker process")
        wait_until(lambda: _answered(api, up), READY_WITHIN_S, interval=0.5, what="the new worker to answer")

        warm_s, warm = first_token_and_usage(api, prompt)
        assert warm["prompt_tokens"] == cold["prompt_tokens"]
        assert warm["prompt_tokens_details"]["cached_tokens"] >= 1900, warm
        assert warm_s < cold_s / 2, (warm_s, cold_s)

        # Anthropic's usage says the same (the entry is in the memory tier now): read, not processed.
        message = api.post("/v1/messages", json={"model": "smollm2-135m", "max_tokens": 2, "temperature": 0,
                                                 "messages": [{"role": "user", "content": prompt}]})
        assert message.status_code == 200, message.text
        usage = message.json()["usage"]
        assert usage["cache_read_input_tokens"] >= 1900 and usage["cache_creation_input_tokens"] == 0, usage
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == cold["prompt_tokens"]

        # The worker records a job's figures just after its answer: waited for.
        def counted():
            metrics = api.get("/metrics").text
            return (_counter(metrics, 'mlxq_prompt_cache_lookups_total{result="hit",tier="disk"}') >= 1
                    and _counter(metrics, 'mlxq_prompt_cache_lookups_total{result="miss",tier="disk"}') >= 1
                    and _counter(metrics, 'mlxq_prompt_cache_tokens_total{tier="disk"}') >= 1900
                    and _counter(metrics, 'mlxq_prompt_cache_tokens_total{tier="memory"}') >= 1900)
        wait_until(counted, 10, interval=0.2, what="the prompt cache's hits and misses in /metrics")
    finally:
        api.close()
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
        code = up.wait(60)
    assert code == 0, log_path.read_text()[-3000:]


def _answered(api: httpx.Client, up: subprocess.Popen) -> bool:
    assert up.poll() is None, f"mlxq up exited with code {up.returncode}"
    try:
        return _chat_answered(api)
    except httpx.HTTPError:
        return False


def _counter(text: str, sample: str) -> float:
    """A sample's value in a Prometheus exposition (0 if absent)."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
