"""POST /v1/messages through the official anthropic client: a message, a stream, a system prompt, an
image for the toy VLM, tool use (forced calls, streamed, the round trip), x-api-key, and errors in
Anthropic's shape."""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest

from web.app import create_app
from workers.demo import shapes

MODEL = "smollm2-135m"
TOOLS_MODEL = "smollm2-135m-tools"
"""SmolLM2-135M with a Hermes-style tool template: not trained for tools, so calls are forced with
tool_choice (a grammar holds the answer to a call; the model fills in the arguments)."""
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                            "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather like in Paris today?"
NAMED = {"type": "tool", "name": "get_weather"}


@pytest.fixture()
def claude(service):
    """The official anthropic client pointed at the running service."""
    return anthropic.Anthropic(base_url=service.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def module_claude(service):
    """The anthropic client for module fixtures."""
    return anthropic.Anthropic(base_url=service.base_url, api_key="unused", max_retries=0, timeout=120)


def stream_question(client, **kwargs):
    """The default question streamed (greedy): its final text and message."""
    with client.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0}, **kwargs,
                                messages=[{"role": "user", "content": "What is the capital of France?"}]) as stream:
        return stream.get_final_text(), stream.get_final_message()


@pytest.fixture(scope="module")
def texts(module_claude) -> dict:
    """The text model's messages that depend on no other, asked at once so that they decode together in one
    batch (a greedy row gives in a batch what it gives alone: test_batching): the default question "plain" and
    "streamed", one with a "system" prompt, and one cut "short" by max_tokens."""
    asks = {"plain": lambda: ask(module_claude),
            "streamed": lambda: stream_question(module_claude),
            "system": lambda: ask(module_claude, system="You answer in one sentence."),
            "short": lambda: ask(module_claude, "Tell me a long story.", max_tokens=3)}
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {name: pool.submit(call) for name, call in asks.items()}
        return {name: future.result(timeout=300) for name, future in futures.items()}


@pytest.fixture(scope="module")
def plain(texts):
    """The greedy text of the default question: what the stream and stop sequences compare with."""
    return texts["plain"].content[0].text


def ask(client, content="What is the capital of France?", **kwargs):
    # Greedy, for answers that can be compared (this client version takes no `temperature` argument).
    options = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": content}],
               "extra_body": {"temperature": 0}}
    return client.messages.create(**{**options, **kwargs})


def test_a_message(texts):
    message = texts["system"]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 10 and message.usage.output_tokens > 0


def test_a_stream_gives_the_same_text(texts, plain):
    streamed, final = texts["streamed"]
    assert streamed == plain and final.stop_reason in ("end_turn", "max_tokens")


def test_max_tokens_stop_reason(texts):
    assert texts["short"].stop_reason == "max_tokens"


def test_a_stop_sequence_is_reported_as_such(claude, plain):
    word = plain.split()[1]  # a word the greedy answer is sure to reach
    message = ask(claude, stop_sequences=["zzz-never", word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == plain[: plain.index(word)]
    _, final = stream_question(claude, stop_sequences=[word])
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


def test_an_image_block_reaches_the_vision_model(claude):
    sample = next(s for s in shapes.samples(2024, 40))
    buffer = io.BytesIO()
    sample.image.save(buffer, format="PNG")
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": base64.b64encode(buffer.getvalue()).decode()}},
               {"type": "text", "text": "What is in this image?"}]
    text = ask(claude, content, model="shapes-vlm-toy", max_tokens=16).content[0].text
    assert shapes.names_correctly(text, sample.colour, sample.shape), text


def ask_tools(client, messages=None, **kwargs):
    """A greedy question about the weather in Paris, with the get_weather tool."""
    options = {"model": TOOLS_MODEL, "max_tokens": 64, "tools": [WEATHER], "extra_body": {"temperature": 0},
               "messages": messages or [{"role": "user", "content": QUESTION}]}
    return client.messages.create(**{**options, **kwargs})


@pytest.fixture(scope="module")
def named_call(module_claude):
    """The greedy answer with the named tool forced, asked once: checked, streamed alike and answered."""
    return ask_tools(module_claude, tool_choice=NAMED)


def only_tool_use(message):
    """The message's one tool_use block (blank text beside a call is no block)."""
    (block,) = message.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    return block


@pytest.mark.parametrize("choice", [NAMED, {"type": "any", "disable_parallel_tool_use": True}])
def test_a_forced_call_is_a_tool_use_block(claude, named_call, choice):
    message = named_call if choice == NAMED else ask_tools(claude, tool_choice=choice)
    block = only_tool_use(message)
    assert block.name == "get_weather"
    assert isinstance(block.input, dict) and set(block.input) == {"city"} and isinstance(block.input["city"], str)
    assert "paris" in block.input["city"].lower()
    assert message.stop_reason == "tool_use" and message.stop_sequence is None


def test_a_streamed_call_assembles_to_the_same_tool_use(claude, named_call):
    plain = only_tool_use(named_call)
    kinds = []
    with claude.messages.stream(model=TOOLS_MODEL, max_tokens=64, tools=[WEATHER], tool_choice=NAMED,
                                extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": QUESTION}]) as stream:
        for event in stream:
            if event.type.startswith(("message_", "content_block_")):
                kinds.append((event.type, getattr(event, "index", None)))
        final = stream.get_final_message()
    assert kinds == [("message_start", None), ("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_stop", 0), ("message_delta", None), ("message_stop", None)]
    streamed = only_tool_use(final)
    assert (streamed.name, streamed.input) == (plain.name, plain.input)
    assert final.stop_reason == "tool_use"


def test_the_tool_round_trip_completes(claude, named_call):
    first = named_call
    call = only_tool_use(first)
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": [{"type": "text", "text": "18 degrees and sunny"}]},
                                            {"type": "text", "text": "Answer in one sentence."}]}]
    answer = ask_tools(claude, history, max_tokens=6)  # a few words show it answers in text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.content[0].type == "text" and answer.content[0].text.strip()
    # The call and its result were read (the start of the conversation may come from the prompt cache: read,
    # not processed, as Anthropic counts it).
    read = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert read > first.usage.input_tokens + first.usage.cache_read_input_tokens + 10


def anthropic_400(call) -> str:
    """The message of the 400 that `call` raises, checked for Anthropic's shape."""
    with pytest.raises(anthropic.BadRequestError) as bad:
        call()
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    return bad.value.body["error"]["message"]


def test_tool_errors_are_400s_naming_the_field(claude):
    assert anthropic_400(lambda: ask_tools(claude, model=MODEL)).startswith("tools: Model 'smollm2-135m' cannot")
    unknown = anthropic_400(lambda: ask_tools(claude, tool_choice={"type": "tool", "name": "get_time"}))
    assert unknown.startswith("tool_choice") and "get_time" in unknown
    assert anthropic_400(lambda: ask_tools(claude, tool_choice={"type": "sometimes"})).startswith("tool_choice: ")
    not_object = {**WEATHER, "input_schema": {"type": "string"}}
    assert anthropic_400(lambda: ask_tools(claude, tools=[not_object])).startswith("tools.0.input_schema: ")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    history = [{"role": "user", "content": QUESTION},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [image]}]}]
    assert anthropic_400(lambda: ask_tools(claude, history)).startswith("messages.2.content.0.content.0: ")
    unanswered = [*history[:2], {"role": "user", "content": "Well?"}]
    assert "toolu_1" in anthropic_400(lambda: ask_tools(claude, unanswered))


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
