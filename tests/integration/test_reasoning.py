"""A reasoning model's thinking, apart from its answer, on every API, through the official openai and anthropic clients.

smollm2-135m-think is the SmolLM2 demo taught (a LoRA trained here) to write a short reasoning between `<think>` and
`</think>` and then an answer; its template knows `enable_thinking`. Greedy, so the plain and streamed answers agree.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import pytest

from tests.integration.test_transcription import read_sse

MODEL = "smollm2-135m-think"
ASK = [{"role": "user", "content": "What is 17 + 25?"}]
MARKERS = ("<think>", "</think>")


def chat(client, max_tokens: int = 96, **extra):
    """A greedy chat with the think demo."""
    return client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=max_tokens, **extra)


@pytest.fixture(scope="module")
def plain(service):
    """The greedy answer, asked once."""
    import openai

    client = openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    return chat(client)


def no_markers(*texts: str) -> bool:
    return not any(marker in text for text in texts for marker in MARKERS)


def test_the_model_lists_the_reasoning_capability(openai_client):
    models = {m.id: m for m in openai_client.models.list().data}
    assert "reasoning" in models[MODEL].model_extra["capabilities"]
    assert "reasoning" not in models["smollm2-135m"].model_extra["capabilities"]


def test_the_reasoning_comes_apart_from_the_answer(plain):
    message = plain.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content and no_markers(reasoning, message.content), message
    assert message.model_extra["reasoning"] == reasoning
    details = plain.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < plain.usage.completion_tokens


def test_streamed_the_reasoning_deltas_come_first_and_add_up_to_the_same(openai_client, plain):
    reasoning, content, order = "", "", []
    for chunk in chat(openai_client, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        extra = (delta.model_extra or {}) if delta else {}
        if extra.get("reasoning_content"):
            reasoning += extra["reasoning_content"]
            order.append("reasoning")
        if delta and delta.content:
            content += delta.content
            order.append("content")
    assert order and order == sorted(order, key=lambda kind: kind == "content"), order
    message = plain.choices[0].message
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)


@pytest.mark.parametrize("off", [{"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}},
                                 {"reasoning_effort": "none"}])
def test_thinking_switched_off_gives_an_answer_without_reasoning(openai_client, off):
    response = chat(openai_client, extra_body=off)
    message = response.choices[0].message
    assert not (message.model_extra or {}).get("reasoning_content") and message.content, message
    assert no_markers(message.content)
    assert response.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_thinking_budget_closes_the_block_and_the_model_answers(openai_client):
    response = chat(openai_client, extra_body={"thinking_budget": 16}, max_tokens=64)
    message = response.choices[0].message
    assert 0 < response.usage.completion_tokens_details.reasoning_tokens <= 16
    assert message.content and no_markers(message.content), message


def test_budgets_hold_for_requests_decoding_together(openai_client):
    budgets = [8, 16, None, 24, None, 12]
    with ThreadPoolExecutor(len(budgets)) as pool:
        answers = list(pool.map(lambda b: chat(openai_client, extra_body={"thinking_budget": b} if b else {}),
                                budgets))
    for budget, answer in zip(budgets, answers, strict=True):
        used = answer.usage.completion_tokens_details.reasoning_tokens
        assert used > 0 and (budget is None or used <= budget), (budget, used, answer.choices[0].message)
        assert no_markers(answer.choices[0].message.content or "")


def test_an_async_job_keeps_reasoning_and_answer_apart(api, plain):
    response = api.post("/v1/jobs/chat/completions", json={"model": MODEL, "messages": ASK, "temperature": 0,
                                                           "max_tokens": 96})
    assert response.status_code == 202, response.text
    job = response.json()
    events = read_sse(api, job["links"]["events"])
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "done" and "reasoning" in kinds
    assert kinds.index("reasoning") < kinds.index("delta") if "delta" in kinds else True
    message = api.get(job["links"]["result"]).json()["choices"][0]["message"]
    expected = plain.choices[0].message
    assert (message["reasoning_content"], message["content"]) == (expected.model_extra["reasoning_content"],
                                                                   expected.content)


def test_responses_give_a_reasoning_item_first_also_when_stored_and_streamed(openai_client, plain):
    expected = plain.choices[0].message
    response = openai_client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
                                              max_output_tokens=96)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], response.output
    assert response.output[0].summary[0].text == expected.model_extra["reasoning_content"]
    assert response.output_text == expected.content and response.usage.output_tokens_details.reasoning_tokens > 0
    stored = openai_client.responses.retrieve(response.id)
    assert [item.type for item in stored.output] == kinds and stored.output[0].summary[0].text == \
        response.output[0].summary[0].text
    events = list(openai_client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
                                                 max_output_tokens=96, stream=True))
    types = [e.type for e in events]
    assert types.index("response.reasoning_summary_text.delta") < types.index("response.output_text.delta")
    assert events[-1].response.output[0].summary[0].text == expected.model_extra["reasoning_content"]


def test_responses_reasoning_effort_none_turns_it_off(openai_client):
    response = openai_client.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0,
                                              max_output_tokens=64, reasoning={"effort": "none"})
    assert [item.type for item in response.output] == ["message"], response.output


@pytest.fixture()
def claude(service):
    return anthropic.Anthropic(base_url=service.base_url, api_key="unused", max_retries=0, timeout=120)


def test_messages_give_a_thinking_block_and_stream_it_first(claude, plain):
    expected = plain.choices[0].message
    message = claude.messages.create(model=MODEL, max_tokens=96, messages=ASK, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": 80})
    assert [block.type for block in message.content] == ["thinking", "text"], message.content
    assert message.content[0].thinking == expected.model_extra["reasoning_content"]
    assert message.content[1].text == expected.content
    with claude.messages.stream(model=MODEL, max_tokens=96, messages=ASK, extra_body={"temperature": 0}) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and "text_delta" in kinds
    assert kinds.index("text_delta") > max(i for i, kind in enumerate(kinds) if kind == "thinking_delta")
    assert [block.type for block in final.content] == ["thinking", "text"]


def test_messages_thinking_disabled_gives_no_thinking_block(claude):
    message = claude.messages.create(model=MODEL, max_tokens=64, messages=ASK, extra_body={"temperature": 0},
                                     thinking={"type": "disabled"})
    assert [block.type for block in message.content] == ["text"], message.content
    assert no_markers(message.content[0].text)


def test_a_reasoning_model_thinks_then_calls_a_tool(openai_client):
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                          "maxLength": 20}},
                                              "required": ["city"], "additionalProperties": False}}}
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], temperature=0,
        max_tokens=192, tools=[weather], tool_choice="required", parallel_tool_calls=False)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.model_extra.get("reasoning_content"), choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
