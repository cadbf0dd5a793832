"""Reasoning and thinking controls, which mlxq does not honour yet (issue 32): any value is a 400 naming the
field, in each API's own envelope, never accepted and ignored; left out, null or an empty object, the call goes
ahead. Through the real app on a real Redis (no worker: a call that passes is queued and waits 0.2 s, a 504)."""

from __future__ import annotations

import pytest

from tests import worker_heartbeat

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION})
JOB = ("/v1/jobs/chat/completions", {"model": MODEL, "messages": QUESTION})
RESPONSE = ("/v1/responses", {"model": MODEL, "input": "What is 2 + 2?"})
MESSAGE = ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION})

CHAT_FIELDS = [("reasoning_effort", "low"), ("reasoning_effort", "none"), ("enable_thinking", True),
               ("enable_thinking", False), ("thinking_budget", 16), ("chat_template_kwargs", {"enable_thinking": False})]


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis (flushed), a worker's heartbeat in it; sync calls give up after 0.2 s."""
    worker_heartbeat.beat(redis_conn)
    return app_for(sync_timeout_s=0.2).test_client()


@pytest.mark.parametrize("path, base", [CHAT, JOB], ids=["chat", "jobs"])
@pytest.mark.parametrize("field, value", CHAT_FIELDS)
def test_a_thinking_control_on_chat_is_a_400_naming_it(client, path, base, field, value):
    response = client.post(path, json={**base, field: value})
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == field and "not supported yet" in error["message"], error


def test_reasoning_on_responses_is_a_400_naming_it(client):
    response = client.post(RESPONSE[0], json={**RESPONSE[1], "reasoning": {"effort": "high"}})
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == "reasoning" and "not supported yet" in error["message"], error


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])
def test_thinking_on_messages_is_a_400_in_anthropics_envelope(client, thinking):
    response = client.post(MESSAGE[0], json={**MESSAGE[1], "thinking": thinking})
    assert response.status_code == 400, response.get_data(as_text=True)
    body = response.get_json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert "thinking" in body["error"]["message"] and "not supported yet" in body["error"]["message"], body


@pytest.mark.parametrize("path, base, field, value", [
    (*CHAT, "reasoning_effort", None), (*CHAT, "chat_template_kwargs", {}), (*CHAT, "enable_thinking", None),
    (*RESPONSE, "reasoning", None), (*MESSAGE, "thinking", None)])
def test_left_empty_they_let_the_call_go_ahead(client, path, base, field, value):
    response = client.post(path, json={**base, field: value})
    assert response.status_code == 504, response.get_data(as_text=True)  # queued and waited for, not refused
