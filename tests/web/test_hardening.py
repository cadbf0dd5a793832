"""Bad input, other users' jobs and the dashboard, through the real app on a real Redis (no worker needed).

Every request here is refused or answered before a worker would be involved; where a job must exist
it is queued on a Redis database no worker drains.
"""

from __future__ import annotations

import io
import json

import pytest

from jobs import records
from jobs.events import DONE, EventPublisher
from tests.conftest import REPO

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SPEECH = REPO / "tests" / "fixtures" / "speech"


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis (flushed); sync calls give up after 0.2 s (nothing drains the queues)."""
    return app_for(sync_timeout_s=0.2).test_client()


def error_of(response, status: int) -> dict:
    """The envelope's error of a response that must have `status`."""
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert set(body) == {"error", "request_id"} and body["error"]["message"]
    return body["error"]


def post_raw(client, path: str, text: str, **kwargs):
    """POST a JSON body exactly as written (escapes such as \\ud800 reach the server unchanged)."""
    return client.post(path, data=text.encode(), content_type="application/json", **kwargs)


# --- bodies that used to cause 500s ----------------------------------------------------------------

def test_json_nested_50000_deep_is_a_400(client):
    error = error_of(post_raw(client, "/v1/chat/completions", "[" * 50_000 + "]" * 50_000), 400)
    assert error["code"] == "invalid_json" and "nested too deeply" in error["message"]


def test_json_nested_past_the_depth_limit_names_the_field(client):
    deep = {"model": MODEL, "messages": QUESTION, "logit_bias": {"a": json.loads("[" * 40 + "]" * 40)}}
    error = error_of(client.post("/v1/chat/completions", json=deep), 400)
    assert "nested too deeply" in error["message"] and error["param"].startswith("logit_bias.a")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content"),
    ("/v1/completions", '{"prompt": "\\udfff tail"}', "prompt"),
    ("/v1/completions", '{"prompt": ["fine", "\\ud800"]}', "prompt.1"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, param):
    error = error_of(post_raw(client, path, body), 400)
    assert error["param"] == param and "surrogate" in error["message"]


@pytest.mark.parametrize("field, value", [
    ("seed", 2**70), ("seed", -1), ("max_tokens", 2.5), ("top_k", 2**40), ("top_k", -1), ("top_k", 1.5),
])
def test_out_of_range_numbers_are_400s(client, field, value):
    body = {"model": MODEL, "messages": QUESTION, field: value}
    assert error_of(client.post("/v1/chat/completions", json=body), 400)["param"] == field


def test_top_k_is_bounded_by_the_models_vocabulary(client):
    body = {"model": MODEL, "messages": QUESTION, "top_k": 49153}  # the demo model has 49,152 tokens
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "top_k" and "49152" in error["message"]


def test_max_tokens_is_bounded_by_the_models_context(app_for, redis_conn):
    roomy = app_for(max_tokens_limit=100_000).test_client()
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 9000}  # the demo model's context: 8,192
    error = error_of(roomy.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == "max_tokens" and "8192" in error["message"]


@pytest.mark.parametrize("prompt, param", [("", "prompt"), ([""], "prompt"), (["ok", ""], "prompt")])
def test_an_empty_prompt_is_a_400(client, prompt, param):
    error = error_of(client.post("/v1/completions", json={"model": MODEL, "prompt": prompt}), 400)
    assert error["param"] == param and "empty" in error["message"]


@pytest.mark.parametrize("text", ['{"a": NaN}', '{"a": Infinity}', '{"a": -Infinity}', '{"a": 1e400}'])
def test_metadata_that_json_cannot_carry_is_refused(client, text):
    body = f'{{"model": "{MODEL}", "messages": {json.dumps(QUESTION)}, "metadata": {text}}}'
    error = error_of(post_raw(client, "/v1/jobs/chat/completions", body), 400)
    assert "NaN" in error["message"] or "Infinity" in error["message"] or "finite" in error["message"]


def test_metadata_in_a_form_is_parsed_as_strictly(client):
    form = {"model": "whisper-tiny.en", "metadata": '{"a": NaN}',
            "file": (io.BytesIO((SPEECH / "garden.wav").read_bytes()), "g.wav")}
    assert error_of(client.post("/v1/jobs/transcriptions", data=form), 400)["param"] == "metadata"


# --- the events stream -------------------------------------------------------------------------------

def _finished_job(settings, redis_conn, owner: str = "") -> str:
    """An async job record whose events ended with `done` (ids 1 and 2)."""
    records.create(redis_conn, settings, "job-finished", "chat", {"model": MODEL, "owner": owner})
    publisher = EventPublisher(redis_conn, 60, 100)
    publisher.publish("job-finished", "progress", {"percent": 50})
    publisher.publish("job-finished", DONE, {"choices": []})
    return "job-finished"


@pytest.mark.parametrize("header", ["²", "1" * 4300, "-1", "1.5", "0x10"])
def test_a_bad_last_event_id_is_a_400(client, settings, redis_conn, header):
    job_id = _finished_job(settings, redis_conn)
    error = error_of(client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": header}), 400)
    assert error["param"] == "Last-Event-ID"


@pytest.mark.parametrize("last_seen", ["2", "7"])
def test_reconnecting_after_the_last_event_ends_at_once(client, settings, redis_conn, last_seen):
    job_id = _finished_job(settings, redis_conn)
    response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_seen})
    assert response.status_code == 204 and response.get_data() == b""  # EventSource stops on a 204
    replay = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "1"})
    assert replay.status_code == 200
    assert replay.get_data(as_text=True).count("id: ") == 1 and "event: done" in replay.get_data(as_text=True)


# --- whose jobs ----------------------------------------------------------------------------------

def test_a_key_sees_only_its_own_jobs_and_the_admin_key_sees_all(app_for, redis_conn):
    app = app_for(api_keys=("alice-key", "bob-key"), admin_key="admin-key")
    client = app.test_client()
    alice, bob, admin = ({"Authorization": f"Bearer {k}"} for k in ("alice-key", "bob-key", "admin-key"))
    submitted = client.post("/v1/jobs/chat/completions", json={"model": MODEL, "messages": QUESTION}, headers=alice)
    assert submitted.status_code == 202, submitted.get_data(as_text=True)
    job_id = submitted.get_json()["id"]

    assert client.get(f"/v1/jobs/{job_id}", headers=alice).status_code == 200
    for method, path in (("get", f"/v1/jobs/{job_id}"), ("get", f"/v1/jobs/{job_id}/result"),
                         ("get", f"/v1/jobs/{job_id}/events"), ("delete", f"/v1/jobs/{job_id}")):
        error = error_of(getattr(client, method)(path, headers=bob), 404)
        assert error["code"] == "job_not_found"
    assert client.get("/v1/jobs", headers=bob).get_json()["data"] == []
    assert [j["id"] for j in client.get("/v1/jobs", headers=alice).get_json()["data"]] == [job_id]
    assert [j["id"] for j in client.get("/v1/jobs", headers=admin).get_json()["data"]] == [job_id]
    assert client.get(f"/v1/jobs/{job_id}", headers=admin).status_code == 200
    assert "owner" not in client.get(f"/v1/jobs/{job_id}", headers=alice).get_json()
    assert records.load(redis_conn, job_id)["owner"] not in ("alice-key", "")  # a digest, never the key


# --- the dashboard -----------------------------------------------------------------------------

def test_with_user_keys_but_no_admin_key_the_dashboard_is_closed(app_for, redis_conn):
    client = app_for(api_keys=("user-key",)).test_client()
    error = error_of(client.get("/rq/", headers={"Authorization": "Bearer user-key"}), 403)
    assert error["code"] == "dashboard_closed" and "MLXQ_ADMIN_KEY" in error["message"]


def test_dashboard_actions_need_a_post_from_its_own_page(app_for, redis_conn):
    client = app_for(admin_key="adm").test_client()
    auth = {"Authorization": "Bearer adm"}
    assert client.get("/rq/", headers=auth).status_code == 200
    response = client.get("/rq/requeue/failed", headers=auth)
    assert error_of(response, 405)["code"] == "method_not_allowed" and response.headers["Allow"] == "POST"
    cross_site = client.post("/rq/requeue/failed", headers=auth)  # what a form on another site can send
    assert error_of(cross_site, 403)["code"] == "cross_site_request"
    own_page = client.post("/rq/requeue/failed", headers={**auth, "X-Requested-With": "XMLHttpRequest"})
    assert own_page.status_code == 200


# --- no server paths; accurate limits ----------------------------------------------------------------

def test_no_server_path_in_model_answers(client, settings):
    listing = client.get("/v1/models").get_json()["data"]
    demo = next(m for m in listing if m["id"] == MODEL)
    assert demo["source"].startswith("gguf:") and "/" not in demo["source"]
    error = error_of(client.post("/v1/chat/completions", json={"model": "nope", "messages": QUESTION}), 404)
    assert str(settings.models_dir) not in error["message"] and "/root" not in error["message"]
    assert "GET /v1/models" in error["message"]


def test_405_names_the_allowed_methods(client):
    response = client.delete("/v1/models")
    assert error_of(response, 405) and set(response.headers["Allow"].split(", ")) >= {"GET"}


def test_a_form_with_thousands_of_fields_gets_a_413_naming_that_limit(client):
    fields = {f"f{i}": "x" for i in range(5000)}
    response = client.post("/v1/audio/transcriptions", data={**fields, "file": (io.BytesIO(b"RIFF"), "a.wav")})
    error = error_of(response, 413)
    assert error["code"] == "form_too_large" and "parts" in error["message"]


# --- schemas llguidance cannot hold an answer to (issue 29) --------------------------------------

TOOLS_MODEL = "smollm2-135m-tools"
ENDLESS = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
NOTHING = [{"$ref": "#"}, {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
           {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}]


def _chat_format(schema: dict) -> tuple[str, dict]:
    return "/v1/chat/completions", {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def _responses_format(schema: dict) -> tuple[str, dict]:
    return "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4,
                             "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}


@pytest.mark.parametrize("schema", [*NOTHING, ENDLESS], ids=["ref-root", "ref-a-a", "ref-a-b-a", "endless"])
@pytest.mark.parametrize("build, param", [(_chat_format, "response_format.json_schema.schema"),
                                          (_responses_format, "text.format")])
def test_a_schema_no_answer_can_follow_is_a_400(client, schema, build, param):
    path, body = build(schema)
    error = error_of(client.post(path, json=body), 400)
    assert error["code"] == "unsupported_schema" and error["param"].startswith(param.split(".")[0])
    assert "$ref" in error["message"] or "never ends" in error["message"]


def test_a_recursive_schema_with_finite_answers_is_accepted(client):
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "children": {
        "type": "array", "items": {"$ref": "#"}}}, "required": ["name"]}
    path, body = _chat_format(tree)
    response = client.post(path, json=body)  # checked and accepted; then no worker answers here
    assert response.status_code in (503, 504) and response.get_json()["error"]["code"] in ("no_worker", "timeout")


def _chat_tool(parameters: dict) -> tuple[str, dict, str]:
    return "/v1/chat/completions", {"model": TOOLS_MODEL, "messages": QUESTION, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": parameters}}]}, "tools[0].function.parameters"


def _responses_tool(parameters: dict) -> tuple[str, dict, str]:
    return "/v1/responses", {"model": TOOLS_MODEL, "input": "hi", "tools": [
        {"type": "function", "name": "f", "parameters": parameters}]}, "tools[0].parameters"


def _messages_tool(parameters: dict) -> tuple[str, dict, str]:
    return "/v1/messages", {"model": TOOLS_MODEL, "max_tokens": 4, "messages": QUESTION, "tools": [
        {"name": "f", "input_schema": parameters}]}, "tools.0.input_schema"


def _message_error(response, status: int) -> str:
    """The message of an Anthropic-shaped error with `status`."""
    assert response.status_code == status, response.get_data(as_text=True)
    body = response.get_json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    return body["error"]["message"]


@pytest.mark.parametrize("options", ["fast", [1], 3])
@pytest.mark.parametrize("build", [_chat_tool, _responses_tool, _messages_tool])
def test_tool_parameters_with_llguidance_options_that_are_not_an_object_are_a_400(client, options, build):
    path, body, param = build({"type": "object", "properties": {}, "x-guidance": options})
    response = client.post(path, json=body)
    if path == "/v1/messages":
        assert _message_error(response, 400).startswith(f"{param}.x-guidance: ")
    else:
        assert error_of(response, 400)["param"] == f"{param}.x-guidance"


@pytest.mark.parametrize("build", [_chat_tool, _responses_tool, _messages_tool])
def test_tool_parameters_that_never_end_are_a_400(client, build):
    path, body, param = build(ENDLESS)
    response = client.post(path, json=body)
    if path == "/v1/messages":
        assert _message_error(response, 400).startswith(f"{param}: The parameters schema cannot be enforced")
    else:
        assert error_of(response, 400)["param"] == param


def test_response_format_options_that_are_not_an_object_are_a_400_not_ignored(client):
    path, body = _chat_format({"type": "object", "x-guidance": "compact"})
    error = error_of(client.post(path, json=body), 400)
    assert error["param"] == "response_format.json_schema.schema.x-guidance"


def test_tools_beside_a_response_format_that_admits_nothing_are_a_400(client):
    path, body, _ = _chat_tool({"type": "object", "properties": {}})
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}
    assert error_of(client.post(path, json=body), 400)["param"] == "response_format.json_schema.schema"


# --- Messages blocks of the wrong shape (issue 29) ---------------------------------------------------

@pytest.mark.parametrize("source, param", [
    ("https://example.com/a.png", "messages.0.content.0.source"), ([1], "messages.0.content.0.source"),
    (3, "messages.0.content.0.source"), ({"type": "file"}, "messages.0.content.0.source"),
    ({"type": "base64", "data": 5, "media_type": "image/png"}, "messages.0.content.0.source.data"),
    ({"type": "url", "url": ["x"]}, "messages.0.content.0.source.url"),
])
def test_an_image_block_whose_source_is_not_a_source_object_is_a_400(client, source, param):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": source}]}]}
    assert _message_error(client.post("/v1/messages", json=body), 400).startswith(f"{param}: ")


@pytest.mark.parametrize("system, param", [
    ([{"type": "text", "text": 3}], "system.0.text"), ([{"type": "text", "text": ["a"]}], "system.0.text"),
    ([{"type": "text"}], "system.0.text"), ([1], "system.0"), (["be brief"], "system.0"), (3, "system"),
    ({"type": "text", "text": "x"}, "system"),
])
def test_a_system_that_is_not_text_is_a_400_naming_it(client, system, param):
    body = {"model": MODEL, "max_tokens": 4, "messages": QUESTION, "system": system}
    assert _message_error(client.post("/v1/messages", json=body), 400).startswith(f"{param}: ")


def test_a_text_block_whose_text_is_not_a_string_is_a_400_naming_it(client):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}
    assert _message_error(client.post("/v1/messages", json=body), 400).startswith("messages.0.content.0.text: ")


# --- the room a chat body has for images and audio is for images and audio (issue 29) ----------------

def _png_data_url(size: int) -> str:
    """A data URL of `size` bytes of base64 (not a valid image: the model check refuses it first)."""
    return "data:image/png;base64," + "A" * size


@pytest.fixture()
def small_bodies(app_for, redis_conn):
    """The app with a 64 KiB body limit (MLXQ_MAX_BODY_KB); chat bodies get more room only for media."""
    return app_for(max_body_kb=64, sync_timeout_s=0.2).test_client()


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 20_000}]}),
    ("/v1/responses", {"model": MODEL, "input": "hello world " * 20_000}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 300_000}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_data_url(300_000)}}, {"type": "text", "text": "y" * 70_000}]}]}),
])
def test_text_beyond_the_body_limit_is_a_413_even_where_images_get_room(small_bodies, path, body):
    response = small_bodies.post(path, json=body)
    assert response.status_code == 413, response.get_data(as_text=True)
    assert "MLXQ_MAX_BODY_KB" in response.get_data(as_text=True)


def test_images_keep_their_room_beyond_the_body_limit(small_bodies):
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _png_data_url(300_000)}}, {"type": "text", "text": "y" * 1000}]}]}
    error = error_of(small_bodies.post("/v1/chat/completions", json=body), 400)
    assert error["code"] == "image_not_supported"  # past the size checks: the text model cannot see it


def test_a_big_body_of_many_small_values_is_refused_before_it_is_parsed(small_bodies):
    values = "[" + ",".join(["0"] * 200_000) + "]"  # JSON that would take seconds to walk and validate
    text = f'{{"model": "{MODEL}", "messages": {values}, "oops"'  # and not even valid JSON at the end
    error = error_of(post_raw(small_bodies, "/v1/chat/completions", text), 413)
    assert error["code"] == "request_too_large"


# --- found by a shape fuzz of Responses and Messages (issue 29) -----------------------------------------

@pytest.mark.parametrize("fmt", [-1.5, "json_schema", ["json_object"]])
def test_a_responses_text_format_that_is_not_an_object_is_a_400(client, fmt):
    body = {"model": MODEL, "input": "hi", "text": {"format": fmt}}
    assert error_of(client.post("/v1/responses", json=body), 400)["param"] == "text.format"


@pytest.mark.parametrize("kind", [{}, [], ["text"]])
def test_a_content_block_whose_type_is_not_a_string_is_a_400(client, kind):
    messages = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]}
    assert _message_error(client.post("/v1/messages", json=messages), 400).startswith("messages.0.content.0: ")
    responses = {"model": MODEL, "input": [{"role": "user", "content": [{"type": kind, "text": "x"}]}]}
    assert error_of(client.post("/v1/responses", json=responses), 400)["param"] == "input[0].content[0]"
