"""Any language and translation end to end: the multilingual whisper-base demo model on a Spanish clip,
through gunicorn, Redis and the real worker (each decode of the clip takes seconds on a CPU, so every test
that decodes does it once; the language detection sends the clip's first two sentences and the async job its
last one)."""

from __future__ import annotations

import jiwer
import pytest

from tests.integration.test_errors import assert_envelope
from tests.integration.test_transcription import SPEECH, cue_texts, normalise, read_sse
from tests.speech_clips import sentences, write

MODEL = "whisper-base"
ENGLISH_ONLY = "whisper-tiny.en"
CLIP = SPEECH / "es" / "park.wav"  # "Buenos días. Hoy hace buen tiempo y el cielo está azul. Por la tarde ..."


@pytest.fixture(scope="module", autouse=True)
def multilingual_model(models_dir):
    """The multilingual Whisper demo model must be in the store."""
    if not (models_dir / MODEL).exists():
        pytest.fail(f"{MODEL} missing in {models_dir}: run `make test` or `mlxq models pull-demo` first")


def post_clip(api, path: str, clip=CLIP, **form):
    """POST the Spanish clip (or another file) to `path` as a multipart form."""
    with open(clip, "rb") as f:
        return api.post(path, data={"model": MODEL, **form}, files={"file": (clip.name, f)})


def assert_english(text: str, said: tuple[str, ...] = ("morning", "park", "coffee")) -> None:
    """A translation of the clip: English words (it says good morning, the park, a coffee), not the Spanish."""
    words = normalise(text).split()
    assert words and all(word.isascii() for word in words), text
    assert set(said) <= set(words), text
    assert not {"parque", "buenos", "tarde"} & set(words), text


def test_language_omitted_is_detected_and_reported(api, tmp_path):
    # The clip's first two sentences ("Buenos días. Hoy hace buen tiempo y el cielo está azul."): enough to tell
    # the language and check the transcript.
    morning = write(sentences("es/park", 0, 2), tmp_path / "morning.wav")
    response = post_clip(api, "/v1/audio/transcriptions", morning, response_format="verbose_json")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["task"] == "transcribe" and body["language"] == "spanish"  # Whisper's name, as OpenAI reports it
    reference = normalise(morning.with_suffix(".txt").read_text())
    assert jiwer.wer(reference, normalise(body["text"])) <= 0.2, body["text"]


def test_openai_client_translates_to_english(openai_client):
    with open(CLIP, "rb") as f:
        raw = openai_client.audio.translations.with_raw_response.create(
            model=MODEL, file=f, response_format="verbose_json", temperature=0)
    body = raw.parse()
    assert raw.headers["content-type"].startswith("application/json")
    assert body.language == "english" and body.model_extra["task"] == "translate"  # OpenAI: the text's language
    assert_english(body.text)
    assert body.segments and normalise(" ".join(s.text for s in body.segments)) == normalise(body.text)
    assert 8 < body.duration < 10


def test_async_job_translates(api, tmp_path):
    # The clip's last sentence ("Por la tarde vamos al parque y tomamos un café."): enough to show the job path.
    afternoon = write(sentences("es/park", 2), tmp_path / "afternoon.wav")
    response = post_clip(api, "/v1/jobs/transcriptions", afternoon, task="translate", response_format="srt")
    assert response.status_code == 202, response.text
    job = response.json()
    events = read_sse(api, job["links"]["events"], timeout=120)
    assert events[-1]["event"] == "done", events[-1]
    segments = [e["data"]["segment"]["text"] for e in events if e["event"] == "segment"]
    assert_english(" ".join(segments), ("park", "coffee"))
    record = api.get(job["links"]["self"]).json()
    assert record["status"] == "succeeded" and record["result"]["task"] == "translate"
    srt = api.get(job["links"]["result"])  # the job's own response_format
    assert srt.status_code == 200 and srt.text.startswith("1\n")
    assert_english(" ".join(cue_texts(srt.text)), ("park", "coffee"))


def test_an_english_only_model_cannot_translate(api):
    for path, form in (("/v1/audio/translations", {}), ("/v1/jobs/transcriptions", {"task": "translate"})):
        body = assert_envelope(post_clip(api, path, model=ENGLISH_ONLY, **form), 400, "translation_not_supported",
                               "model")
        assert "English-only" in body["error"]["message"] and ENGLISH_ONLY in body["error"]["message"]


def test_an_unknown_task_is_refused(api):
    body = assert_envelope(post_clip(api, "/v1/jobs/transcriptions", task="bogus"), 400, param="task")
    assert "transcribe" in body["error"]["message"] and "translate" in body["error"]["message"]


def test_translations_ignore_language_as_any_unknown_field(api):
    # OpenAI's translations have no `language`; like every field this API does not use, it is ignored (it is
    # not validated: a value transcriptions refuse gets the model's refusal here, not a `language` one).
    assert_envelope(post_clip(api, "/v1/audio/transcriptions", model=ENGLISH_ONLY, language="not a code"), 400,
                    param="language")
    assert_envelope(post_clip(api, "/v1/audio/translations", model=ENGLISH_ONLY, language="not a code"), 400,
                    "translation_not_supported", "model")


def test_the_openapi_document_shows_translations_and_task(api):
    document = api.get("/openapi.json").json()
    form = document["paths"]["/v1/audio/translations"]["post"]["requestBody"]["content"]["multipart/form-data"]
    fields = document["components"]["schemas"][form["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
    assert {"file", "model", "prompt", "response_format", "temperature"} <= set(fields) and "language" not in fields
    assert document["components"]["schemas"]["JobTranscriptionForm"]["properties"]["task"]["enum"] == \
        ["transcribe", "translate"]
