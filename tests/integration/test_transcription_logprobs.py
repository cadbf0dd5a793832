"""include[]=logprobs through the API: the official openai client gets each text token's log-probability in
`json` and in the stream's events, an async job keeps them in its result, and a format with no room for them
is refused (on sentences of the fixtures: what is checked is per token, not per minute). Without include[]
there are none: test_transcription's test_every_response_format checks it in json and verbose_json."""

from __future__ import annotations

import pytest

from tests.integration.test_transcription import (  # noqa: F401  (clips: a fixture)
    assert_wer,
    clips,
    read_sse,
    submit_job,
    transcribe_sync,
)

MODEL = "whisper-tiny.en"


def assert_entries(entries: list[dict], text: str) -> None:
    """One entry per text token: the tokens spell the text, log-probabilities are <= 0, bytes are the token's."""
    assert entries and "".join(e["token"] for e in entries).strip() == text.strip()
    # (the openai client types `bytes` as floats)
    assert all(e["logprob"] <= 0 and bytes(map(int, e["bytes"])) == e["token"].encode() for e in entries)


def test_openai_client_json_with_logprobs(openai_client, clips):  # noqa: F811
    with open(clips["birds"], "rb") as f:
        result = openai_client.audio.transcriptions.create(model=MODEL, file=f, response_format="json",
                                                           include=["logprobs"])
    assert_wer(result.text, clips["birds"])
    assert_entries([e.model_dump() for e in result.logprobs], result.text)


def test_openai_client_stream_with_logprobs(openai_client, clips):  # noqa: F811
    with open(clips["harbor"], "rb") as f:
        events = list(openai_client.audio.transcriptions.create(model=MODEL, file=f, stream=True,
                                                                include=["logprobs"]))
    deltas, done = events[:-1], events[-1]
    assert deltas and all(e.type == "transcript.text.delta" for e in deltas) and done.type == "transcript.text.done"
    for delta in deltas:
        assert_entries([e.model_dump() for e in delta.logprobs], delta.delta)
    assert [e.model_dump() for e in done.logprobs] == [e.model_dump() for d in deltas for e in d.logprobs]


def test_an_async_batched_job_keeps_them(api, clips):  # noqa: F811
    job = submit_job(api, clips["birds"], chunking_strategy="auto", **{"include[]": "logprobs"})
    events = read_sse(api, job["links"]["events"])
    assert events[-1]["event"] == "done"
    segments = [e["data"] for e in events if e["event"] == "segment"]
    assert segments and all(s["logprobs"] and "logprobs" not in s["segment"] for s in segments)
    body = api.get(job["links"]["result"], params={"format": "json"}).json()
    assert_entries(body["logprobs"], body["text"])
    verbose = api.get(job["links"]["result"], params={"format": "verbose_json"}).json()
    assert verbose["logprobs"] == body["logprobs"]
    assert all("logprobs" not in seg for seg in verbose["segments"])


@pytest.mark.parametrize("form, message", [
    ({"include[]": "logprobs", "response_format": "srt"}, "json or verbose_json"),
    ({"include[]": "logprobs", "response_format": "text"}, "json or verbose_json"),
    ({"include[]": "tokens"}, "Must be one of"),
])
def test_what_cannot_be_included_is_a_400(api, clips, form, message):  # noqa: F811
    response = transcribe_sync(api, clips["birds"], **form)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and error["param"].startswith("include[]") and message in error["message"]
