"""POST /v1/responses through the official openai client: plain, streamed, continued with
previous_response_id, structured, stored and fetched; errors in the envelope."""

from __future__ import annotations

import json

import openai
import pytest

from tests.conftest import wait_until

MODEL = "smollm2-135m"


def create(client, **kwargs):
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 24, **kwargs})


def test_a_string_input_gets_a_completed_response(openai_client):
    response = create(openai_client, input="What is the capital of France?")
    assert response.status == "completed" and response.object == "response"
    assert response.output_text and response.output[0].role == "assistant"
    assert response.usage.output_tokens > 0 and response.usage.input_tokens > 5


def test_the_stream_ends_with_completed_and_its_text_is_the_plain_one(openai_client):
    plain = create(openai_client, input="Name three colours.", store=False).output_text
    events = list(create(openai_client, input="Name three colours.", store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-1] == "response.completed" and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain == events[-1].response.output_text


def test_previous_response_id_continues_the_conversation(openai_client):
    first = create(openai_client, input=[{"role": "user", "content": "My name is Ada. Remember it."}],
                   instructions="You are brief.")
    second = create(openai_client, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The earlier turn (question and answer) is part of the prompt the model read.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert openai_client.responses.retrieve(second.id).output_text == second.output_text


def test_structured_output_through_text_format(openai_client):
    # At most 12 characters: even 4-byte ones (an emoji is several tokens) end well inside 96 tokens.
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}},
              "required": ["answer"], "additionalProperties": False}
    response = create(openai_client, input="What is the capital of France? Answer in JSON.", max_output_tokens=96,
                      text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}})
    assert response.status == "completed", (response.status, response.output_text, response.usage)
    assert set(json.loads(response.output_text)) == {"answer"}


def test_errors(openai_client):
    with pytest.raises(openai.NotFoundError) as missing:
        create(openai_client, input="Hi", previous_response_id="resp-nothing")
    assert missing.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as tools:
        create(openai_client, input="Hi", tools=[{"type": "function", "name": "f", "parameters": {}}])
    assert tools.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as item:
        create(openai_client, input=[{"type": "function_call_output", "call_id": "x", "output": "1"}])
    assert item.value.body["param"] == "input[0]"
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp-unknown")


def test_store_false_keeps_nothing(openai_client):
    response = create(openai_client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(response.id)


def test_background_returns_at_once_and_is_fetched_when_done(openai_client):
    started = create(openai_client, input="Say hello.", background=True)
    assert started.status in ("queued", "in_progress") and started.background is True
    done = wait_until(lambda: (r := openai_client.responses.retrieve(started.id)).status == "completed" and r, 60,
                      interval=0.2, what="the background response to complete")
    assert done.output_text and done.usage.output_tokens > 0
    follow_up = create(openai_client, input="And again?", previous_response_id=started.id)
    assert follow_up.usage.input_tokens > done.usage.input_tokens


def test_a_background_response_can_be_canceled(openai_client):
    started = create(openai_client, input="Write a very long story.", background=True, max_output_tokens=2000)
    canceled = openai_client.responses.cancel(started.id)
    assert canceled.status in ("cancelled", "in_progress")
    final = wait_until(lambda: (r := openai_client.responses.retrieve(started.id)).status != "in_progress" and r, 60,
                       interval=0.2, what="the cancel to take effect")
    assert final.status == "cancelled"
