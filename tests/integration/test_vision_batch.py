"""Chats on a vision model decode in its text batch: end to end with the official openai client, the real web
tier and worker, the toy VLM (shapes-vlm-toy, which names one coloured shape)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from tests.conftest import wait_until
from tests.integration.test_batching import _ended
from tests.integration.test_vision import QUESTION, data_url, image_part, pictures, png_bytes  # noqa: F401
from workers.demo import shapes
from workers.demo.pull import DEMO_VLM


def _content(sample, question: str = QUESTION) -> list[dict]:
    return [image_part(data_url(png_bytes(sample.image))), {"type": "text", "text": question}]


def _stream(openai_client, content, max_tokens: int = 16, **extra) -> tuple[str, str, float, float]:
    """A greedy streamed chat on the toy VLM: (its job id, its text as the chunks brought it, when its first text
    came, when its stream ended)."""
    stream = openai_client.chat.completions.create(
        model=DEMO_VLM, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, temperature=0,
        stream=True, **extra)
    job_id, parts, first = None, [], None
    for chunk in stream:
        job_id = chunk.id
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
        if first is None and any(parts):
            first = time.monotonic()
    return job_id, "".join(parts), first, time.monotonic()


def _together(service, openai_client, contents: list) -> list[str]:
    """The chats sent at once; asserts they decoded together: each one's first text came before any stream ended
    (one after another, a chat's first token waits for the one before it to end)."""
    with ThreadPoolExecutor(len(contents)) as pool:
        answers = list(pool.map(lambda content: _stream(openai_client, content), contents))
    assert max(first for _, _, first, _ in answers) < min(end for _, _, _, end in answers), \
        "they did not decode together"
    conn = redis.Redis.from_url(service.redis_url)
    jobs = wait_until(lambda: _ended([answer[0] for answer in answers], conn), 60, what="RQ to record every job ended")
    assert all(job.get_status() == "finished" for job in jobs)
    return [text for _, text, _, _ in answers]


def test_six_image_chats_at_once_give_what_each_gives_alone(service, openai_client, pictures):  # noqa: F811
    contents = [_content(sample) for sample in pictures[:6]]
    alone = [_stream(openai_client, content)[1] for content in contents]
    assert all(shapes.names_correctly(text, s.colour, s.shape) for text, s in zip(alone, pictures, strict=False))
    assert _together(service, openai_client, contents) == alone


def test_an_image_chat_and_a_text_chat_share_the_batch(service, openai_client, pictures):  # noqa: F811
    contents = [_content(pictures[0]), "Say hello.", _content(pictures[1])]
    alone = [_stream(openai_client, content)[1] for content in contents]
    assert alone[1]  # the text chat says something
    assert _together(service, openai_client, contents) == alone
    assert shapes.names_correctly(alone[2], pictures[1].colour, pictures[1].shape)


def _ask(openai_client, content):
    return openai_client.chat.completions.create(model=DEMO_VLM, messages=[{"role": "user", "content": content}],
                                                 temperature=0, max_tokens=12)


def test_the_same_image_and_question_again_resumes_from_the_cache(openai_client, pictures):  # noqa: F811
    sample = pictures[4]
    question = "What is in this image? Answer briefly."  # a prompt no other test sends
    first = _ask(openai_client, _content(sample, question))
    again = _ask(openai_client, _content(sample, question))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert shapes.names_correctly(again.choices[0].message.content, sample.colour, sample.shape)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= again.usage.prompt_tokens - 1  # all but its last token: the image is not read again
    # Another picture with the same words is not served from the first one's entry beyond the text before it.
    other = _ask(openai_client, _content(pictures[5], question))
    assert other.usage.prompt_tokens_details.cached_tokens < cached - 4
    assert shapes.names_correctly(other.choices[0].message.content, pictures[5].colour, pictures[5].shape)


def test_canceling_one_image_chat_leaves_the_others_intact(service, openai_client, pictures):  # noqa: F811
    # The toy answers in five tokens: its ends of sequence (<|im_end|>, <end_of_utterance>) are kept out.
    long = {"max_tokens": 40, "logit_bias": {"2": -100, "49154": -100}}
    contents = [_content(pictures[i]) for i in (0, 1, 2)]
    alone = [_stream(openai_client, content, **long)[1] for content in contents]
    conn = redis.Redis.from_url(service.redis_url)
    with ThreadPoolExecutor(3) as pool:
        others = [pool.submit(_stream, openai_client, contents[i], **long) for i in (0, 2)]
        stream = openai_client.chat.completions.create(
            model=DEMO_VLM, messages=[{"role": "user", "content": contents[1]}], temperature=0, stream=True,
            **{**long, "max_tokens": 1000})
        chunk = next(iter(stream))  # it runs: its first token is out
        stream.response.close()  # the client goes away mid-answer
        answers = [future.result(timeout=120)[1] for future in others]
    assert answers == [alone[0], alone[2]]
    from tests.integration.test_faults import read_log

    events = wait_until(lambda: [e for e in read_log(conn, chunk.id) if e["type"] in ("done", "error")], 30,
                        what="the canceled chat's end")
    assert events[0]["type"] == "error" and events[0]["data"]["code"] == "canceled"


SHAPE_TOOL = {"type": "function", "function": {
    "name": "name_shape", "description": "Record the shape in the picture.",
    "parameters": {"type": "object", "properties": {"colour": {"type": "string"}, "shape": {"type": "string"}},
                   "required": ["colour", "shape"], "additionalProperties": False}}}


def test_a_forced_tool_call_with_an_image_parses_plain_and_streamed(openai_client, pictures):  # noqa: F811
    content = _content(pictures[2], "Record the shape in this picture.")
    forced = {"tools": [SHAPE_TOOL], "tool_choice": {"type": "function", "function": {"name": "name_shape"}}}
    answer = openai_client.chat.completions.create(
        model=DEMO_VLM, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=48, **forced)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "name_shape"
    assert set(json.loads(call.function.arguments)) == {"colour", "shape"}
    streamed = openai_client.chat.completions.create(
        model=DEMO_VLM, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=48, stream=True,
        **forced)
    deltas = [d for chunk in streamed for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == "name_shape"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
