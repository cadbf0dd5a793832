"""Audio in chat, through the official openai client: a text model answers from a transcript."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.conftest import REPO

TEXT_MODEL = "smollm2-135m"
SPEECH = REPO / "tests" / "fixtures" / "speech"


def audio_part(name: str, fmt: str = "wav") -> dict:
    """An input_audio part holding a speech fixture."""
    data = base64.b64encode((SPEECH / name).read_bytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def ask(client, content, **kwargs):
    """One greedy chat turn with `content`."""
    return client.chat.completions.create(model=TEXT_MODEL, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=48, **kwargs)


def test_text_model_answers_from_a_transcript(openai_client):
    question = {"type": "text", "text": "What should you bring if you go outside tonight?"}
    with_audio = ask(openai_client, [audio_part("weather.wav"), question])
    without = ask(openai_client, [question])
    assert "coat" in with_audio.choices[0].message.content.lower()
    # The transcript (about 50 words) is part of the prompt the model read.
    assert with_audio.usage.prompt_tokens > without.usage.prompt_tokens + 40


def test_audio_answer_streams_the_same(openai_client):
    content = [audio_part("numbers.wav"), {"type": "text", "text": "How many apples did the shop sell on Monday?"}]
    plain = ask(openai_client, content).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in ask(openai_client, content, stream=True)
                       if chunk.choices)
    assert streamed == plain
    assert "42" in plain or "forty" in plain.lower()


def test_ogg_audio_is_decoded(openai_client):
    answer = ask(openai_client, [audio_part("weather.ogg", "ogg"),
                                 {"type": "text", "text": "Where does the wind come from?"}])
    assert "west" in answer.choices[0].message.content.lower()


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
