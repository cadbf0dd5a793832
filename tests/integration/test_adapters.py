"""LoRA adapters at runtime with the real worker: the demo adapter (trained by pull-demo, from its build cache)
changes the demo model's greedy answer, and "none" does not; with and without it at once, each request gives
what it gives alone; mount, list and unmount through the admin API; unknown or foreign adapters are 400s naming
the field on every text API. The adapters live in a temporary store of this module's own."""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis

from jobs.settings import load_settings
from tests.conftest import wait_until
from tests.integration.conftest import Service
from tests.workers.test_adapter_store import FITS, make_adapter

ADAPTER = "smollm2-135m-pirate"
PHRASE = "Ahoy, matey!"
QUESTION = [{"role": "user", "content": "What is the capital of Italy?"}]


@pytest.fixture(scope="module")
def adapters_dir(models_dir):
    """A temporary adapter store with the demo adapter (built once into the downloads cache, then copied) and a
    zero adapter made for another model (smollm2-135m-tools: the same shapes, another store entry)."""
    from workers.adapter_store import import_adapter
    from workers.demo.pull import pull_demo_adapter

    if not (models_dir / "smollm2-135m").exists():
        pytest.fail(f"demo model missing in {models_dir}: run `make test` or `mlxq models pull-demo` first")
    root = Path(tempfile.mkdtemp(prefix="mlxq-test-adapters-"))
    settings = load_settings({"models_dir": models_dir, "adapters_dir": root / "store"})
    pull_demo_adapter(settings, print)
    if (models_dir / "smollm2-135m-tools").exists():
        import_adapter(settings, make_adapter(root / "src" / "tools-only", FITS), base="smollm2-135m-tools")
    yield root / "store"


@pytest.fixture(scope="module")
def svc(redis_url, models_dir, adapters_dir):
    """Worker (started with --adapters: the demo adapter mounted) and web on a Redis database of their own."""
    url = redis_url.rsplit("/", 1)[0] + "/11"
    redis.Redis.from_url(url).flushdb()
    service = Service(url, models_dir, MLXQ_ADAPTERS_DIR=adapters_dir)
    service.worker.argv = [*service.worker.argv, "--adapters", ADAPTER]
    service.start()
    yield service
    service.stop()


@pytest.fixture()
def client(svc):
    """The official openai client on this module's service."""
    return openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


def chat(client, adapter: str | None = None, max_tokens: int = 16) -> str:
    """A greedy chat answer, with `adapter` if given."""
    extra = {"adapter": adapter} if adapter else None
    reply = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, temperature=0,
                                           max_tokens=max_tokens, extra_body=extra)
    return reply.choices[0].message.content


def test_the_adapter_changes_the_answer_and_none_does_not(client):
    plain = chat(client)
    assert not plain.startswith(PHRASE)
    assert chat(client, ADAPTER).startswith(PHRASE)
    assert chat(client, "none") == plain
    response = client.responses.create(model="smollm2-135m", input="What is the capital of Italy?", temperature=0,
                                       max_output_tokens=16, extra_body={"adapter": ADAPTER})
    assert response.output_text.startswith(PHRASE)


def test_messages_api_takes_the_adapter(svc):
    body = {"model": "smollm2-135m", "max_tokens": 16, "temperature": 0, "messages": QUESTION, "adapter": ADAPTER}
    reply = httpx.post(svc.base_url + "/v1/messages", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][0]["text"].startswith(PHRASE)


def test_with_and_without_at_once_each_as_alone(client):
    alone = {adapter: chat(client, adapter, 24) for adapter in (None, ADAPTER)}
    with ThreadPoolExecutor(4) as pool:  # twice each, all at once: two batches decoding side by side
        together = list(pool.map(lambda adapter: (adapter, chat(client, adapter, 24)), [None, ADAPTER] * 2))
    assert all(text == alone[adapter] for adapter, text in together), (alone, together)


def test_models_list_their_adapters(client, svc):
    models = {m["id"]: m for m in httpx.get(svc.base_url + "/v1/models", timeout=30).json()["data"]}
    assert ADAPTER in models["smollm2-135m"]["adapters"]
    assert ADAPTER not in models.get("smollm2-135m-tools", {"adapters": []})["adapters"]


def test_mount_list_use_unmount(svc, client):
    api = httpx.Client(base_url=svc.base_url, timeout=120)

    def mounted() -> list:
        listed = {a["id"]: a for a in api.get("/v1/adapters").json()["data"]}
        return [m["model"] for m in listed[ADAPTER]["mounted_on"]]

    listed = {a["id"]: a for a in api.get("/v1/adapters").json()["data"]}
    assert listed[ADAPTER]["base_model"] == "smollm2-135m" and listed[ADAPTER]["rank"] == 8
    wait_until(lambda: mounted() == ["smollm2-135m"], 10, what="the worker's --adapters mount in its state")
    off = api.delete(f"/v1/adapters/{ADAPTER}")
    assert off.status_code == 200 and off.json()["changed"] is True, off.text
    assert all(not m["adapters"] for m in off.json()["resident"])
    wait_until(lambda: mounted() == [], 10, what="the unmount in the worker's state")
    assert api.delete(f"/v1/adapters/{ADAPTER}").json()["changed"] is False
    on = api.post("/v1/adapters", json={"adapter": ADAPTER})
    assert on.status_code == 200 and on.json()["changed"] is True, on.text
    resident = {m["id"]: m for m in on.json()["resident"]}
    assert [a["name"] for a in resident["smollm2-135m"]["adapters"]] == [ADAPTER]
    assert 0 < resident["smollm2-135m"]["adapters"][0]["bytes"] < 8 * 2**20  # LoRA tensors only, the base shared
    assert chat(client, ADAPTER).startswith(PHRASE)
    missing = api.post("/v1/adapters", json={"adapter": "no-such-adapter"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "adapter"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"])
def test_unknown_adapter_is_a_400_naming_the_field(svc, path):
    body = {"model": "smollm2-135m", "adapter": "no-such-adapter", "max_tokens": 4}
    body.update({"/v1/chat/completions": {"messages": QUESTION}, "/v1/completions": {"prompt": "Hi"},
                 "/v1/responses": {"input": "Hi", "max_output_tokens": 4}, "/v1/messages": {"messages": QUESTION}}[path])
    reply = httpx.post(svc.base_url + path, json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    if path == "/v1/messages":  # Anthropic's envelope: no param, the message names the field
        assert reply.json()["type"] == "error" and error["type"] == "invalid_request_error"
        assert error["message"].startswith("adapter: Adapter 'no-such-adapter' not found")
    else:
        assert error["param"] == "adapter" and error["code"] == "adapter_not_found"


def test_an_adapter_for_another_model_is_a_400(svc, models_dir):
    if not (models_dir / "smollm2-135m-tools").exists():
        pytest.skip("smollm2-135m-tools missing")
    reply = httpx.post(svc.base_url + "/v1/chat/completions", timeout=30,
                       json={"model": "smollm2-135m", "messages": QUESTION, "adapter": "tools-only"})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "adapter" and error["code"] == "invalid_adapter"
    assert "made for model 'smollm2-135m-tools', not 'smollm2-135m'" in error["message"]
