"""Thinking control on the three APIs: what each field means (web.intake.thinking), bad values a 400 naming the
field in the API's own envelope, and asking a model that does not reason to think a 400 too. Through the real app on
a real Redis, no worker: a call that passes is queued (an async job or a background response answers at once)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.store import ModelInfo
from tests import worker_heartbeat
from web.errors import APIError
from web.intake import EFFORT_BUDGETS, thinking

PLAIN = "smollm2-135m"  # no think markers in its template
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
JOB = "/v1/jobs/chat/completions"


def info(capabilities: tuple[str, ...] = ("reasoning",)) -> ModelInfo:
    return ModelInfo("m", Path("/nonexistent"), "text", 4096, 100, 0, "dir:/x", None, None, 0, capabilities)


@pytest.mark.parametrize(("body", "expected"), [
    ({}, (None, None, None)),
    ({"enable_thinking": False}, (None, False, None)),
    ({"enable_thinking": True, "thinking_budget": 16}, (None, True, 16)),
    ({"thinking_budget": 16}, (None, None, 16)),
    ({"chat_template_kwargs": {"enable_thinking": False, "x": 1}}, ({"enable_thinking": False, "x": 1}, False, None)),
    ({"reasoning_effort": "none"}, (None, False, None)),
    ({"reasoning_effort": "low"}, (None, True, EFFORT_BUDGETS["low"])),
    ({"reasoning_effort": "high"}, (None, True, None)),
    ({"reasoning_effort": "low", "thinking_budget": 7}, (None, True, 7)),
    ({"enable_thinking": False, "thinking_budget": 7}, (None, False, None)),  # nothing to budget
])
def test_what_the_thinking_fields_mean_together(body, expected):
    got = thinking(body, info())
    assert (got["template_kwargs"], got["enable_thinking"], got["thinking_budget"]) == expected


def test_an_effort_that_contradicts_enable_thinking_is_refused():
    with pytest.raises(APIError) as refused:
        thinking({"reasoning_effort": "high", "enable_thinking": False}, info())
    assert refused.value.param == "reasoning_effort"


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis (flushed), a worker's heartbeat in it."""
    worker_heartbeat.beat(redis_conn)
    return app_for(sync_timeout_s=0.2).test_client()


def openai_400(response, param: str, says: str) -> None:
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize(("field", "value"), [("enable_thinking", True), ("reasoning_effort", "low"),
                                              ("thinking_budget", 16),
                                              ("chat_template_kwargs", {"enable_thinking": True})])
def test_asking_a_model_that_does_not_reason_to_think_is_a_400(client, field, value):
    response = client.post(JOB, json={"model": PLAIN, "messages": QUESTION, field: value})
    param = "chat_template_kwargs.enable_thinking" if field == "chat_template_kwargs" else field
    openai_400(response, param, "does not reason")
    assert response.get_json()["error"]["code"] == "reasoning_not_supported"


@pytest.mark.parametrize(("field", "value"), [("enable_thinking", False), ("reasoning_effort", "none"),
                                              ("chat_template_kwargs", {"custom_flag": True}),
                                              ("chat_template_kwargs", {})])
def test_turning_thinking_off_or_a_template_variable_goes_ahead_on_any_model(client, field, value):
    response = client.post(JOB, json={"model": PLAIN, "messages": QUESTION, field: value})
    assert response.status_code == 202, response.get_data(as_text=True)


@pytest.mark.parametrize(("field", "value", "says"), [
    ("enable_thinking", "maybe", "boolean"),
    ("reasoning_effort", "extreme", "Must be one of"),
    ("thinking_budget", -1, "greater than or equal to 0"),
    ("thinking_budget", 1.5, "integer"),
    ("chat_template_kwargs", {"tools": []}, "set by the server"),
    ("chat_template_kwargs", {"add_generation_prompt": False}, "set by the server"),
    ("chat_template_kwargs", {"not a name": 1}, "not a template variable name"),
    ("chat_template_kwargs", {"enable_thinking": "no"}, "true or false"),
    ("chat_template_kwargs", {"blob": "x" * 17000}, "KiB"),
    ("chat_template_kwargs", [1], "Not a valid mapping"),
])
def test_a_bad_thinking_value_is_a_400_naming_its_field(client, field, value, says):
    response = client.post("/v1/chat/completions", json={"model": PLAIN, "messages": QUESTION, field: value})
    openai_400(response, field, says)


RESPONSE = {"model": PLAIN, "input": "What is 2 + 2?", "background": True}


@pytest.mark.parametrize(("reasoning", "param", "says"), [
    ({"effort": "high"}, "reasoning.effort", "does not reason"),
    ({"effort": "huge"}, "reasoning.effort", "Must be one of"),
    ({"summary": "concise"}, "reasoning.summary", "does not shorten it"),
])
def test_responses_reasoning_is_checked(client, reasoning, param, says):
    response = client.post("/v1/responses", json={**RESPONSE, "reasoning": reasoning})
    assert response.status_code == 400, response.get_data(as_text=True)
    error = response.get_json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_responses_reasoning_that_asks_nothing_of_a_plain_model_goes_ahead(client):
    response = client.post("/v1/responses", json={**RESPONSE, "reasoning": {"effort": "none", "summary": "auto"}})
    assert response.status_code == 200 and response.get_json()["status"] == "queued", response.get_json()
    assert response.get_json()["reasoning"] == {"effort": "none", "summary": "auto", "generate_summary": None}


MESSAGE = {"model": PLAIN, "max_tokens": 64, "messages": QUESTION}


@pytest.mark.parametrize(("value", "names"), [
    ({"type": "enabled", "budget_tokens": 32}, "does not reason"),
    ({"type": "enabled", "budget_tokens": 64}, "thinking.budget_tokens"),  # not below max_tokens
    ({"type": "enabled"}, "thinking.budget_tokens"),
    ({"type": "sometimes"}, "thinking.type"),
    ("on", "thinking"),
])
def test_messages_thinking_is_checked_in_anthropics_envelope(client, value, names):
    response = client.post("/v1/messages", json={**MESSAGE, "thinking": value})
    assert response.status_code == 400, response.get_data(as_text=True)
    body = response.get_json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert names in body["error"]["message"], body
