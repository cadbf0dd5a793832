"""logprobs / top_logprobs through the official openai client: present, negative, consistent with the
greedy choice, the same streamed as plain, on a lone request, a batch (n > 1), completions and a VLM."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.integration.test_transcription import read_sse

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def chat(client, **kwargs):
    options = {"model": MODEL, "messages": ASK, "max_tokens": 12, "temperature": 0, **kwargs}
    return client.chat.completions.create(**options)


@pytest.fixture(scope="module")
def answers(service) -> dict:
    """The text model's answers the tests below check, asked at once so that they decode together in one batch
    (a greedy row gives in a batch what it gives alone: test_batching): a "greedy" chat with logprobs and 3
    top_logprobs, the "streamed" chunks of the same, one that did not ask ("unasked"), a "sampled" n=3 batch,
    and a "completion"."""
    client = openai.OpenAI(base_url=service.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    asks = {
        "greedy": lambda: chat(client, logprobs=True, top_logprobs=3),
        "streamed": lambda: list(chat(client, logprobs=True, top_logprobs=3, stream=True)),
        "unasked": lambda: chat(client, max_tokens=2),
        "sampled": lambda: chat(client, logprobs=True, top_logprobs=1, n=3, temperature=1.0, seed=7, max_tokens=8),
        "completion": lambda: client.completions.create(model=MODEL, prompt="The capital of France is",
                                                        max_tokens=8, temperature=0, logprobs=2),
    }
    with ThreadPoolExecutor(len(asks)) as pool:
        futures = {name: pool.submit(ask) for name, ask in asks.items()}
        return {name: future.result(timeout=300) for name, future in futures.items()}


@pytest.fixture(scope="module")
def greedy(answers):
    """The greedy chat's choice: checked, and streamed alike."""
    return answers["greedy"].choices[0]


def test_greedy_tokens_are_the_most_likely_ones(greedy):
    choice = greedy
    entries = choice.logprobs.content
    assert entries and "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.token == e.top_logprobs[0].token  # greedy picks the likeliest
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob, abs_tol=1e-4)
        assert bytes(e.bytes).decode() == e.token


def test_no_logprobs_unless_asked(answers):
    assert answers["unasked"].choices[0].logprobs is None


def test_streamed_logprobs_are_the_plain_ones(answers, greedy):
    plain = greedy.logprobs.content
    streamed = [e for chunk in answers["streamed"]
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in plain]
    assert all(len(e.top_logprobs) == 3 for e in streamed)


def test_sampled_choices_in_a_batch_carry_their_own(answers):
    response = answers["sampled"]
    assert len(response.choices) == 3
    for choice in response.choices:
        entries = choice.logprobs.content
        assert "".join(e.token for e in entries) == choice.message.content
        # A sampled token is at most as likely as the likeliest one.
        assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-4 for e in entries)


def test_completions_use_the_older_shape(answers):
    choice = answers["completion"].choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    # mlx-lm's streaming detokenizer drops the first token's leading space from the text; the token keeps it
    assert "".join(lp.tokens).lstrip() == choice.text.lstrip() and choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(alternatives) == 2 for alternatives in lp.top_logprobs)


def test_an_async_job_keeps_them(api):
    response = api.post("/v1/jobs/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 6,
                                                           "temperature": 0, "logprobs": True})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    choice = api.get(job["links"]["result"]).json()["choices"][0]
    assert [e["token"] for e in choice["logprobs"]["content"]] and choice["logprobs"]["content"][0]["top_logprobs"] == []


def test_the_vision_model_gives_them_too(openai_client):
    choice = openai_client.chat.completions.create(model="shapes-vlm-toy", messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0, logprobs=True,
                                                   top_logprobs=1).choices[0]
    assert choice.logprobs.content and all(e.logprob <= 0 for e in choice.logprobs.content)


@pytest.mark.parametrize("extra, param", [({"top_logprobs": 2}, "top_logprobs"),
                                          ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_bad_logprobs_requests_are_400(openai_client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(openai_client, **extra)
    assert info.value.body["param"] == param
