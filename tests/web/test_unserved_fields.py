"""Fields that would change the answer but that mlxq does not serve (yet): the OpenAI and Anthropic fields for things
mlxq does not do (audio answers, web search, code containers...); thinking control is tests/web/test_thinking_fields.py.
Any value that asks for something is a 400 naming the field, in each API's own envelope, never accepted and ignored;
left out, null or a value that asks for nothing (an empty list, the API's own default), the call goes ahead.
Through the real app on a real Redis, no worker: a call that passes is queued (an async job or a background response
answers at once; a message waits for its sync timeout, a 504)."""

from __future__ import annotations

import pytest

from tests import worker_heartbeat

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION})
JOB = ("/v1/jobs/chat/completions", {"model": MODEL, "messages": QUESTION})
RESPONSE = ("/v1/responses", {"model": MODEL, "input": "What is 2 + 2?"})
MESSAGE = ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION})

FUNCTION = {"name": "add", "parameters": {"type": "object", "properties": {}}}
CHAT_REFUSED = [("functions", [FUNCTION]), ("function_call", "auto"), ("function_call", {"name": "add"}),
                ("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
                ("web_search_options", {"search_context_size": "low"})]
CHAT_PASSES = [("functions", []), ("modalities", ["text"]), ("web_search_options", {}), ("audio", None)]
RESPONSES_REFUSED = [("conversation", "conv_123"),
                     ("include", ["message.output_text.logprobs"]), ("top_logprobs", 3),
                     ("prompt", {"id": "pmpt_123"}), ("max_tool_calls", 2), ("truncation", "auto")]
RESPONSES_PASSES = [("include", []), ("top_logprobs", 0), ("truncation", "disabled")]
MESSAGES_REFUSED = [("container", "container_1"), ("mcp_servers", [{"type": "url", "url": "https://x", "name": "x"}]),
                    ("context_management", {"edits": []})]
MESSAGES_PASSES = [("mcp_servers", [])]


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis (flushed), a worker's heartbeat in it; sync calls give up after 0.2 s."""
    worker_heartbeat.beat(redis_conn)
    return app_for(sync_timeout_s=0.2).test_client()


def openai_error(response, field: str) -> None:
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == field and "not supported yet" in error["message"], error


@pytest.mark.parametrize("path, base", [CHAT, JOB], ids=["chat", "jobs"])
@pytest.mark.parametrize("field, value", CHAT_REFUSED)
def test_an_unserved_chat_field_is_a_400_naming_it(client, path, base, field, value):
    openai_error(client.post(path, json={**base, field: value}), field)


@pytest.mark.parametrize("field, value", RESPONSES_REFUSED)
def test_an_unserved_responses_field_is_a_400_naming_it(client, field, value):
    openai_error(client.post(RESPONSE[0], json={**RESPONSE[1], field: value}), field)


@pytest.mark.parametrize("field, value", MESSAGES_REFUSED)
def test_an_unserved_messages_field_is_a_400_in_anthropics_envelope(client, field, value):
    response = client.post(MESSAGE[0], json={**MESSAGE[1], field: value})
    assert response.status_code == 400, response.get_data(as_text=True)
    body = response.get_json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert field in body["error"]["message"] and "not supported yet" in body["error"]["message"], body


BACKGROUND = (RESPONSE[0], {**RESPONSE[1], "background": True})


@pytest.mark.parametrize("path, base, field, value", [*((*JOB, f, v) for f, v in CHAT_PASSES),
                                                      *((*BACKGROUND, f, v) for f, v in RESPONSES_PASSES),
                                                      *((*MESSAGE, f, v) for f, v in MESSAGES_PASSES)])
def test_a_value_that_asks_for_nothing_lets_the_call_go_ahead(client, path, base, field, value):
    # Async chat jobs and background responses answer once queued; a message waits for its sync timeout.
    response = client.post(path, json={**base, field: value})
    assert response.status_code in (200, 202, 504), response.get_data(as_text=True)
    if path == RESPONSE[0]:
        assert response.get_json()["status"] == "queued", response.get_json()
