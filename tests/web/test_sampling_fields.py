"""presence_penalty, frequency_penalty and logit_bias at the web tier, through the real app on a real Redis
(no worker): bad values are 400s naming the field; good ones reach the queued request's sampling, on chat,
completions, async chat jobs and Responses (background ones too). Messages has no such fields: it ignores
them as it does any unknown field. What the worker does with them is tested with the worker (tests/workers/).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from jobs.contract import parse
from jobs.queues import fetch_job
from tests import worker_heartbeat

MODEL = "smollm2-135m"
VOCAB = 49152
"""The demo model's vocabulary size."""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = ("/v1/chat/completions", {"model": MODEL, "messages": QUESTION})
COMPLETION = ("/v1/completions", {"model": MODEL, "prompt": "Paris is"})
JOB = ("/v1/jobs/chat/completions", {"model": MODEL, "messages": QUESTION})
RESPONSE = ("/v1/responses", {"model": MODEL, "input": "What is the capital of France?"})
BACKGROUND = ("/v1/responses", {**RESPONSE[1], "background": True})
MESSAGE = ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": QUESTION})


@pytest.fixture()
def client(app_for, redis_conn):
    """The app on the test Redis (flushed); sync calls give up after 0.2 s (nothing drains the queues)."""
    return app_for(sync_timeout_s=0.2).test_client()


def error_of(response, status: int = 400) -> dict:
    """The envelope's error of a response that must have `status`."""
    assert response.status_code == status, response.get_data(as_text=True)
    return response.get_json()["error"]


BAD = [
    ("presence_penalty", 2.5), ("presence_penalty", -3), ("presence_penalty", "x"), ("presence_penalty", [1]),
    ("frequency_penalty", 3), ("frequency_penalty", -2.01), ("frequency_penalty", "x"),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"1.5": 1}), ("logit_bias", {"05": 1}),
    ("logit_bias", {"²": 1}), ("logit_bias", {"": 1}), ("logit_bias", {str(2**40): 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}), ("logit_bias", {"5": "x"}),
    ("logit_bias", {"5": True}), ("logit_bias", {"5": None}), ("logit_bias", {"5": [1]}),
    ("logit_bias", [[5, 1]]), ("logit_bias", "5"),
    ("logit_bias", {str(i): 1 for i in range(301)}),
    ("logit_bias", {str(VOCAB): -100}),  # one past the demo model's last token id
    ("logit_bias", {"7": 1, str(10**9): 1}),
]


@pytest.mark.parametrize("path, base", [CHAT, COMPLETION, JOB, RESPONSE],
                         ids=["chat", "completions", "jobs", "responses"])
@pytest.mark.parametrize("field, value", BAD)
def test_a_bad_value_is_a_400_naming_the_field(client, redis_conn, path, base, field, value):
    error = error_of(client.post(path, json={**base, field: value}))
    assert error["param"] == field and error["code"] == "invalid_value", error
    assert not redis_conn.keys("rq:job:*")  # refused before anything was queued


def test_an_id_outside_the_vocabulary_says_how_many_tokens_the_model_has(client):
    error = error_of(client.post(CHAT[0], json={**CHAT[1], "logit_bias": {"50256": -100}}))  # GPT-2's <|endoftext|>
    assert error["param"] == "logit_bias" and "50256" in error["message"] and str(VOCAB) in error["message"]


def test_a_background_response_checks_the_vocabulary_before_it_is_queued(client, redis_conn):
    error = error_of(client.post(BACKGROUND[0], json={**BACKGROUND[1], "logit_bias": {str(VOCAB): -100}}))
    assert error["param"] == "logit_bias" and str(VOCAB) in error["message"], error
    assert not redis_conn.keys("rq:job:*")


def test_too_many_entries_are_refused_by_count(client):
    error = error_of(client.post(CHAT[0], json={**CHAT[1], "logit_bias": {str(i): 1 for i in range(301)}}))
    assert "at most 300" in error["message"]


def _queued_sampling(redis_conn, job_id: str):
    """The sampling of the request queued as `job_id`, as the worker will read it."""
    job = fetch_job(redis_conn, job_id)
    assert job is not None, f"{job_id} was not queued"
    return parse(job.args[0]).sampling


GOOD = {"presence_penalty": 1.5, "frequency_penalty": -2,
        "logit_bias": {"0": 100, "50": -100, str(VOCAB - 1): 2.5, "7": -0.5}}


def test_good_values_reach_an_async_jobs_sampling(client, redis_conn):
    response = client.post(JOB[0], json={**JOB[1], **GOOD})
    assert response.status_code == 202, response.get_data(as_text=True)
    sampling = _queued_sampling(redis_conn, response.get_json()["id"])
    assert sampling.presence_penalty == 1.5 and sampling.frequency_penalty == -2.0
    assert sampling.logit_bias == ((0, 100.0), (7, -0.5), (50, -100.0), (VOCAB - 1, 2.5))


def test_good_values_reach_a_background_responses_sampling(client, redis_conn):
    response = client.post(BACKGROUND[0], json={**BACKGROUND[1], **GOOD})
    assert response.status_code == 200 and response.get_json()["status"] == "queued", response.get_data(as_text=True)
    sampling = _queued_sampling(redis_conn, response.get_json()["id"])
    assert (sampling.presence_penalty, sampling.frequency_penalty) == (1.5, -2.0)
    assert sampling.logit_bias == ((0, 100.0), (7, -0.5), (50, -100.0), (VOCAB - 1, 2.5))


SYNC_CALLS = {"chat": CHAT, "completions": COMPLETION, "responses": RESPONSE,
              "responses-unstored": (RESPONSE[0], {**RESPONSE[1], "store": False})}


def test_good_values_reach_each_synchronous_calls_sampling(client, redis_conn):
    """Chat, completions, and Responses stored and unstored, sent at once: each call waits out its 0.2 s, which the
    web tier notices at its next idle tick of the job's events (1 s), so one after another they took 4 s."""
    worker_heartbeat.beat(redis_conn)  # taken as served: each call is queued and waits (0.2 s) for its answer

    def post(call):
        path, base = call
        return client.application.test_client().post(path, json={**base, **GOOD})

    with ThreadPoolExecutor(len(SYNC_CALLS)) as pool:
        responses = dict(zip(SYNC_CALLS, pool.map(post, SYNC_CALLS.values()), strict=True))
    for name, response in responses.items():
        error = error_of(response, 504)
        sampling = _queued_sampling(redis_conn, error["job_id"])
        assert (sampling.presence_penalty, sampling.frequency_penalty) == (1.5, -2.0), name
        assert dict(sampling.logit_bias) == {0: 100.0, 50: -100.0, VOCAB - 1: 2.5, 7: -0.5}, name


@pytest.mark.parametrize("path, base, status", [(*JOB, 202), (*BACKGROUND, 200)], ids=["jobs", "responses"])
def test_null_and_empty_are_neutral(client, redis_conn, path, base, status):
    body = {**base, "presence_penalty": None, "frequency_penalty": None, "logit_bias": None}
    for extra in (body, {**base, "logit_bias": {}}, base):
        response = client.post(path, json=extra)
        assert response.status_code == status, response.get_data(as_text=True)
        sampling = _queued_sampling(redis_conn, response.get_json()["id"])
        assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias) == (0.0, 0.0, ())


def test_messages_ignores_them_as_unknown_fields(client, redis_conn):
    """Anthropic's Messages API has no such fields: like any field it does not know, they are dropped
    (docs/api.md), even values chat would refuse."""
    worker_heartbeat.beat(redis_conn)
    extra = {"presence_penalty": 2.5, "frequency_penalty": 1, "logit_bias": {str(VOCAB): -100}}
    response = client.post(MESSAGE[0], json={**MESSAGE[1], **extra})
    assert response.status_code == 504, response.get_data(as_text=True)  # queued, waited for, not refused
    [job_key] = redis_conn.keys("rq:job:msg-*")
    sampling = _queued_sampling(redis_conn, job_key.decode().removeprefix("rq:job:"))
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.logit_bias) == (0.0, 0.0, ())


def test_the_openapi_document_shows_the_ranges(client):
    schemas = client.get("/openapi.json").get_json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest", "JobChatRequest", "ResponsesRequest"):
        fields = schemas[name]["properties"]
        for penalty in ("presence_penalty", "frequency_penalty"):
            assert (fields[penalty]["minimum"], fields[penalty]["maximum"]) == (-2, 2), name
        bias = fields["logit_bias"]
        assert bias["type"] == "object" and bias["maxProperties"] == 300
        assert (bias["additionalProperties"]["minimum"], bias["additionalProperties"]["maximum"]) == (-100, 100)
