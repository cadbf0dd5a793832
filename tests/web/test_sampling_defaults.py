"""Sampling defaults from the model (issue 32, item 5): a field a request leaves out (or sends as null) comes from
the model's generation_config.json, else from mlxq's defaults; a field it sets wins. GET /v1/models shows them.
Through the real app on a real Redis (no worker), on a store holding the demo model twice: as it is, and with an
author's generation_config.json."""

from __future__ import annotations

import json

import pytest

from jobs.contract import parse
from jobs.model_files import sampling_defaults_of
from jobs.queues import fetch_job
from tests import worker_heartbeat
from tests.store_entries import linked_entry
from web.app import create_app

AUTHORED = {"temperature": 0.3, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}
MLXQ = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": None}
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def app(models_dir, redis_url, tmp_path_factory):
    """The app on a store with `plain` (the demo model as it is) and `authored` (the same weights, the author's
    sampling defaults in its generation_config.json)."""
    store = tmp_path_factory.mktemp("store")
    source = models_dir / "smollm2-135m"
    for name in ("plain", "authored"):
        linked_entry(source, store, name)
    config = json.loads((store / "authored" / "generation_config.json").read_text())
    (store / "authored" / "generation_config.json").write_text(json.dumps({**config, **AUTHORED, "do_sample": True}))
    app = create_app({"redis_url": redis_url, "models_dir": store, "spool_dir": store / "spool", "sync_timeout_s": 0.2})
    yield app
    app.extensions["mlxq"].close()


@pytest.fixture()
def client(app, redis_conn):
    """A test client; a worker's heartbeat in the (flushed) Redis, so calls are queued and wait 0.2 s (a 504)."""
    worker_heartbeat.beat(redis_conn)
    return app.test_client()


def queued_sampling(client, redis_conn, path: str, body: dict):
    """Send `body` to `path` and return the sampling of the one request it queued."""
    response = client.post(path, json=body)
    assert response.status_code in (202, 504), response.get_data(as_text=True)
    [key] = [k for k in redis_conn.keys("rq:job:*") if b":dependents" not in k]
    job = fetch_job(redis_conn, key.decode().removeprefix("rq:job:"))
    return parse(job.args[0]).sampling


def fields_of(sampling) -> dict:
    return {name: getattr(sampling, name) for name in MLXQ}


@pytest.mark.parametrize("model, expected", [("authored", AUTHORED), ("plain", MLXQ)])
def test_the_models_list_shows_the_defaults_a_request_gets(client, model, expected):
    shown = client.get(f"/v1/models/{model}").get_json()
    room = min(8192, shown["context_length"])  # MLXQ_MAX_TOKENS_LIMIT's default, and the model's context
    assert shown["sampling_defaults"] == {**expected, "max_tokens": room}
    listed = {m["id"]: m for m in client.get("/v1/models").get_json()["data"]}
    assert listed[model]["sampling_defaults"] == {**expected, "max_tokens": room}


def test_max_tokens_left_out_is_the_model_s_room_not_a_flat_512(client, redis_conn):
    room = client.get("/v1/models/plain").get_json()["sampling_defaults"]["max_tokens"]
    assert room > 512
    assert queued_sampling(client, redis_conn, "/v1/jobs/chat/completions",
                           {"model": "plain", "messages": QUESTION}).max_tokens == room


def test_a_response_repeats_the_settings_its_answer_was_made_with(client):
    body = client.post("/v1/responses", json={"model": "authored", "input": "Hi", "background": True}).get_json()
    assert (body["temperature"], body["top_p"]) == (AUTHORED["temperature"], AUTHORED["top_p"])
    assert body["max_output_tokens"] == client.get("/v1/models/authored").get_json()["sampling_defaults"]["max_tokens"]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": QUESTION}),
    ("/v1/jobs/chat/completions", {"messages": QUESTION}),
    ("/v1/completions", {"prompt": "2 + 2 ="}),
    ("/v1/responses", {"input": "What is 2 + 2?"}),
    ("/v1/messages", {"messages": QUESTION, "max_tokens": 8}),
], ids=["chat", "jobs", "completions", "responses", "messages"])
def test_a_field_left_out_comes_from_the_model_then_from_mlxq(client, redis_conn, path, body):
    assert fields_of(queued_sampling(client, redis_conn, path, {"model": "authored", **body})) == AUTHORED
    redis_conn.flushdb()
    worker_heartbeat.beat(redis_conn)
    assert fields_of(queued_sampling(client, redis_conn, path, {"model": "plain", **body})) == MLXQ


def test_a_field_the_request_sets_wins_even_zero_and_null_means_left_out(client, redis_conn):
    body = {"model": "authored", "messages": QUESTION, "temperature": 0.9, "top_k": 0, "top_p": None}
    got = fields_of(queued_sampling(client, redis_conn, "/v1/chat/completions", body))
    assert got == {**AUTHORED, "temperature": 0.9, "top_k": 0}


def test_only_sane_values_of_the_known_fields_are_read(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({
        "temperature": "hot", "top_p": 0, "top_k": 2.5, "min_p": 2, "repetition_penalty": True, "max_length": 20,
        "typical_p": 0.9}))
    assert sampling_defaults_of(tmp_path) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0, "top_k": 40.0, "top_p": 1}))
    assert sampling_defaults_of(tmp_path) == (("temperature", 0.0), ("top_p", 1.0), ("top_k", 40))
    (tmp_path / "generation_config.json").write_text("not json")
    assert sampling_defaults_of(tmp_path) == ()
