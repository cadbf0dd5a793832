"""chunking_strategy through the API: the official openai client asks for "auto" and the silent
minute between two sentences of the speech fixtures yields no segment; an async job takes it too; bad values
are 400s."""

from __future__ import annotations

import pytest

from tests.integration.test_transcription import SPEECH, read_sse
from tests.speech_clips import sentences, spaced, write

MODEL = "whisper-tiny.en"
GAP_S = 60.0


@pytest.fixture(scope="module")
def gap_file(tmp_path_factory):
    """garden's second sentence (the brother, the fence), a minute of digital silence, train_journey's first (the
    train, the coast): (path, where the silence starts). A short sentence a side (11 words each), not a whole
    recording: what is checked is the silence."""
    before = sentences("garden", 1)
    path = write(spaced([before, sentences("train_journey", 0)], GAP_S),
                 tmp_path_factory.mktemp("vad") / "gap.wav")
    return path, before.duration_s


def assert_nothing_in_the_gap(segments, gap_start: float) -> None:
    assert segments, "the speech around the silence should be transcribed"
    for seg in segments:
        assert seg["end"] <= gap_start + 0.5 or seg["start"] >= gap_start + GAP_S - 0.5, seg


def test_auto_chunking_through_the_openai_client(openai_client, gap_file):
    path, gap_start = gap_file
    with open(path, "rb") as f:
        result = openai_client.audio.transcriptions.create(model=MODEL, file=f, response_format="verbose_json",
                                                           chunking_strategy="auto")
    assert_nothing_in_the_gap([s.model_dump() for s in result.segments], gap_start)
    assert "fence" in result.text.lower() and "coast" in result.text.lower()


def test_an_async_job_with_server_vad(api, gap_file):
    path, gap_start = gap_file
    with open(path, "rb") as f:  # OpenAI's {"type": "server_vad"} object, as a form sends it
        response = api.post("/v1/jobs/transcriptions", files={"file": ("gap.wav", f, "audio/wav")},
                            data={"model": MODEL, "chunking_strategy[type]": "server_vad"})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    result = api.get(job["links"]["result"], params={"format": "verbose_json"}).json()
    assert_nothing_in_the_gap(result["segments"], gap_start)


@pytest.mark.parametrize("field, value", [("chunking_strategy", "sometimes"),
                                          ("chunking_strategy[type]", "client_vad")])
def test_an_unknown_chunking_strategy_is_a_400(api, field, value):
    with open(SPEECH / "weather.wav", "rb") as f:
        response = api.post("/v1/audio/transcriptions", files={"file": ("w.wav", f, "audio/wav")},
                            data={"model": MODEL, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
