"""POST /v1/messages through the official anthropic client: a message, a stream, a system prompt, an
image for the toy VLM, x-api-key, and errors in Anthropic's shape."""

from __future__ import annotations

import base64
import io

import anthropic
import pytest

from web.app import create_app
from workers.importers import shapes

MODEL = "smollm2-135m"


@pytest.fixture()
def claude(service):
    """The official anthropic client pointed at the running service."""
    return anthropic.Anthropic(base_url=service.base_url, api_key="unused", max_retries=0, timeout=120)


def ask(client, content="What is the capital of France?", **kwargs):
    # Greedy, for answers that can be compared (this client version takes no `temperature` argument).
    options = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": content}],
               "extra_body": {"temperature": 0}}
    return client.messages.create(**{**options, **kwargs})


def test_a_message(claude):
    message = ask(claude, system="You answer in one sentence.")
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and message.usage.output_tokens > 0


def test_a_stream_gives_the_same_text(claude):
    plain = ask(claude).content[0].text
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "What is the capital of France?"}]) as stream:
        streamed = stream.get_final_text()
        final = stream.get_final_message()
    assert streamed == plain and final.stop_reason in ("end_turn", "max_tokens")


def test_max_tokens_stop_reason(claude):
    assert ask(claude, "Tell me a long story.", max_tokens=3).stop_reason == "max_tokens"


def test_an_image_block_reaches_the_vision_model(claude):
    sample = next(s for s in shapes.samples(2024, 40))
    buffer = io.BytesIO()
    sample.image.save(buffer, format="PNG")
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(buffer.getvalue()).decode()}},
               {"type": "text", "text": "What is in this image?"}]
    text = ask(claude, content, model="shapes-vlm-toy", max_tokens=16).content[0].text
    assert shapes.names_correctly(text, sample.colour, sample.shape), text


def test_errors_have_anthropics_shape(claude):
    with pytest.raises(anthropic.BadRequestError) as bad:
        ask(claude, tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        ask(claude, model="no-such-model")
    assert missing.value.body["error"]["type"] == "not_found_error"


def test_x_api_key_is_accepted(redis_url):
    client = create_app({"redis_url": redis_url, "api_keys": "k1"}).test_client()
    refused = client.post("/v1/messages", json={})
    assert refused.status_code == 401
    assert refused.get_json()["type"] == "error" and refused.get_json()["error"]["type"] == "authentication_error"
    checked = client.post("/v1/messages", json={}, headers={"x-api-key": "k1"})
    assert checked.status_code == 400 and checked.get_json()["error"]["type"] == "invalid_request_error"
