"""Many users at once through the real service: streamed chats decode together and each gets its own answer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import redis

from jobs.queues import fetch_job
from tests.conftest import wait_until

MODEL = "smollm2-135m"
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "What do bees make?"]


def _stream(openai_client, question: str) -> tuple[str, str]:
    """A greedy streamed chat: (its job id, its text as the chunks brought it)."""
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0, stream=True)
    job_id, parts = None, []
    for chunk in stream:
        job_id = chunk.id
        parts.extend(choice.delta.content or "" for choice in chunk.choices)
    return job_id, "".join(parts)


def test_concurrent_streamed_chats_give_what_each_gives_alone(service, openai_client):
    one_by_one = [_stream(openai_client, q)[1] for q in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: _stream(openai_client, q), QUESTIONS))
    assert [text for _, text in together] == one_by_one
    conn = redis.Redis.from_url(service.redis_url)
    # A job's answer goes out before RQ records it ended (one more round trip): wait for that record.
    jobs = wait_until(lambda: _ended([job_id for job_id, _ in together], conn), 60,
                      what="RQ to record every job ended")
    assert max(j.started_at for j in jobs) < min(j.ended_at for j in jobs), "they did not decode together"


def _ended(job_ids: list[str], conn) -> list | None:
    """The RQ jobs, once every one of them has its end recorded."""
    jobs = [fetch_job(conn, job_id) for job_id in job_ids]
    return jobs if all(job.ended_at for job in jobs) else None


def test_n_three_through_the_openai_client(openai_client):
    answer = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say a word."}], max_tokens=6, n=3, temperature=1.0,
        seed=11)
    assert [choice.index for choice in answer.choices] == [0, 1, 2]
    assert answer.usage.completion_tokens >= 3
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0
