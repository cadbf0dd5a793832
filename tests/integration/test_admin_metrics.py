"""The operators' surface with the real service: the admin API changes what the worker holds, and
/metrics counts a known set of requests exactly."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from mlxq.admin_cli import admin
from tests.conftest import wait_until
from tests.speech_clips import sentences, write

TEXT, SPEECH = "smollm2-135m", "whisper-tiny.en"


def scrape(api) -> dict[tuple, float]:
    """Every sample of /metrics, parsed with prometheus_client's own parser: {(name, labels): value}."""
    response = api.get("/metrics")
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    """One sample's value (0 when it does not exist yet)."""
    return samples.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def resident(api) -> dict[str, dict]:
    """The models the (only) worker holds, by id, as its last heartbeat wrote them."""
    workers = api.get("/v1/admin/workers").json()["data"]
    assert len(workers) == 1, workers
    return {m["id"]: m for m in workers[0]["models"]}


STATE_WAIT_S = 60
"""A bound on waiting for a heartbeat (one a second) to show a change: it comes within a second or two on an
idle machine, but a busy one (load ~10 on 2 cores) can delay the worker's heartbeat thread far longer."""


def holds(api, check) -> dict:
    """Wait for the worker's next heartbeats (one a second) to show what `check` expects."""
    return wait_until(lambda: check(resident(api)), STATE_WAIT_S, interval=0.1, what="the worker's state to show it")


def action(api, name: str, model: str) -> dict:
    response = api.post(f"/v1/admin/models/{name}", json={"model": model})
    assert response.status_code == 200, response.text
    return response.json()


def test_admin_load_pin_unload_change_what_the_worker_holds(api):
    worker = api.get("/v1/admin/workers").json()["data"][0]
    assert worker["device"] == "cpu" and worker["budget_bytes"] > 0 and "path" not in str(worker["models"])

    loaded = action(api, "load", SPEECH)
    assert loaded["model"] == SPEECH and SPEECH in {m["id"] for m in loaded["resident"]}
    pinned = action(api, "pin", SPEECH)
    assert pinned["changed"] is True and {m["id"]: m["pinned"] for m in pinned["resident"]}[SPEECH] is True
    holds(api, lambda models: SPEECH in models and models[SPEECH]["pinned"])  # loaded, then pinned
    assert action(api, "unpin", SPEECH)["changed"] is True
    holds(api, lambda models: not models[SPEECH]["pinned"])
    unloaded = action(api, "unload", SPEECH)
    assert unloaded["changed"] is True and SPEECH not in {m["id"] for m in unloaded["resident"]}
    holds(api, lambda models: SPEECH not in models)
    assert action(api, "unload", SPEECH)["changed"] is False  # nothing left to unload


def test_an_unloaded_model_is_loaded_again_by_the_next_request(api):
    before = value(scrape(api), "mlxq_model_load_seconds_count", model=TEXT)
    assert action(api, "unload", TEXT)["changed"] is True
    holds(api, lambda models: TEXT not in models)
    chat = api.post("/v1/chat/completions", json={"model": TEXT, "max_tokens": 2, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200, chat.text
    holds(api, lambda models: TEXT in models)
    assert value(scrape(api), "mlxq_model_load_seconds_count", model=TEXT) == before + 1


def test_admin_errors(api):
    missing = api.post("/v1/admin/models/load", json={"model": "no-such-model"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert api.post("/v1/admin/models/explode", json={"model": TEXT}).status_code == 404
    assert api.post("/v1/admin/models/load", json={}).status_code == 400


def test_queues_are_listed(api):
    rows = {q["queue"]: q for q in api.get("/v1/admin/queues").json()["data"]}
    assert set(rows) == {"interactive", "batch", "webhooks"}
    assert all(isinstance(q["depth"], int) and q["oldest_age_s"] >= 0 for q in rows.values())


def test_mlxq_admin_cli(service):
    result = CliRunner().invoke(admin, ["workers", "--url", service.base_url])
    assert result.exit_code == 0, result.output
    assert "cpu" in result.output and TEXT in result.output and "RSS" in result.output
    loaded = CliRunner().invoke(admin, ["load", SPEECH, "--url", service.base_url])
    assert loaded.exit_code == 0 and f"load {SPEECH}" in loaded.output, loaded.output
    # Whisper stays loaded: the metrics test transcribes next (a load the less; loaded or not, it counts the same).


def test_metrics_count_a_known_set_of_requests(api, tmp_path):
    before = scrape(api)
    audio = write(sentences("weather", 1), tmp_path / "afternoon.wav").read_bytes()  # one sentence, ~4 s

    def chat(question: str) -> httpx.Response:
        return api.post("/v1/chat/completions", json={"model": TEXT, "max_tokens": 5, "temperature": 0,
                                                      "messages": [{"role": "user", "content": question}]})

    def transcribe() -> httpx.Response:
        return api.post("/v1/audio/transcriptions", data={"model": SPEECH, "response_format": "verbose_json"},
                        files={"file": ("afternoon.wav", audio)})

    # All at once, as clients send them: the worker decodes the chats together, beside the transcription.
    with ThreadPoolExecutor(max_workers=4) as pool:
        transcription = pool.submit(transcribe)
        answers = list(pool.map(chat, ("Hi", "Name a colour.", "Count to three.")))
        transcript = transcription.result()
    assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
    tokens = sum(a.json()["usage"]["completion_tokens"] for a in answers)
    assert api.get("/v1/nothing-here").status_code == 404
    assert transcript.status_code == 200, transcript.text

    def jobs_counted() -> dict | None:
        """A scrape with the four jobs' figures in (a worker records them just after each answer, not before)."""
        samples = scrape(api)
        ended = [value(samples, "mlxq_job_duration_seconds_count", kind=kind, outcome="succeeded")
                 - value(before, "mlxq_job_duration_seconds_count", kind=kind, outcome="succeeded")
                 for kind in ("text", "transcription")]
        return samples if ended[0] >= 3 and ended[1] >= 1 else None

    after = wait_until(jobs_counted, STATE_WAIT_S, interval=0.1, what="the worker to record the jobs' metrics")

    def grew(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("mlxq_http_requests_total", endpoint="/v1/chat/completions", method="POST", status=200) == 3
    assert grew("mlxq_http_requests_total", endpoint="<unmatched>", method="GET", status=404) == 1
    assert grew("mlxq_http_request_duration_seconds_count", endpoint="/v1/chat/completions") == 3
    assert grew("mlxq_job_duration_seconds_count", kind="text", outcome="succeeded") == 3
    assert grew("mlxq_job_duration_seconds_count", kind="transcription", outcome="succeeded") == 1
    assert grew("mlxq_queue_wait_seconds_count", queue="interactive", kind="text") == 3
    assert grew("mlxq_time_to_first_token_seconds_count", model=TEXT) == 3
    assert grew("mlxq_generated_tokens_total", model=TEXT) == tokens
    assert abs(grew("mlxq_audio_seconds_transcribed_total", model=SPEECH) - transcript.json()["duration"]) < 0.01
    assert value(after, "mlxq_workers") == 1
    assert value(after, "mlxq_queue_depth", queue="interactive") == 0
    assert value(after, "mlxq_resident_model_bytes", worker=api.get("/v1/admin/workers").json()["data"][0]["name"],
                 model=TEXT) > 0


def test_worker_memory_is_shown_and_handed_back_when_idle(api):
    chat = api.post("/v1/chat/completions", json={"model": TEXT, "max_tokens": 8, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200, chat.text
    # Two idle heartbeats after the chat: MLX's cache of freed buffers is emptied (it holds some after any chat).
    worker = wait_until(lambda: next((w for w in api.get("/v1/admin/workers").json()["data"]
                                      if w["memory"]["mlx_cache_bytes"] == 0 and not w["jobs"]), None), STATE_WAIT_S,
                        interval=0.2, what="the idle worker to empty MLX's buffer cache")
    memory, weights = worker["memory"], sum(m["bytes"] for m in worker["models"])
    assert 0 < worker["cache_limit_bytes"] < worker["budget_bytes"]
    assert worker["used_bytes"] == worker["cache_limit_bytes"] + weights
    assert memory["mlx_active_bytes"] >= weights > 0 and memory["mlx_peak_bytes"] >= memory["mlx_active_bytes"]
    assert memory["rss_peak_bytes"] >= memory["rss_bytes"] > weights

    samples = scrape(api)
    name = worker["name"]
    assert value(samples, "mlxq_worker_resident_memory_bytes", worker=name) > weights
    assert value(samples, "mlxq_worker_resident_memory_peak_bytes", worker=name) >= memory["rss_peak_bytes"]
    assert value(samples, "mlxq_worker_mlx_active_bytes", worker=name) >= weights
    assert value(samples, "mlxq_worker_mlx_peak_bytes", worker=name) >= memory["mlx_peak_bytes"]
    assert value(samples, "mlxq_worker_mlx_cache_limit_bytes", worker=name) == worker["cache_limit_bytes"]
    assert value(samples, "mlxq_worker_memory_budget_bytes", worker=name) == worker["budget_bytes"]
    assert value(samples, "mlxq_worker_memory_used_bytes", worker=name) == worker["used_bytes"]
    assert ("mlxq_worker_mlx_cache_bytes", (("worker", name),)) in samples
