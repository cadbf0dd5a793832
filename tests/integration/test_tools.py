"""Tool calling in chat through the official openai client, on the tool-template demo model.

smollm2-135m-tools is SmolLM2-135M with a Hermes-style tool template: not trained for tools, so the
calls here are asked for with `tool_choice` "required" or a named function, which a grammar holds
the answer to; the model fills in the arguments (it reads "Paris" out of the question).
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.test_transcription import read_sse

MODEL = "smollm2-135m-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def ask(client, **extra):
    """A greedy chat about the weather in Paris with both tools."""
    extra = {"messages": ASK, "temperature": 0, "max_tokens": 64, **extra}
    return client.chat.completions.create(model=MODEL, tools=[TIME, WEATHER], **extra)


@pytest.fixture(scope="module")
def named(service):
    """The greedy answer with get_weather forced by name and no parallel calls, asked once: checked, streamed
    alike (with parallel calls allowed: still one call) and answered."""
    client = openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    return ask(client, tool_choice=NAMED, parallel_tool_calls=False)


def test_the_model_lists_the_tools_capability(openai_client):
    models = {m.id: m for m in openai_client.models.list().data}
    assert "tools" in models[MODEL].model_extra["capabilities"]
    assert "tools" not in models["smollm2-135m"].model_extra["capabilities"]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_is_parsed_into_tool_calls(openai_client, named, choice):
    response = named if choice == NAMED else ask(openai_client, tool_choice=choice, parallel_tool_calls=False)
    choice0 = response.choices[0]
    assert choice0.finish_reason == "tool_calls"
    assert choice0.message.content is None
    (call,) = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    if choice == NAMED:
        assert call.function.name == "get_weather"
    assert "paris" in arguments["city"].lower()


def assembled(chunks) -> tuple[dict, str, str | None]:
    """A streamed chat's tool calls put together from their deltas (by index: id, name, arguments), its content
    and its finish reason, as a client does."""
    calls, content, finish = {}, "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += part.id or ""
            call["name"] += part.function.name or ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, content, finish


def test_streamed_tool_call_deltas_assemble_to_the_same_call(openai_client, named):
    plain = named.choices[0].message.tool_calls[0]
    calls, content, finish = assembled(ask(openai_client, tool_choice=NAMED, stream=True))
    assert finish == "tool_calls"
    assert "<tool_call>" not in content and not content.strip()  # the markup never streams as content
    assert list(calls) == [0]
    assert calls[0]["name"] == plain.function.name
    assert json.loads(calls[0]["arguments"]) == json.loads(plain.function.arguments)
    assert calls[0]["id"].startswith("call_")


def test_the_tool_round_trip_completes(openai_client, named):
    first = named
    message = first.choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id,
              "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "cloudy"})}
    conversation = ASK + [message.model_dump(exclude_none=True), result]
    second = ask(openai_client, messages=conversation, max_tokens=4)  # a few words show it answers in text
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content.strip()
    # The call and its result reached the prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 20


def test_every_choice_of_a_batched_request_calls(openai_client):
    response = ask(openai_client, tool_choice=NAMED, n=2, temperature=1.0, seed=4)
    assert [c.finish_reason for c in response.choices] == ["tool_calls", "tool_calls"]
    for choice in response.choices:
        assert "city" in json.loads(choice.message.tool_calls[0].function.arguments)


def test_an_async_job_keeps_its_tool_calls(api):
    # The tools of the other tests: the prompt's tool preamble is in the worker's prompt cache already.
    response = api.post("/v1/jobs/chat/completions", json={
        "model": MODEL, "messages": ASK, "tools": [TIME, WEATHER], "tool_choice": NAMED, "temperature": 0,
        "max_tokens": 64})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    result = api.get(job["links"]["result"]).json()
    assert result["choices"][0]["finish_reason"] == "tool_calls"
    assert result["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_auto_lets_the_model_answer_in_text(openai_client):
    answer = ask(openai_client, tool_choice="auto", max_tokens=16).choices[0]
    if answer.message.tool_calls is None:  # this untrained model answers in prose
        assert "<tool_call>" not in (answer.message.content or "") or answer.finish_reason == "length"
    else:
        assert answer.finish_reason == "tool_calls"


def bad_request(client, **body) -> dict:
    """The error body of a chat the server must refuse with 400."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, "max_tokens": 8, **body})
    return info.value.body


def test_a_model_without_tool_support_refuses_tools(openai_client):
    error = bad_request(openai_client, model="smollm2-135m", tools=[WEATHER])
    assert error["code"] == "tools_not_supported" and error["param"] == "tools"
    assert MODEL in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"messages": ASK + [{"role": "tool", "content": "18 degrees"}]}, "messages.1.tool_call_id"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
])
def test_bad_tool_input_is_a_400_naming_the_field(openai_client, body, param):
    error = bad_request(openai_client, **body)
    assert error["param"] == param, error
    assert error["message"]
