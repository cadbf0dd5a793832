"""Structured output through the official openai client: every answer under a JSON schema parses and
validates, sampled hot, plain, streamed, batched (n > 1) and async."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.integration.test_transcription import read_sse

MODEL = "smollm2-135m"
CITY = {
    "type": "object",
    # At most 16 characters: even 4-byte ones (an emoji is several tokens) end well inside max_tokens.
    "properties": {"city": {"type": "string", "maxLength": 16},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a city as JSON."}]


def city_format(schema: dict = CITY) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


def test_json_schema_answers_always_validate_over_8_hot_samples(openai_client):
    def ask(seed: int) -> list[tuple[str, str]]:
        response = openai_client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=city_format(), temperature=1.0, n=4, max_tokens=128,
            seed=seed)
        return [(c.message.content, c.finish_reason) for c in response.choices]

    # 2 requests x n=4 choices, sent at once: all 8 rows decode together in the batch, two requests' grammars
    # side by side. Every sample walks every kind of state the schema has (a bounded string, a bounded integer,
    # a boolean, the closing brace), ~30 constrained steps each at temperature 1: a state the grammar let
    # through would show in 8 samples as in 20 (the streamed and the async tests below add two more).
    with ThreadPoolExecutor(2) as pool:
        answers = [answer for choices in pool.map(ask, range(2)) for answer in choices]
    assert len(answers) == 8
    for content, finish in answers:
        assert finish == "stop", (content, finish)
        jsonschema.validate(json.loads(content), CITY)
    assert len({content for content, _ in answers}) > 1  # sampled, not one forced answer


def test_json_object_is_an_object(openai_client):
    # A small object: the answer closes it (~25 tokens on this seed, and on seeds 2 to 4) and ends there, so the
    # whole answer is parsed. Asked about cats in general the model nests objects until max_tokens, and the test
    # could only check that the text began with "{".
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a small JSON object with a cat's name."}],
        response_format={"type": "json_object"}, temperature=0.7, max_tokens=96, seed=1)
    choice = response.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict)


def test_streamed_structured_answer_joins_to_valid_json(openai_client):
    stream = openai_client.chat.completions.create(model=MODEL, messages=ASK, response_format=city_format(),
                                                   temperature=1.0, max_tokens=128, seed=11, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), CITY)


def test_async_job_with_a_schema(api):
    response = api.post("/v1/jobs/chat/completions", json={
        "model": MODEL, "messages": ASK, "response_format": city_format(), "temperature": 1.0, "max_tokens": 128,
        "seed": 5})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    result = api.get(job["links"]["result"]).json()
    jsonschema.validate(json.loads(result["choices"][0]["message"]["content"]), CITY)


@pytest.mark.parametrize("schema, named", [({"not": {"type": "string"}}, "not"),
                                           ({"type": "array", "contains": {"type": "integer"}}, "contains"),
                                           ({"$ref": "#/definitions/missing"}, "missing")])
def test_a_schema_that_cannot_be_enforced_is_a_400_naming_the_feature(openai_client, schema, named):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=ASK, response_format=city_format(schema))
    body = info.value.body
    assert body["code"] == "unsupported_schema" and body["param"] == "response_format.json_schema.schema"
    assert named in body["message"]


def test_a_malformed_response_format_is_a_400(api):
    for fmt, param in [({"type": "yaml"}, "response_format.type"),
                       ({"type": "json_schema"}, "response_format.json_schema"),
                       ({"type": "json_schema", "json_schema": {"name": "bad name!"}}, "response_format.json_schema.name")]:
        response = api.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "response_format": fmt})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
