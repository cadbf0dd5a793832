"""Chat and text completions through gunicorn, Redis and the real worker with SmolLM2."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tokenizer(models_dir):
    """The demo model's tokenizer, straight from its directory."""
    return AutoTokenizer.from_pretrained(str(models_dir / MODEL))


@pytest.fixture(scope="module")
def greedy(service) -> dict:
    """The greedy answer to QUESTION (40 tokens at most), asked once: the reference the stream and the stop
    sequence are compared with."""
    with httpx.Client(base_url=service.base_url, timeout=120) as api:
        return chat(api, temperature=0, max_tokens=40)


def chat(api, **body):
    """POST a chat completion and return the parsed JSON (asserting 200)."""
    response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": QUESTION, **body})
    assert response.status_code == 200, response.text
    assert response.headers["X-Request-ID"]
    return response.json()


def sse_events(response):
    """Parse an SSE response body into its data payloads (JSON, or the raw [DONE])."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_answers_paris(greedy):
    body = greedy
    assert body["object"] == "chat.completion"
    assert "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["id"].startswith("chatcmpl-")


def test_stream_joins_to_non_streamed_text(api, greedy):
    plain = greedy["choices"][0]["message"]["content"]
    with api.stream("POST", "/v1/chat/completions",
                    json={"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 40,
                          "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["X-Request-ID"]
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])


def test_usage_and_length_match_tokenizer(api, tokenizer):
    body = chat(api, temperature=0, max_tokens=5)
    prompt_ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt_ids, list):  # transformers 5 returns a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids)
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert body["choices"][0]["finish_reason"] == "length"
    text = body["choices"][0]["message"]["content"]
    assert len(tokenizer.encode(text, add_special_tokens=False)) <= 5


def test_max_completion_tokens_is_honoured(api):
    body = chat(api, temperature=0, max_completion_tokens=3)
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def test_stop_sequence_is_matched_on_text_and_never_streamed(api, greedy):
    full = greedy["choices"][0]["message"]["content"]
    assert "Paris" in full
    stop = "Paris"
    cut = chat(api, temperature=0, max_tokens=40, stop=[stop, "zzzz"])
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == full[: full.index(stop)]
    with api.stream("POST", "/v1/chat/completions",
                    json={"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 40,
                          "stream": True, "stop": stop}) as response:
        chunks = [c for c in sse_events(response)[:-1] if c["choices"]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert stop not in streamed
    assert streamed == full[: full.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_seed_makes_sampling_repeatable(api):
    a = chat(api, temperature=1.0, seed=1234, max_tokens=8)["choices"][0]["message"]["content"]
    b = chat(api, temperature=1.0, seed=1234, max_tokens=8)["choices"][0]["message"]["content"]
    assert a == b


def test_content_parts_and_system_role(api):
    body = chat(api, temperature=0, max_tokens=24, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital "},
                                     {"type": "text", "text": "of France?"}]}])
    assert "Paris" in body["choices"][0]["message"]["content"]


def test_completions_with_prompt_list(api):
    response = api.post("/v1/completions", json={"model": MODEL, "prompt": ["The capital of France is", "1, 2, 3,"],
                                                 "temperature": 0, "max_tokens": 6})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("stop", "length") for c in body["choices"])
    assert body["choices"][1]["text"].strip().startswith("4")


def test_models_list_and_get(api):
    body = api.get("/v1/models").json()
    ids = {m["id"]: m for m in body["data"]}
    assert ids[MODEL]["kind"] == "text" and ids[MODEL]["context_length"] > 0
    one = api.get(f"/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json()["id"] == MODEL
    missing = api.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
