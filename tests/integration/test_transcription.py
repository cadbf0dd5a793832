"""Speech to text end to end: gunicorn, Redis, the real worker and whisper-tiny.en on sentences of the fixtures.

What these tests check is done with a transcript, whatever its length: each request sends a sentence or two
(tests/speech_clips.py), whose window decodes faster than a whole 15 s recording's.
"""

from __future__ import annotations

import io
import json
import re
import string
import threading
import time
import wave
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import jiwer
import numpy as np
import pytest
import redis
from click.testing import CliRunner
from rq import SimpleWorker
from rq.serializers import JSONSerializer

from jobs import queues
from jobs.formats import TEXT_MIMETYPES
from jobs.webhooks import SIGNATURE_HEADER, verify
from mlxq.transcribe_cli import transcribe
from tests.conftest import REPO, wait_until
from tests.speech_clips import Clip, script_of, sentences, spaced, write
from web.app import create_app

MODEL = "whisper-tiny.en"
TEXT_MODEL = "smollm2-135m"
SPEECH = REPO / "tests" / "fixtures" / "speech"
WEBHOOK_SECRET = "test-secret"  # what the `service` fixture passes as MLXQ_WEBHOOK_SECRET
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
CUE_TIME = r"(?:\d\d:)?\d\d:\d\d[.,]\d\d\d"
AFTER_END_S = 60
"""A bound on what the worker does right after a job's last event (its record, its upload, its webhook):
a moment on an idle machine, longer on a busy one; waited for, never timed."""


@pytest.fixture(scope="module", autouse=True)
def speech_model(models_dir):
    """The Whisper demo model must be in the store."""
    if not (models_dir / MODEL).exists():
        pytest.fail(f"{MODEL} missing in {models_dir}: run `make test` or `mlxq models pull-demo` first")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, Path]:
    """The audio sent here, each file with its script beside it: "birds" (a sentence, WAV), "coat" (a sentence,
    Ogg), "harbor" (two sentences, WAV: two segments), "sparse" (six sentences 26 s apart, WAV: six windows),
    "quiet" (a second of digital silence: a job with nothing to decode)."""
    folder = tmp_path_factory.mktemp("clips")
    far_apart = spaced([sentences(name, index) for index in (0, 2) for name in ("garden", "numbers", "weather")],
                       gap_s=26.0)  # never one speech piece: each sentence is a window of its own
    return {"birds": write(sentences("garden", 2), folder / "birds.wav"),
            "coat": write(sentences("weather", 2), folder / "coat.ogg"),
            "harbor": write(sentences("train_journey", 1, 2), folder / "harbor.wav"),
            "sparse": write(far_apart, folder / "sparse.wav"),
            "quiet": write(Clip(np.zeros(16000, np.int16), ""), folder / "quiet.wav")}


def normalise(text: str) -> str:
    """Lowercase, no punctuation, single spaces (what WER is computed on)."""
    text = text.lower().replace("-", " ")
    return " ".join(text.translate(str.maketrans("", "", string.punctuation)).split())


def assert_wer(hypothesis: str, audio: Path, limit: float = 0.2):
    """The transcript is within `limit` word error rate of the script beside `audio` (a fixture or a clip)."""
    reference = normalise(script_of(audio))
    error = jiwer.wer(reference, normalise(hypothesis))
    assert error <= limit, f"WER {error:.2f} for {audio.name}: {hypothesis!r}"


def cue_texts(body: str) -> list[str]:
    """The text lines of SRT/VTT cues (everything that is not a header, a number or a timing)."""
    return [line for line in body.splitlines()
            if line.strip() and line != "WEBVTT" and not line.isdigit() and "-->" not in line]


def cue_times(body: str) -> list[tuple[str, str]]:
    """Every cue's (start, end) timing."""
    return re.findall(rf"({CUE_TIME}) --> ({CUE_TIME})", body)


def read_sse(api, url: str, headers: dict | None = None, timeout: float = 120) -> list[dict]:
    """Read an SSE stream to its end: [{"id", "event", "data"}]; fail past `timeout` seconds."""
    deadline = time.monotonic() + timeout
    events, current = [], {}
    with api.stream("GET", url, headers=headers or {}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            assert time.monotonic() < deadline, f"stream {url} still open after {timeout}s"
            if line.startswith("id: "):
                current["id"] = int(line[4:])
            elif line.startswith("event: "):
                current["event"] = line[7:]
            elif line.startswith("data: "):
                current["data"] = json.loads(line[6:])
            elif not line and current:
                events.append(current)
                current = {}
    return events


def transcribe_sync(api, audio: Path, **form):
    """POST an audio file to /v1/audio/transcriptions."""
    with open(audio, "rb") as f:
        return api.post("/v1/audio/transcriptions", data={"model": MODEL, **form}, files={"file": (audio.name, f)})


def submit_job(api, name: str | Path = "garden.wav", content: bytes | None = None, **form) -> dict:
    """POST an async transcription job of a fixture, a file or `content`; return the 202 body (after checking
    the answer's shape)."""
    content = (SPEECH / name).read_bytes() if content is None else content  # (an absolute path stays itself)
    response = api.post("/v1/jobs/transcriptions", data={"model": MODEL, **form},
                        files={"file": (Path(name).name, content)})
    assert response.status_code == 202, response.text
    body = response.json()
    assert body["object"] == "job" and body["status"] == "queued"
    assert response.headers["Location"] == body["links"]["self"] == f"/v1/jobs/{body['id']}"
    return body


# --- the OpenAI-compatible endpoint -----------------------------------------------------------

def spool_jobs(service, prefix: str = "transcr-") -> set:
    """The sync jobs' directories in the service's spool."""
    spool = service.spool_dir
    return {p.name for p in spool.iterdir() if p.name.startswith(prefix)} if spool.exists() else set()


def duration_s(wav: Path) -> float:
    """A WAV file's length in seconds."""
    with wave.open(str(wav)) as f:
        return f.getnframes() / f.getframerate()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_response_format(openai_client, api, service, clips, fmt):
    """The official client, every format: structure, content type and content (WER) checked. json is asked
    for by leaving response_format out: the default is json (what test_plain_http_json checked with a
    transcription of its own)."""
    before = spool_jobs(service)
    asked = {} if fmt == "json" else {"response_format": fmt}
    with open(clips["birds"], "rb") as f:
        raw = openai_client.audio.transcriptions.with_raw_response.create(model=MODEL, file=f, temperature=0,
                                                                          **asked)
    body = raw.parse()
    assert spool_jobs(service) <= before  # the upload is gone once the answer is out
    if fmt in ("json", "verbose_json"):
        assert raw.headers["content-type"].startswith("application/json")
        assert set(raw.http_response.json()) >= {"text"}
        assert "logprobs" not in raw.http_response.json()  # not asked for (include[]=logprobs)
        assert_wer(body.text, clips["birds"])
        if fmt == "verbose_json":
            assert body.language.startswith("en") and body.duration == pytest.approx(duration_s(clips["birds"]),
                                                                                       abs=0.5)
            segments = body.segments
            assert [s.id for s in segments] == list(range(len(segments)))
            assert all(0 <= s.start < s.end <= body.duration + 1 for s in segments)
            assert normalise(" ".join(s.text for s in segments)) == normalise(body.text)
        return
    # Each text format in its own type, exactly as /openapi.json documents it.
    assert raw.headers["content-type"] == TEXT_MIMETYPES[fmt] and isinstance(body, str)
    documented = api.get("/openapi.json").json()["paths"]["/v1/audio/transcriptions"]
    assert TEXT_MIMETYPES[fmt].split(";")[0] in documented["post"]["responses"]["200"]["content"]
    if fmt == "text":
        assert_wer(body, clips["birds"])
        return
    assert body.startswith("WEBVTT") if fmt == "vtt" else body.startswith("1\n")
    times = cue_times(body)
    assert times and len(times) == len(cue_texts(body))
    assert all(("," in start) == (fmt == "srt") for start, _ in times)
    assert_wer(" ".join(cue_texts(body)), clips["birds"])


def test_word_timestamps_on_ogg(api, clips):
    response = transcribe_sync(api, clips["coat"], response_format="verbose_json",
                               **{"timestamp_granularities[]": ["word", "segment"]})
    assert response.status_code == 200, response.text
    body = response.json()
    words = body["words"]
    assert abs(len(words) - len(body["text"].split())) <= 3
    assert all(w["start"] <= w["end"] for w in words)
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)
    assert_wer(" ".join(w["word"] for w in words), clips["coat"])
    assert_wer(body["text"], clips["coat"])
    assert body["segments"]


@pytest.mark.parametrize("chunking", [None, "auto"])
def test_each_word_says_how_sure_the_model_was(api, clips, chunking):
    extra = {"chunking_strategy": chunking} if chunking else {}
    response = transcribe_sync(api, clips["coat"], response_format="verbose_json",
                               **{"timestamp_granularities[]": ["word"]}, **extra)
    assert response.status_code == 200, response.text
    probabilities = [w["probability"] for w in response.json()["words"]]
    assert probabilities and all(0 < p <= 1 for p in probabilities)
    assert sum(probabilities) / len(probabilities) > 0.5, probabilities  # clear speech: mostly sure
    assert min(probabilities) < max(probabilities)  # a word's own figure, not one for all


def test_openai_client_stream(openai_client, service, clips):
    with open(clips["harbor"], "rb") as f:
        stream = openai_client.audio.transcriptions.create(model=MODEL, file=f, stream=True)
        events = list(stream)
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1)
    assert events[-1].type == "transcript.text.done" and len(events) >= 2
    assert normalise("".join(e.delta for e in events[:-1])) == normalise(events[-1].text)
    assert_wer(events[-1].text, clips["harbor"])
    wait_until(lambda: not spool_jobs(service), AFTER_END_S, what="the streamed job's upload to be removed")


def test_cli_sync_and_async(service, clips, tmp_path):
    out = tmp_path / "birds.srt"
    result = CliRunner().invoke(transcribe, [str(clips["birds"]), "--format", "srt", "--diarize", "--url",
                                             service.base_url, "--output", str(out)])
    assert result.exit_code == 0, result.output
    cues = cue_texts(out.read_text())
    assert cues and all(cue.startswith("[A] ") for cue in cues)  # one voice: speaker A throughout
    assert_wer(" ".join(cue.removeprefix("[A] ") for cue in cues), clips["birds"])
    result = CliRunner().invoke(transcribe, [str(clips["coat"]), "--async", "--url", service.base_url])
    assert result.exit_code == 0, result.output
    assert "queued" in result.stderr
    assert_wer(result.stdout, clips["coat"])


# --- async jobs -------------------------------------------------------------------------------

class Receiver:
    """A local webhook receiver recording each POST."""

    def __init__(self):
        self.hits: list[tuple[dict, bytes]] = []
        hits = self.hits

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                hits.append((dict(self.headers), self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def receiver():
    """A webhook receiver for the module's job."""
    receiver = Receiver()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


@pytest.fixture(scope="module")
def followed_job(service, clips, receiver) -> tuple[dict, list[dict]]:
    """One async job (with metadata and a webhook) and its events, read live from right after it was submitted:
    the job that the tests of following, replaying and notifying look at, each from its own side."""
    with httpx.Client(base_url=service.base_url, timeout=120) as api:
        job = submit_job(api, clips["harbor"], metadata=json.dumps({"team": "qa", "n": 1}), webhook_url=receiver.url)
        return job, read_sse(api, job["links"]["events"])


def test_async_job_submit_follow_result(api, followed_job):
    job, events = followed_job
    assert events[-1]["event"] == "done" and "error" not in [e["event"] for e in events]
    assert [e["id"] for e in events] == sorted(e["id"] for e in events)
    assert any(e["event"] == "segment" for e in events) and any(e["event"] == "progress" for e in events)
    assert events[-1]["data"]["result"]["segments"]
    record = api.get(job["links"]["self"]).json()
    assert record["status"] == "succeeded" and record["kind"] == "transcription" and record["model"] == MODEL
    assert record["metadata"] == {"team": "qa", "n": 1} and record["filename"] == "harbor.wav"
    assert record["result"]["text"] == events[-1]["data"]["result"]["text"]
    assert record["progress"]["percent"] == pytest.approx(100, abs=1)
    srt = api.get(job["links"]["result"], params={"format": "srt"})
    assert srt.status_code == 200 and cue_times(srt.text)
    text = api.get(job["links"]["result"], params={"format": "text"})
    assert text.status_code == 200 and text.text.strip() == record["result"]["text"].strip()
    assert api.get(job["links"]["result"]).json()["text"] == record["result"]["text"]  # default: json


def test_sse_replay_from_start_middle_and_after_end(api, followed_job):
    job, live = followed_job  # read from right after submitting: live events
    assert live[-1]["event"] == "done"
    assert len([e for e in live if e["event"] == "segment"]) >= 2  # (two sentences)
    after_end = read_sse(api, job["links"]["events"])
    assert after_end == live
    middle = live[len(live) // 2]["id"]
    assert read_sse(api, job["links"]["events"], headers={"Last-Event-ID": str(middle)}) == \
        [e for e in live if e["id"] > middle]
    assert read_sse(api, job["links"]["events"] + f"?last_event_id={middle}") == \
        [e for e in live if e["id"] > middle]
    segments = [e["data"]["segment"]["text"] for e in live if e["event"] == "segment"]
    assert normalise(" ".join(segments)) == normalise(live[-1]["data"]["result"]["text"])


def test_cancel_queued_then_running_job(api, clips):
    # Six windows, each a sentence: the job runs a while, and is canceled after its first window or two.
    running = submit_job(api, clips["sparse"])
    queued = submit_job(api, clips["birds"])
    not_ready = api.get(queued["links"]["result"])
    assert not_ready.status_code == 409 and not_ready.json()["error"]["code"] == "not_ready"
    canceled = api.delete(queued["links"]["self"])
    assert canceled.status_code == 200, canceled.text
    assert canceled.json()["status"] == "canceled"
    assert read_sse(api, queued["links"]["events"], timeout=10)[-1]["data"]["code"] == "canceled"
    assert api.get(queued["links"]["result"]).json()["error"]["code"] == "canceled"
    assert api.delete(queued["links"]["self"]).status_code == 409

    with api.stream("GET", running["links"]["events"]) as stream:  # wait until it really runs
        for line in stream.iter_lines():
            if line == "event: progress" or line == "event: segment":
                break
    response = api.delete(running["links"]["self"])
    assert response.status_code == 202, response.text
    events = read_sse(api, running["links"]["events"], timeout=60)
    assert events[-1]["event"] == "error" and events[-1]["data"]["code"] == "canceled"
    wait_until(lambda: api.get(running["links"]["self"]).json()["status"] == "canceled", AFTER_END_S,
               what="the running job's record to say canceled")


def test_job_listing_is_newest_first_with_cursors(api, clips):
    ids = [submit_job(api, clips["quiet"])["id"] for _ in range(3)]  # (if one runs, it is over at once)
    for job_id in ids:
        api.delete(f"/v1/jobs/{job_id}")  # not needed to run; canceled, canceling or done is fine
    seen, cursor = [], None
    while len(seen) < 3:
        page = api.get("/v1/jobs", params={"limit": 1, **({"cursor": cursor} if cursor else {})}).json()
        assert page["object"] == "list" and len(page["data"]) == 1
        seen.append(page["data"][0]["id"])
        cursor = page["next_cursor"]
        assert len(seen) == 3 or (page["has_more"] and cursor)
    assert seen == ids[::-1]
    listed = api.get("/v1/jobs", params={"status": "canceled", "limit": 100}).json()["data"]
    assert all(item["status"] == "canceled" for item in listed)


def test_async_chat_job(api):
    response = api.post("/v1/jobs/chat/completions", json={
        "model": TEXT_MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 24})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    record = api.get(job["links"]["self"]).json()
    assert record["status"] == "succeeded" and record["kind"] == "chat"
    assert record["result"]["object"] == "chat.completion"
    assert "Paris" in api.get(job["links"]["result"]).json()["choices"][0]["message"]["content"]


def test_webhook_arrives_once_signed(service, followed_job, receiver, monkeypatch):
    monkeypatch.setenv("MLXQ_REDIS_URL", service.redis_url)  # the in-process webhook worker's settings
    monkeypatch.setenv("MLXQ_WEBHOOK_SECRET", WEBHOOK_SECRET)
    monkeypatch.setenv("MLXQ_WEBHOOK_ALLOW_PRIVATE", "1")
    job, events = followed_job
    assert events[-1]["event"] == "done"
    connection = redis.Redis.from_url(service.redis_url)  # not `redis_conn`: that one flushes the db
    queue = queues.get_queue(queues.WEBHOOKS, connection)
    wait_until(lambda: any(j.args[0]["job_id"] == job["id"] for j in queue.jobs), AFTER_END_S,
               what="the webhook delivery job")
    for _ in range(2):  # a second pass must not deliver again
        SimpleWorker([queue], connection=connection, serializer=JSONSerializer).work(burst=True)
    assert len(receiver.hits) == 1
    headers, body = receiver.hits[0]
    assert json.loads(body) == {"id": job["id"], "status": "succeeded"}
    assert verify(WEBHOOK_SECRET, body, headers[SIGNATURE_HEADER])


# --- audio by URL ------------------------------------------------------------------------------

class AudioServer:
    """Serves the clips over HTTP on 127.0.0.1: /<name> at once, /slow/<name> in ten pieces a quarter second
    apart (a download that lasts long enough for its progress to be told), anything else 404."""

    def __init__(self, clips: dict[str, Path]):
        files = {path.name: path.read_bytes() for path in clips.values()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                slow = self.path.startswith("/slow/")
                body = files.get(self.path.removeprefix("/slow/").lstrip("/"))
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "audio/wav")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                pieces = 10 if slow else 1
                size = -(-len(body) // pieces)
                for start in range(0, len(body), size):
                    self.wfile.write(body[start:start + size])
                    self.wfile.flush()
                    if slow:
                        time.sleep(0.25)  # the server's pace, not a wait of the test's

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def audio_server(clips):
    server = AudioServer(clips)
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_job_from_a_url_is_fetched_then_transcribed(api, clips, audio_server):
    # `curl -F file_url=...`: a multipart form with no file part; the worker fetches it, telling its progress.
    response = api.post("/v1/jobs/transcriptions", files={"model": (None, MODEL),
                                                          "file_url": (None, f"{audio_server.url}/slow/harbor.wav")})
    assert response.status_code == 202, response.text
    job = response.json()
    events = read_sse(api, job["links"]["events"])
    assert events[-1]["event"] == "done", events[-1]
    downloads = [e["data"] for e in events if e["event"] == "progress" and e["data"].get("stage") == "download"]
    size = clips["harbor"].stat().st_size
    assert downloads and downloads[-1] == {"stage": "download", "bytes": size, "total_bytes": size, "percent": 100.0}
    assert any(0 < d["bytes"] < size for d in downloads)  # told while it downloaded, not only at the end
    first_segment = next(i for i, e in enumerate(events) if e["event"] == "segment")
    assert all(e["event"] != "progress" or e["data"].get("stage") != "download" for e in events[first_segment:])
    assert_wer(events[-1]["data"]["result"]["text"], clips["harbor"])
    record = api.get(job["links"]["self"]).json()
    assert record["status"] == "succeeded" and record["filename"] == "harbor.wav"


def test_url_job_form_encoded_and_failed_fetches(api, audio_server):
    # `curl -d file_url=...` (form-encoded) is taken too; a URL that answers 404 fails the job, naming file_url.
    response = api.post("/v1/jobs/transcriptions", data={"model": MODEL, "file_url": f"{audio_server.url}/gone.wav"})
    assert response.status_code == 202, response.text
    events = read_sse(api, response.json()["links"]["events"])
    assert events[-1]["event"] == "error"
    error = events[-1]["data"]
    assert (error["code"], error["param"], error["status"]) == ("file_fetch_failed", "file_url", 400)
    assert "404" in error["message"]


# --- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("content, status, code, reason", [
    (b"", 400, "invalid_audio", "empty"),
    ((SPEECH / "weather.ogg").read_bytes()[:60] + bytes(4000), 400, "invalid_audio", "corrupt"),
    (b"just some text, no sound at all\n" * 40, 415, "unsupported_media_type", "not_audio"),
])
def test_bad_audio(api, content, status, code, reason):
    response = api.post("/v1/audio/transcriptions", data={"model": MODEL}, files={"file": ("a.ogg", content)})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"], error["reason"]) == (code, "file", reason)
    assert reason.replace("_", " ") in error["message"]


@pytest.mark.parametrize("form, status, code, param", [
    ({"model": "no-such-model"}, 404, "model_not_found", "model"),
    ({"model": TEXT_MODEL}, 400, "invalid_model", "model"),
    ({"model": MODEL, "response_format": "docx"}, 400, "invalid_value", "response_format"),
    ({"model": MODEL, "temperature": "7"}, 400, "invalid_value", "temperature"),
])
def test_bad_fields(api, form, status, code, param):
    with open(SPEECH / "garden.wav", "rb") as f:
        response = api.post("/v1/audio/transcriptions", data=form, files={"file": ("g.wav", f)})
    assert response.status_code == status, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, param)


def test_missing_file_and_unknown_job(api):
    response = api.post("/v1/audio/transcriptions", data={"model": MODEL}, files={"other": ("x", b"x")})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    for method, path in (("GET", "/v1/jobs/job-nope"), ("GET", "/v1/jobs/job-nope/result"),
                         ("GET", "/v1/jobs/job-nope/events"), ("DELETE", "/v1/jobs/job-nope")):
        response = api.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["code"] == "job_not_found"


def test_limits_and_job_options_in_process(redis_url, models_dir, tmp_path):
    """Flask test client: a 1 MB limit refuses a 3 MB upload with 413; webhook/metadata validation."""
    app = create_app({"redis_url": redis_url, "models_dir": models_dir, "spool_dir": tmp_path / "spool",
                      "max_upload_mb": 1})
    client = app.test_client()
    big = {"model": MODEL, "file": (io.BytesIO(bytes(3 * 1024 * 1024)), "big.wav")}
    response = client.post("/v1/audio/transcriptions", data=big)
    assert response.status_code == 413 and response.get_json()["error"]["code"] == "file_too_large"
    for form, param in (({"webhook_url": "http://127.0.0.1:9/hook"}, "webhook_url"),
                        ({"webhook_url": "ftp://example.com/x"}, "webhook_url"),
                        ({"metadata": "[1, 2]"}, "metadata"),
                        ({"metadata": json.dumps({str(i): i for i in range(17)})}, "metadata"),
                        ({"metadata": json.dumps({"a": {"nested": 1}})}, "metadata"),
                        ({"stream": "true"}, "stream")):
        garden = (io.BytesIO((SPEECH / "garden.wav").read_bytes()), "g.wav")
        response = client.post("/v1/jobs/transcriptions", data={"model": MODEL, "file": garden, **form})
        assert response.status_code == 400, response.get_data(as_text=True)
        assert response.get_json()["error"]["param"] == param
    # A file by URL: private addresses refused (MLXQ_AUDIO_FETCH_ALLOW_PRIVATE is off), one source only.
    for form, param in (({"file_url": "http://127.0.0.1:9/meeting.wav"}, "file_url"),
                        ({"file_url": "http://10.1.2.3/meeting.wav"}, "file_url"),
                        ({"file_url": "file:///etc/passwd"}, "file_url"),
                        ({"file_url": "http://93.184.215.14/a.wav",
                          "file": (io.BytesIO((SPEECH / "garden.wav").read_bytes()), "g.wav")}, "file"),
                        ({}, "file")):
        response = client.post("/v1/jobs/transcriptions", data={"model": MODEL, **form})
        assert response.status_code == 400, response.get_data(as_text=True)
        assert response.get_json()["error"]["param"] == param, response.get_json()
    assert not list((tmp_path / "spool").glob("*/*"))  # refused uploads leave nothing behind
