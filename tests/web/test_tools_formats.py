"""Tool-call formats in the web tier: every format mlx-lm parses lists "tools"; `required` and a named function are
forced by a grammar of the model's markup where mlxq has one, and refused (400 naming `tool_choice`) where it has
none, while "auto" and "none" still go through. Through the real app on a real Redis (no worker: a worker's
heartbeat makes calls queue, then time out), on a store holding the demo model with three templates."""

from __future__ import annotations

import json

import pytest

from jobs.contract import parse
from jobs.queues import fetch_job
from tests import worker_heartbeat
from tests.store_entries import linked_entry
from web.app import create_app
from workers.demo.tools_model import MISTRAL_CHAT_TEMPLATE

TEMPLATES = {
    # LFM2's markup (mlx-lm's pythonic parser): parsed, no grammar yet
    "pythonic": "{{ tools }}<|tool_call_start|>[{{ name }}()]<|tool_call_end|>{% for m in messages %}{{ m.content }}"
                "{% endfor %}",
    "mistral": MISTRAL_CHAT_TEMPLATE,
    "plain": "{% for m in messages %}{{ m.content }}{% endfor %}",
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def app(models_dir, redis_url, tmp_path_factory):
    """The app on a store with the demo model under each of TEMPLATES (the same weights, linked)."""
    store = tmp_path_factory.mktemp("store")
    source = models_dir / "smollm2-135m"
    for name, template in TEMPLATES.items():
        entry = linked_entry(source, store, name)
        config = json.loads((entry / "tokenizer_config.json").read_text())
        (entry / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    app = create_app({"redis_url": redis_url, "models_dir": store, "spool_dir": store / "spool", "sync_timeout_s": 0.2})
    yield app
    app.extensions["mlxq"].close()


@pytest.fixture()
def client(app, redis_conn):
    """A test client; a worker's heartbeat in the (flushed) Redis, so calls are queued and wait 0.2 s (a 504)."""
    worker_heartbeat.beat(redis_conn)
    return app.test_client()


def queued(client, redis_conn, body: dict, path: str = "/v1/chat/completions"):
    """Send `body` and return the one request it queued."""
    response = client.post(path, json=body)
    assert response.status_code in (202, 504), response.get_data(as_text=True)
    [key] = [k for k in redis_conn.keys("rq:job:*") if b":dependents" not in k]
    return parse(fetch_job(redis_conn, key.decode().removeprefix("rq:job:")).args[0])


def refused(client, body: dict, path: str = "/v1/chat/completions") -> dict:
    """The OpenAI-shaped error of a 400."""
    response = client.post(path, json=body)
    assert response.status_code == 400, response.get_data(as_text=True)
    return response.get_json()["error"]


def test_every_parsed_format_lists_tools(client):
    listed = {m["id"]: m["capabilities"] for m in client.get("/v1/models").get_json()["data"]}
    assert "tools" in listed["pythonic"] and "tools" in listed["mistral"]
    assert "tools" not in listed["plain"]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forcing_a_call_in_a_format_without_a_grammar_is_a_400_naming_tool_choice(client, choice):
    error = refused(client, {"model": "pythonic", "messages": ASK, "tools": [WEATHER], "tool_choice": choice})
    assert error["param"] == "tool_choice" and error["code"] == "tool_choice_not_supported"
    assert "'pythonic'" in error["message"] and "cannot force" in error["message"]
    assert "mistral" in error["message"]  # the formats that can be forced are named


def test_auto_beside_a_response_format_needs_a_grammar_too(client):
    error = refused(client, {"model": "pythonic", "messages": ASK, "tools": [WEATHER],
                             "response_format": {"type": "json_object"}})
    assert error["param"] == "tool_choice" and "response_format" in error["message"]


@pytest.mark.parametrize("choice, tools", [("auto", True), (None, True), ("none", False)])
def test_auto_and_none_go_through_on_a_format_without_a_grammar(client, redis_conn, choice, tools):
    body = {"model": "pythonic", "messages": ASK, "tools": [WEATHER], **({"tool_choice": choice} if choice else {})}
    request = queued(client, redis_conn, body)
    assert request.sampling.grammar is None
    assert (request.tools == [WEATHER]) if tools else request.tools is None


def test_the_other_apis_refuse_it_naming_their_tool_choice(client):
    error = refused(client, {"model": "pythonic", "input": "Weather in Paris?", "tool_choice": "required",
                             "tools": [{"type": "function", "name": "get_weather",
                                        "parameters": WEATHER["function"]["parameters"]}]}, "/v1/responses")
    assert error["param"] == "tool_choice" and error["code"] == "tool_choice_not_supported"
    response = client.post("/v1/messages", json={
        "model": "pythonic", "max_tokens": 8, "messages": ASK, "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]})
    assert response.status_code == 400
    assert response.get_json()["error"]["message"].startswith("tool_choice")


@pytest.mark.parametrize("choice, parallel, several", [("required", True, True), ("required", False, False),
                                                       (NAMED, True, False)])
def test_a_format_with_a_grammar_queues_its_markup(client, redis_conn, choice, parallel, several):
    request = queued(client, redis_conn, {"model": "mistral", "messages": ASK, "tools": [WEATHER],
                                          "tool_choice": choice, "parallel_tool_calls": parallel})
    assert request.tools == [WEATHER]
    assert '"[TOOL_CALLS]["' in request.sampling.grammar and ('(", " body)*' in request.sampling.grammar) == several
