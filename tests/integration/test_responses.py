"""POST /v1/responses through the official openai client: plain, streamed, continued with
previous_response_id, structured, stored and fetched, calling functions; errors in the envelope."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.conftest import wait_until

MODEL = "smollm2-135m"


def create(client, **kwargs):
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 12, **kwargs})


def at_once(asks: dict) -> dict:
    """Each of `asks`' calls made at the same time (their responses decode together in one batch; a greedy row
    gives in a batch what it gives alone: test_batching), by name."""
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {name: pool.submit(call) for name, call in asks.items()}
        return {name: future.result(timeout=300) for name, future in futures.items()}


def module_client(service) -> openai.OpenAI:
    """The official client for the module's fixtures."""
    return openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)


# At most 12 characters: even 4-byte ones (an emoji is several tokens) end well inside 96 tokens.
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
          "required": ["answer"], "additionalProperties": False}
JSON_ANSWER = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}


@pytest.fixture(scope="module")
def texts(service) -> dict:
    """The text model's answers that depend on no other, asked at once: a stored "plain" one with instructions
    and metadata, "colours" (not stored) and its "streamed" events, and a "structured" one."""
    client = module_client(service)
    return at_once({
        "plain": lambda: create(client, input="What is the capital of France?", instructions="Be brief.",
                                metadata={"k": "v"}),
        "colours": lambda: create(client, input="Name three colours.", store=False),
        "streamed": lambda: list(create(client, input="Name three colours.", store=False, stream=True)),
        "structured": lambda: create(client, input="What is the capital of France? Answer in JSON.",
                                     max_output_tokens=96, text=JSON_ANSWER),
    })


def test_a_string_input_gets_a_completed_response_stored_as_it_was_answered(openai_client, texts):
    response = texts["plain"]
    assert response.status == "completed" and response.object == "response"
    assert response.output_text and response.output[0].role == "assistant"
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 5
    assert openai_client.responses.retrieve(response.id).model_dump() == response.model_dump()


def test_the_stream_ends_with_completed_and_its_text_is_the_plain_one(openai_client, texts):
    plain_response = texts["colours"]
    plain = plain_response.output_text
    events = texts["streamed"]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain == events[-1].response.output_text
    # store=False keeps neither of them.
    for response_id in (plain_response.id, events[-1].response.id):
        with pytest.raises(openai.NotFoundError):
            openai_client.responses.retrieve(response_id)


def test_previous_response_id_continues_the_conversation(openai_client):
    # Only token counts and the stored text are compared: a few tokens of each answer show them.
    first = create(openai_client, input=[{"role": "user", "content": "My name is Ada. Remember it."}],
                   instructions="You are brief.", max_output_tokens=4)
    second = create(openai_client, input="What is my name?", previous_response_id=first.id, max_output_tokens=2)
    assert second.previous_response_id == first.id
    # The earlier turn (question and answer) is part of the prompt the model read.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert openai_client.responses.retrieve(second.id).output_text == second.output_text


def test_structured_output_through_text_format(texts):
    response = texts["structured"]
    assert response.status == "completed", (response.status, response.output_text, response.usage)
    assert set(json.loads(response.output_text)) == {"answer"}


def test_errors(openai_client):
    with pytest.raises(openai.NotFoundError) as missing:
        create(openai_client, input="Hi", previous_response_id="resp-nothing")
    assert missing.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as item:
        create(openai_client, input=[{"type": "item_reference", "id": "msg_x"}])
    assert item.value.body["param"] == "input[0]"
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp-unknown")


def test_background_returns_at_once_and_is_fetched_when_done(openai_client):
    # 24 tokens: the greeting ends inside them (cut by max_output_tokens the response would be incomplete).
    started = create(openai_client, input="Say hello.", background=True, max_output_tokens=24)
    assert started.status in ("queued", "in_progress") and started.background is True
    done = wait_until(lambda: (r := openai_client.responses.retrieve(started.id)).status not in
                      ("queued", "in_progress") and r, 60, interval=0.2, what="the background response to end")
    assert done.status == "completed", (done.status, done.output_text)
    assert done.output_text and done.usage.output_tokens > 0
    follow_up = create(openai_client, input="And again?", previous_response_id=started.id,
                       max_output_tokens=1)  # only its prompt's length is compared
    assert follow_up.usage.input_tokens > done.usage.input_tokens


def test_a_background_response_can_be_canceled(openai_client):
    started = create(openai_client, input="Write a very long story.", background=True, max_output_tokens=2000)
    canceled = openai_client.responses.cancel(started.id)
    assert canceled.status in ("cancelled", "in_progress")
    final = wait_until(lambda: (r := openai_client.responses.retrieve(started.id)).status != "in_progress" and r, 60,
                       interval=0.2, what="the cancel to take effect")
    assert final.status == "cancelled"


# Function calling. The tools model is a 135M model not trained for tools: left to choose ("auto") it
# answers in text, so the tests force the call (a grammar holds it to the tool's schema) and leave
# parallel calls off (allowed them, the tiny model repeats its call until max_output_tokens).
TOOLS_MODEL = "smollm2-135m-tools"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
WEATHER_QUESTION = "What is the weather like in Paris today?"
NAMED = {"type": "function", "name": "get_weather"}


def call(client, **kwargs):
    return create(client, **{"model": TOOLS_MODEL, "tools": [WEATHER], "parallel_tool_calls": False,
                             "max_output_tokens": 48, "input": WEATHER_QUESTION, **kwargs})


def the_call(response):
    """The response's one function_call item, checked."""
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1, response.output
    item = calls[0]
    assert item.name == "get_weather" and item.status == "completed", item
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    assert isinstance(json.loads(item.arguments)["city"], str), item.arguments
    return item


def calls_of(output) -> list:
    return [(item.type, getattr(item, "name", None), getattr(item, "arguments", None)) for item in output]


def output_of(item) -> dict:
    """A function_call output item as the next request's input item."""
    return {"type": "function_call_output", "call_id": item.call_id,
            "output": json.dumps({"temperature_c": 21, "sky": "sunny"})}


@pytest.fixture(scope="module")
def forced(service):
    """The stored answer to WEATHER_QUESTION with tool_choice `choice` (NAMED or "required"), asked once per
    module: the tests below compare with it or go on from it."""
    client = module_client(service)
    answers = {}

    def get(choice):
        key = json.dumps(choice, sort_keys=True)
        if key not in answers:
            answers[key] = call(client, tool_choice=choice)
        return answers[key]
    return get


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_tool_choice_gives_a_function_call_item(forced, choice):
    response = forced(choice)
    assert response.status == "completed", (response.status, response.output)
    the_call(response)
    assert response.output[-1].type == "function_call"
    # The response echoes the tool fields as given.
    echoed = response.model_dump()
    assert echoed["tool_choice"] == choice and echoed["parallel_tool_calls"] is False
    assert echoed["tools"][0]["name"] == "get_weather"


def test_the_streamed_call_is_the_plain_one(openai_client, forced):
    plain = forced(NAMED)
    events = list(call(openai_client, tool_choice=NAMED, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert calls_of(final.output) == calls_of(plain.output)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [the_call(plain).arguments]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.output_index for e in added] == list(range(len(final.output)))
    assert added[-1].item.type == "function_call" and added[-1].item.arguments == ""
    item = the_call(final)
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert [e.item.id for e in events if e.type == "response.output_item.done"][-1] == item.id


def test_a_call_answered_in_input_completes_with_text(openai_client, forced):
    first = forced(NAMED)
    item = the_call(first)
    answer = create(openai_client, model=TOOLS_MODEL, tools=[WEATHER], input=[
        {"role": "user", "content": WEATHER_QUESTION},
        {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments},
        output_of(item)], max_output_tokens=4)  # a few words of text show the answer is text
    assert answer.status in ("completed", "incomplete") and answer.output_text.strip(), answer.output
    assert [i.type for i in answer.output] == ["message"]
    assert answer.usage.input_tokens > first.usage.input_tokens  # the call and its result were read


def test_a_background_call_is_fetched_like_a_plain_one_and_answered_by_previous_response_id(openai_client, forced):
    plain = forced(NAMED)
    started = call(openai_client, tool_choice=NAMED, background=True)
    done = wait_until(lambda: (r := openai_client.responses.retrieve(started.id)).status == "completed" and r, 60,
                      interval=0.2, what="the background response to complete")
    assert calls_of(done.output) == calls_of(plain.output)
    answer = create(openai_client, model=TOOLS_MODEL, tools=[WEATHER], previous_response_id=started.id,
                    input=[output_of(the_call(done))], max_output_tokens=4)
    assert answer.status in ("completed", "incomplete") and answer.output_text.strip(), answer.output
    # The stored call came back as the assistant's turn: the prompt holds it and its result.
    assert answer.usage.input_tokens > done.usage.input_tokens + done.usage.output_tokens


@pytest.mark.parametrize("kwargs, param, code", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}}, "tool_choice", "invalid_value"),
    ({"tools": [WEATHER], "model": MODEL}, "tools", "tools_not_supported"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id",
     "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "call_x", "name": "get_weather", "arguments": "[1]"}]},
     "input[0].arguments", "invalid_value"),
])
def test_tool_errors_name_the_field(openai_client, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as error:
        create(openai_client, **{"model": TOOLS_MODEL, "input": "Hi", **kwargs})
    assert (error.value.body["param"], error.value.body["code"]) == (param, code), error.value.body
