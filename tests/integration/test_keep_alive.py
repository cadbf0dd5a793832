"""Idle unload with the real worker: a request's `keep_alive` (Ollama's field) decides how long its model stays
loaded once idle, on the text APIs and on transcriptions; a bad value is a 400 naming the field in each API's
envelope."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, wait_until
from tests.integration.test_admin_metrics import STATE_WAIT_S, holds, resident

TEXT = "smollm2-135m"
HI = [{"role": "user", "content": "Hi"}]


def chat(api, **extra) -> dict:
    response = api.post("/v1/chat/completions", json={"model": TEXT, "max_tokens": 2, "temperature": 0,
                                                      "messages": HI, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_a_model_asked_to_leave_once_idle_unloads_and_comes_back_on_the_next_request(api):
    chat(api, keep_alive=0)  # Ollama's "unload as soon as it is idle"
    holds(api, lambda models: TEXT not in models)
    chat(api, keep_alive="1h30m")  # loaded again, and kept: its keep-alive shows in the worker's state
    assert holds(api, lambda models: models.get(TEXT, {}).get("keep_alive_s") == 5400.0)
    chat(api, keep_alive="2s")
    holds(api, lambda models: TEXT not in models)  # idle for 2 s, then unloaded
    chat(api, keep_alive=-1)  # back to "until evicted" for the tests after this one
    wait_until(lambda: resident(api).get(TEXT, {}).get("keep_alive_s") == -1.0, STATE_WAIT_S,
               what="the model kept until evicted")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": HI}),
    ("/v1/completions", {"prompt": "Hi"}),
    ("/v1/responses", {"input": "Hi"}),
    ("/v1/messages", {"messages": HI}),
])
@pytest.mark.parametrize("bad", ["soon", "5 minutes", True, [5], "1e999"])
def test_a_bad_keep_alive_is_a_400_naming_the_field(api, path, body, bad):
    response = api.post(path, json={"model": TEXT, "max_tokens": 2, "keep_alive": bad, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "keep_alive" in (error.get("param") or "") + error["message"], error


def test_a_transcription_takes_keep_alive_too(api):
    speech = "whisper-tiny.en"
    clip = (REPO / "tests" / "fixtures" / "speech" / "garden.wav").read_bytes()
    response = api.post("/v1/audio/transcriptions", files={"file": ("garden.wav", clip, "audio/wav")},
                        data={"model": speech, "keep_alive": "0"})
    assert response.status_code == 200, response.text
    assert response.json()["text"].strip()
    holds(api, lambda models: speech not in models)  # unloaded once idle, as it asked
    refused = api.post("/v1/audio/transcriptions", files={"file": ("garden.wav", clip, "audio/wav")},
                       data={"model": speech, "keep_alive": "soon"})
    assert refused.status_code == 400 and "keep_alive" in refused.text, refused.text
