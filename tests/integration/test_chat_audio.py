"""Audio in chat, through the official openai client: a text model answers from a transcript (of a sentence of
a speech fixture: what is checked is that the transcript reaches the prompt, which one sentence shows)."""

from __future__ import annotations

import base64
import json

import openai
import pytest

from tests.speech_clips import sentences, write

TEXT_MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict:
    """Two sentences of weather.wav: "coat" (its last, as Ogg) and "wind" (its first, as WAV)."""
    folder = tmp_path_factory.mktemp("chat-audio")
    return {"coat": write(sentences("weather", 2), folder / "coat.ogg"),
            "wind": write(sentences("weather", 0), folder / "wind.wav")}


def audio_part(path, fmt: str = "wav") -> dict:
    """An input_audio part holding an audio file."""
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def ask(client, content, max_tokens: int = 48, **kwargs):
    """One greedy chat turn with `content`."""
    return client.chat.completions.create(model=TEXT_MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=max_tokens, **kwargs)


def test_text_model_answers_from_a_transcript(openai_client, clips):
    # In Ogg: a compressed part is decoded as well as a WAV one (the other test sends a WAV).
    question = {"type": "text", "text": "What should you bring if you go outside tonight?"}
    with_audio = ask(openai_client, [audio_part(clips["coat"], "ogg"), question])
    without = ask(openai_client, [question], max_tokens=1)  # only its prompt's length is compared
    assert "coat" in with_audio.choices[0].message.content.lower()
    # The transcript (17 words) is part of the prompt the model read.
    assert with_audio.usage.prompt_tokens > without.usage.prompt_tokens + 12


def test_a_forced_tool_call_from_a_transcript_parses(openai_client, clips):
    tool = {"type": "function", "function": {"name": "bring", "description": "Note what to bring outside.",
                                             "parameters": {"type": "object",
                                                            "properties": {"item": {"enum": ["coat", "hat", "umbrella"]}},
                                                            "required": ["item"], "additionalProperties": False}}}
    answer = openai_client.chat.completions.create(
        model="smollm2-135m-tools", temperature=0, max_tokens=32, tools=[tool], parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "bring"}},
        messages=[{"role": "user", "content": [audio_part(clips["coat"], "ogg"),
                                               {"type": "text", "text": "What should you bring outside tonight?"}]}])
    assert answer.choices[0].message.tool_calls, answer.choices[0].message.content
    (call,) = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and call.function.name == "bring"
    assert json.loads(call.function.arguments)["item"] in ("coat", "hat", "umbrella")


def test_audio_answer_streams_the_same(openai_client, clips):
    content = [audio_part(clips["wind"]), {"type": "text", "text": "Where does the wind come from?"}]
    plain = ask(openai_client, content).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in ask(openai_client, content, stream=True)
                       if chunk.choices)
    assert streamed == plain
    assert "west" in plain.lower()


@pytest.mark.parametrize("data, code", [
    ("bm90IGF1ZGlv", "invalid_audio"),  # base64 of "not audio"
    ("***", "invalid_audio"),
])
def test_bad_audio_is_a_400(openai_client, data, code):
    with pytest.raises(openai.BadRequestError) as info:
        ask(openai_client, [{"type": "input_audio", "input_audio": {"data": data, "format": "wav"}},
                            {"type": "text", "text": "hi"}])
    assert info.value.body["code"] == code
    assert info.value.body["param"].startswith("messages[0].content[0]")


def test_text_model_refuses_an_image(openai_client):
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
    with pytest.raises(openai.BadRequestError) as info:
        ask(openai_client, [{"type": "text", "text": "What is this?"},
                            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}])
    assert info.value.body["code"] == "image_not_supported"
    assert "cannot see images" in info.value.body["message"]
    assert info.value.body["param"] == "messages[0].content[1]"
