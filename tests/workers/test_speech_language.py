"""Languages in the speech backend, with the real multilingual whisper-base and English-only tiny.en models."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from jobs import contract
from jobs.errors import InvalidRequest
from tests.conftest import REPO
from workers.backends import whisper
from workers.backends.speech import build_result, check_task

SPEECH = REPO / "tests" / "fixtures" / "speech"


def load_model(models_dir, name: str):
    """A demo Whisper model from the store, loaded as the worker loads it."""
    if not (models_dir / name).exists():
        pytest.fail(f"{name} missing in {models_dir}: run `make test` or `mlxq models pull-demo` first")
    return whisper.load(models_dir / name)[0]


@pytest.fixture(scope="module")
def spanish_then_silence(tmp_path_factory):
    """The Spanish clip, then 25 s of silence: two windows, the second with nothing to hear."""
    path = tmp_path_factory.mktemp("language") / "spanish_then_silence.wav"
    with wave.open(str(SPEECH / "es" / "park.wav")) as src:
        frames = src.readframes(src.getnframes())
    with wave.open(str(path), "wb") as dst:
        dst.setnchannels(1), dst.setsampwidth(2), dst.setframerate(16000)
        dst.writeframes(frames + np.zeros(25 * 16000, dtype=np.int16).tobytes())
    return path


def test_the_language_is_detected_once_and_kept(models_dir, spanish_then_silence):
    model = load_model(models_dir, "whisper-base")
    assert model.is_multilingual
    # Every window decoded (no voice activity detection, which would skip the silent one): the language
    # must be kept across windows.
    chunks = list(whisper.transcribe_chunks(model, spanish_then_silence, whisper.Options(vad=False)))
    assert len(chunks) >= 2 and chunks[-1].finished
    # Detected on the first window and kept: silence, were it detected again, is not Spanish ("en" here).
    assert [chunk.state.language for chunk in chunks] == ["es"] * len(chunks)
    result = build_result([seg for chunk in chunks for seg in chunk.segments], chunks[-1].state.language, 33.7, False)
    assert result["language"] == "spanish" and result["task"] == "transcribe" and "parque" in result["text"]


def test_a_translation_reports_english_and_an_english_only_model_refuses_it(whisper_model, whisper_ref):
    # tiny.en as the worker holds it: the session's (test_speech and others load it anyway).
    assert build_result([], "es", 1.0, False, task="translate") | {"text": ""} == \
        {"task": "translate", "language": "english", "duration": 1.0, "text": "", "segments": []}
    model, ref = whisper_model, whisper_ref
    request = contract.TranscriptionRequest("job-1", ref, "unused.wav", task="translate")
    with pytest.raises(InvalidRequest, match="English-only") as refused:
        check_task(model, request)
    assert refused.value.code == "translation_not_supported" and refused.value.param == "model"
    check_task(model, contract.TranscriptionRequest("job-2", ref, "unused.wav"))  # transcribing is fine
