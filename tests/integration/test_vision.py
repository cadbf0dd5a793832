"""Images in chat, end to end: the official openai client, the real web tier and worker, the toy VLM.

shapes-vlm-toy (built by `mlxq models pull-demo`) names one coloured shape; the pictures here come
from seeds it never saw in training, so a right answer means the image really reached the model.
"""

from __future__ import annotations

import base64
import io
import socket
import struct
import threading
import zlib
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
import redis

from tests.integration.test_transcription import read_sse
from workers.demo import shapes
from workers.demo.pull import DEMO_VLM

TEXT_MODEL = "smollm2-135m"
QUESTION = "What is in this image?"
HELD_OUT_SEED = 2024  # training used seed 1, the build's checks seeds 2 and 3


def png_bytes(image) -> bytes:
    """An image as PNG bytes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """A base64 data URL."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **extra) -> dict:
    """An image_url content part."""
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def ask(client, content, model: str = DEMO_VLM, **kwargs):
    """One greedy chat turn."""
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          temperature=0, max_tokens=16, **kwargs)


@pytest.fixture(scope="module")
def pictures() -> list[shapes.Sample]:
    """Held-out pictures: six with different colour-shape pairs."""
    seen, picked = set(), []
    for sample in shapes.samples(HELD_OUT_SEED, 40):
        if (sample.colour, sample.shape) not in seen:
            seen.add((sample.colour, sample.shape))
            picked.append(sample)
    return picked[:6]


@pytest.fixture(scope="module")
def image_server(tmp_path_factory, pictures):
    """A local HTTP server on 127.0.0.1 (allowed in the test service) serving the pictures as PNG and JPEG."""
    root = tmp_path_factory.mktemp("images")
    for i, sample in enumerate(pictures):
        sample.image.save(root / f"{i}.png")
        sample.image.save(root / f"{i}.jpg", quality=95)
    handler = partial(SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_models_list_reports_capabilities(openai_client):
    listed = {m.id: m for m in openai_client.models.list().data}
    assert sorted(listed[DEMO_VLM].capabilities) == ["tools", "vision"]
    assert listed[TEXT_MODEL].capabilities == []


def _picture_question(sample) -> list[dict]:
    """The question about one picture, sent as a data URL."""
    return [image_part(data_url(png_bytes(sample.image))), {"type": "text", "text": QUESTION}]


def test_names_held_out_pictures_from_data_urls_streamed_or_not(openai_client, pictures):
    answers = [ask(openai_client, _picture_question(s)) for s in pictures]
    wrong = [(s.colour, s.shape, a.choices[0].message.content) for s, a in zip(pictures, answers, strict=True)
             if not shapes.names_correctly(a.choices[0].message.content, s.colour, s.shape)]
    assert len(wrong) <= 1, wrong
    assert all(a.usage.prompt_tokens > 4 for a in answers)  # the image tokens were part of the prompt

    # One of them again, streamed: its deltas join to the plain answer (greedy: the same text).
    plain = answers[2].choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in ask(openai_client, _picture_question(pictures[2]), stream=True) if chunk.choices)
    assert streamed == plain and plain


@pytest.mark.parametrize("suffix, i", [("png", 0), ("jpg", 1)])
def test_names_pictures_fetched_from_http_urls(openai_client, pictures, image_server, suffix, i):
    answer = ask(openai_client, [image_part(f"{image_server}/{i}.{suffix}", detail="low"),
                                 {"type": "text", "text": QUESTION}]).choices[0].message.content
    assert shapes.names_correctly(answer, pictures[i].colour, pictures[i].shape), answer


def test_two_images_in_one_message_are_both_seen(openai_client, pictures):
    first, second = next((a, b) for a in pictures for b in pictures
                         if a.colour != b.colour and a.shape != b.shape)
    answer = ask(openai_client, [image_part(data_url(png_bytes(first.image))),
                                 image_part(data_url(png_bytes(second.image))),
                                 {"type": "text", "text": "What is in these images?"}]).choices[0].message.content
    words = answer.lower()
    for sample in (first, second):
        assert sample.colour in words and sample.shape in words, (first, second, answer)
    assert words.index(first.colour) < words.index(second.colour)  # in order


def test_text_only_chat_on_the_vision_model(openai_client):
    answer = ask(openai_client, "What is the capital of France?")  # greedy: a short answer, then its end
    assert "paris" in answer.choices[0].message.content.lower() and answer.usage.completion_tokens > 0


def test_async_job_with_an_image(api, pictures):
    sample = pictures[3]
    response = api.post("/v1/jobs/chat/completions", json={
        "model": DEMO_VLM, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": [image_part(data_url(png_bytes(sample.image))),
                                                  {"type": "text", "text": QUESTION}]}]})
    assert response.status_code == 202, response.text
    job = response.json()
    assert read_sse(api, job["links"]["events"])[-1]["event"] == "done"
    result = api.get(job["links"]["result"]).json()
    assert shapes.names_correctly(result["choices"][0]["message"]["content"], sample.colour, sample.shape)


def test_mlxq_chat_with_an_image(service, pictures, tmp_path):
    from click.testing import CliRunner

    from mlxq.chat_cli import chat

    sample = pictures[4]
    path = tmp_path / "picture.png"
    sample.image.save(path)
    result = CliRunner().invoke(chat, ["--image", str(path), "--url", service.base_url, "--max-tokens", "16",
                                       "--temperature", "0", QUESTION])
    assert result.exit_code == 0, result.output
    assert shapes.names_correctly(result.output, sample.colour, sample.shape), result.output


def test_a_text_model_refuses_an_image(openai_client, pictures):
    with pytest.raises(openai.BadRequestError) as info:
        ask(openai_client, [image_part(data_url(png_bytes(pictures[0].image))), {"type": "text", "text": "hi"}],
            model=TEXT_MODEL)
    assert info.value.body["code"] == "image_not_supported"
    assert "cannot see images" in info.value.body["message"] or "image" in info.value.body["message"]


def png_bomb(side: int) -> bytes:
    """A valid PNG header claiming side x side pixels, with a tiny (truncated) body."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\0" * (side * 3 + 1) * 4)  # a few rows of zeros: the rest would inflate to 10 GB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", row) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def silent_server():
    """An address that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/never.png"


def _bad_inputs(image_server, silent_server) -> dict:
    """Each bad image_url and the error code it must get."""
    return {
        "corrupt png": (data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * 200), "invalid_image"),
        "not an image": (data_url(b"just some text"), "invalid_image"),
        "unsupported format": (data_url(b"II*\0\x08\0\0\0" + b"\0" * 64, "image/tiff"), "invalid_image"),
        "bad base64": ("data:image/png;base64,***not base64***", "invalid_image_url"),
        "404": (f"{image_server}/missing.png", "image_fetch_failed"),
        "timeout": (silent_server, "image_fetch_failed"),
        "ftp url": ("ftp://example.com/a.png", "invalid_image_url"),
    }


@pytest.mark.parametrize("case", ["corrupt png", "not an image", "unsupported format", "bad base64", "404",
                                  "timeout", "ftp url"])
def test_bad_images_are_400s_and_leave_nothing_behind(api, service, image_server, silent_server, case):
    url, code = _bad_inputs(image_server, silent_server)[case]
    before_spool, before_jobs = _spooled_chats(service), _queued_chats(service)
    response = api.post("/v1/chat/completions", json={
        "model": DEMO_VLM, "messages": [{"role": "user", "content": [
            {"type": "text", "text": QUESTION}, image_part(url)]}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["param"] == "messages[0].content[1].image_url.url", error
    assert error["message"].startswith("messages[0].content[1]") and "Traceback" not in response.text
    assert _spooled_chats(service) <= before_spool and _queued_chats(service) == before_jobs


def test_too_many_images_names_the_limit(api, pictures):
    parts = [image_part(data_url(png_bytes(pictures[0].image)))] * 6
    response = api.post("/v1/chat/completions", json={"model": DEMO_VLM, "messages": [
        {"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "too_many_images" and "5" in error["message"]


def test_a_png_bomb_is_refused_without_the_web_process_growing(api, service):
    bomb = data_url(png_bomb(60_000))
    worker_pid = _web_worker_pid(service)
    _reset_peak_rss(worker_pid)
    before = _peak_rss_kib(worker_pid)
    response = api.post("/v1/chat/completions", json={"model": DEMO_VLM, "messages": [
        {"role": "user", "content": [image_part(bomb), {"type": "text", "text": QUESTION}]}]})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "image_too_large"
    growth_mib = (_peak_rss_kib(worker_pid) - before) / 1024
    assert growth_mib < 8, f"the web worker's peak memory grew by {growth_mib:.1f} MiB"


def _spooled_chats(service) -> set[str]:
    """The synchronous chats' directories in the service's spool."""
    spool = service.spool_dir
    return {p.name for p in spool.iterdir() if p.name.startswith("chatcmpl-")} if spool.exists() else set()


def _queued_chats(service) -> set[bytes]:
    """The chat jobs RQ knows of on the service's Redis."""
    return set(redis.Redis.from_url(service.redis_url).scan_iter("rq:job:chatcmpl-*"))


def _web_worker_pid(service) -> int:
    """The pid of gunicorn's (single) worker process: the one that handles requests."""
    master = service.web.process.pid
    children = open(f"/proc/{master}/task/{master}/children").read().split()
    assert len(children) == 1, children
    return int(children[0])


def _reset_peak_rss(pid: int) -> None:
    """Reset the kernel's record of a process's peak resident memory (VmHWM)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _peak_rss_kib(pid: int) -> int:
    """A process's peak resident memory (VmHWM) in KiB."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM line")
