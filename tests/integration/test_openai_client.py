"""The official openai client, unmodified, against the running service."""

from __future__ import annotations

import openai
import pytest

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_completions_create(openai_client):
    completion = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in completion.choices[0].message.content
    assert completion.usage.completion_tokens > 0
    assert completion.choices[0].finish_reason in ("stop", "length")


def test_chat_completions_stream(openai_client):
    plain = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32)
    stream = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=32,
                                                   stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == plain.choices[0].message.content
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_completions_create(openai_client):
    completion = openai_client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                                  max_tokens=8)
    assert "Paris" in completion.choices[0].text
    streamed = "".join(c.choices[0].text for c in openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True) if c.choices)
    assert streamed == completion.choices[0].text


def test_models_list(openai_client):
    assert MODEL in [m.id for m in openai_client.models.list()]


def test_errors_surface_as_openai_exceptions(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="no-such-model", messages=QUESTION)
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=QUESTION, n=9)
    assert info.value.body["param"] == "n"
