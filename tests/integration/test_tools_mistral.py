"""Tool calls in Mistral's markup, through the official openai client: the second tool demo model.

smollm2-135m-mistral-tools is SmolLM2-135M with a Mistral-style tool template: calls are written
`[TOOL_CALLS][{"name": ..., "arguments": {...}}]` with no end marker (the call runs to the end of the answer), and
mlx-lm's `mistral` parser reads them, a list when there are several. Not trained for tools, so the calls here are
forced (`tool_choice` naming a function, or "required"); the grammar holds the markup and the arguments to their
schema, the model fills them in. The Hermes-style demo's tests (test_tools.py) cover the rest of the surface.
"""

from __future__ import annotations

import json

import openai
import pytest

from tests.integration.test_tools import ASK, NAMED, TIME, WEATHER, assembled

MODEL = "smollm2-135m-mistral-tools"
TOOLS = {"get_weather": WEATHER, "get_time": TIME}


def ask(client, **extra):
    """A greedy chat about the weather in Paris with both tools, on the Mistral-style demo."""
    extra = {"messages": ASK, "temperature": 0, "max_tokens": 48, **extra}
    return client.chat.completions.create(model=MODEL, tools=[TIME, WEATHER], **extra)


def follows_schema(name: str, arguments: str) -> dict:
    """The arguments of a call of `name`, checked against its tool's schema (both tools take one string, city)."""
    parsed = json.loads(arguments)
    schema = TOOLS[name]["function"]["parameters"]
    assert set(parsed) == set(schema["required"]) == {"city"}, parsed
    assert isinstance(parsed["city"], str) and len(parsed["city"]) <= schema["properties"]["city"].get("maxLength", 1e9)
    return parsed


@pytest.fixture(scope="module")
def named(service):
    """The greedy answer with get_weather forced by name, asked once (checked, streamed alike, answered)."""
    client = openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    return ask(client, tool_choice=NAMED)


def test_the_model_lists_the_tools_capability(openai_client):
    models = {m.id: m for m in openai_client.models.list().data}
    assert "tools" in models[MODEL].model_extra["capabilities"]


def test_a_named_function_gives_a_parsed_call(named):
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    follows_schema("get_weather", call.function.arguments)


def test_streamed_deltas_assemble_to_the_same_call(openai_client, named):
    plain = named.choices[0].message.tool_calls[0]
    calls, content, finish = assembled(ask(openai_client, tool_choice=NAMED, stream=True))
    assert finish == "tool_calls"
    assert "[TOOL_CALLS]" not in content and not content.strip()  # the markup never streams as content
    assert list(calls) == [0] and calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(plain.function.arguments)


@pytest.mark.parametrize("parallel", [False, True])
def test_required_with_two_tools_calls_one_of_them(openai_client, parallel):
    choice = ask(openai_client, tool_choice="required", parallel_tool_calls=parallel).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and (parallel or len(calls) == 1)
    assert len({call.id for call in calls}) == len(calls)
    for call in calls:
        follows_schema(call.function.name, call.function.arguments)


def test_the_tool_round_trip_renders_and_answers(openai_client, named):
    message = named.choices[0].message
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id,
              "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "cloudy"})}
    second = ask(openai_client, messages=ASK + [message.model_dump(exclude_none=True), result], max_tokens=4)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and answer.message.tool_calls is None
    assert answer.message.content.strip()
    assert second.usage.prompt_tokens > named.usage.prompt_tokens + 20  # the call and its result reached the prompt
