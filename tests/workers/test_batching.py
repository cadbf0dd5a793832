"""Continuous batching in the worker's scheduler, with the real demo models, Redis and RQ (in this process).

Each test compares what a request gives inside a batch with what it gives alone, so a batch that
mixed up its members, dropped one or changed one's sampling would fail.
"""

from __future__ import annotations

import dataclasses
import json
import math
import uuid

import pytest
from rq.job import JobStatus

from bench.make_long_audio import build
from bench.make_random_model import build as build_random_model
from jobs import contract, keys, records
from jobs.events import read_log
from jobs.queues import (
    BATCH,
    CHAT_COMPLETION,
    INTERACTIVE,
    TEXT_COMPLETION,
    TRANSCRIPTION,
    enqueue,
    fetch_job,
)
from jobs.settings import load_settings
from jobs.store import resolve
from workers.backends import textbatch
from workers.main import build_scheduler
from workers.scheduler import Scheduler

MODEL = "smollm2-135m"
SYSTEM = {"role": "system", "content": "You are a patient teacher who answers in plain words, briefly."}
LONG_PROMPT = "Summarise this: " + "the quick brown fox jumps over the lazy dog. " * 45
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "What do bees make?", "Count from one to five.", "What is rain?"]


def ref(settings, name: str = MODEL) -> contract.ModelRef:
    """A model as a request carries it."""
    info = resolve(name, settings)
    return contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


def chat(settings, question: str, model=None, max_tokens: int = 24, n: int = 1, **sampling) -> contract.TextRequest:
    """A greedy chat request (unless `sampling` says otherwise)."""
    sampling = {"temperature": 0.0, **sampling}
    return contract.TextRequest(f"chatcmpl-{uuid.uuid4().hex}", model or ref(settings),
                                contract.Sampling(max_tokens=max_tokens, **sampling),
                                messages=[SYSTEM, {"role": "user", "content": question}], n=n)


def submit(conn, settings, request, queue: str = INTERACTIVE, func: str = CHAT_COMPLETION) -> str:
    enqueue(conn, settings, queue, func, contract.to_payload(request), request.id)
    return request.id


@pytest.fixture(scope="module")
def worker_parts(models_dir):
    """One model manager and set of backends for the module (models stay loaded)."""
    scheduler = build_scheduler(load_settings({"models_dir": models_dir}), "test-batching")
    return scheduler.models, scheduler.backends


def scheduler(conn, settings, worker_parts, max_batch: int = 8) -> Scheduler:
    """A burst-mode scheduler (with its own, empty prompt cache)."""
    models, backends = worker_parts
    return Scheduler(conn, settings, models, backends, f"test-{uuid.uuid4().hex[:6]}", burst=True,
                     max_batch=max_batch)


def done(conn, job_id: str) -> dict:
    """The job's `done` data (fails on anything else)."""
    terminal = read_log(conn, job_id)[-1]
    assert terminal["type"] == "done", terminal
    return terminal["data"]


def alone(conn, settings, worker_parts, request) -> dict:
    """What a request gives when it runs by itself (a fresh scheduler: no prompt cache)."""
    solo = dataclasses.replace(request, id=f"solo-{uuid.uuid4().hex}")
    submit(conn, settings, solo)
    scheduler(conn, settings, worker_parts).run()
    return done(conn, solo.id)


def texts(data: dict) -> list[str]:
    return [c["text"] for c in data["choices"]]


def step_until(run: Scheduler, condition, limit: int = 5000) -> None:
    for _ in range(limit):
        if condition():
            return
        run.step()
    raise AssertionError("the condition never held")


def test_requests_decode_together_and_each_gives_what_it_gives_alone(redis_conn, settings, worker_parts):
    requests = [chat(settings, q) for q in QUESTIONS]
    for request in requests:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: sum(len(b) for b in run.text.values()) == len(requests))
    assert len(run.text) == 1  # one model, one batch, every request in it
    run.run()
    for request in requests:
        assert texts(done(redis_conn, request.id)) == texts(alone(redis_conn, settings, worker_parts, request))
    jobs = [fetch_job(redis_conn, r.id) for r in requests]
    assert max(j.started_at for j in jobs) < min(j.ended_at for j in jobs)  # they really overlapped


def test_one_canceled_mid_batch_stops_and_the_others_finish_intact(redis_conn, settings, worker_parts):
    requests = [chat(settings, q, max_tokens=32) for q in QUESTIONS[:4]]
    for request in requests:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)
    victim = requests[1]
    step_until(run, lambda: any(e["type"] == "delta" for e in read_log(redis_conn, victim.id)))
    redis_conn.set(keys.cancel_flag(victim.id), 1, ex=60)
    run.run()
    error = read_log(redis_conn, victim.id)[-1]
    assert error["type"] == "error" and error["data"]["code"] == "canceled"
    assert fetch_job(redis_conn, victim.id).get_status() == JobStatus.FAILED
    for request in requests[:1] + requests[2:]:
        assert texts(done(redis_conn, request.id)) == texts(alone(redis_conn, settings, worker_parts, request))


def test_stop_strings_and_max_tokens_are_each_requests_own(redis_conn, settings, worker_parts):
    long_answer = texts(alone(redis_conn, settings, worker_parts, chat(settings, QUESTIONS[2], max_tokens=40)))[0]
    stop = long_answer.split()[4]  # a word in the middle of the answer
    requests = [chat(settings, QUESTIONS[2], max_tokens=40, stop=(stop,)), chat(settings, QUESTIONS[2], max_tokens=5),
                chat(settings, QUESTIONS[2], max_tokens=40)]
    for request in requests:
        submit(redis_conn, settings, request)
    scheduler(redis_conn, settings, worker_parts).run()
    stopped, short, full = (done(redis_conn, r.id) for r in requests)
    assert texts(stopped)[0] == long_answer[: long_answer.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stop not in texts(stopped)[0]
    assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "length"
    assert texts(full)[0] == long_answer


@pytest.fixture(scope="module")
def second_model(tmp_path_factory, models_dir):
    """A tiny random model with the demo model's config and tokenizer: another text model for the store."""
    store = tmp_path_factory.mktemp("store")
    build_random_model(models_dir / MODEL, store / "tiny", {"num_hidden_layers": 2, "hidden_size": 64,
                                                            "num_attention_heads": 2, "num_key_value_heads": 1,
                                                            "intermediate_size": 128}, "float32")
    (store / "tiny" / "mlxq.json").write_text(json.dumps({"kind": "text", "source": "dir:test"}))
    return contract.ModelRef("tiny", str(store / "tiny"), "text", 8192, 49152)


def test_a_second_models_requests_decode_in_a_batch_of_their_own(redis_conn, settings, worker_parts, second_model):
    ours = [chat(settings, q) for q in QUESTIONS[:3]]
    theirs = [chat(settings, q, model=second_model, max_tokens=8) for q in QUESTIONS[3:]]
    for request in ours + theirs:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: sum(len(b) for b in run.text.values()) == 6)
    by_model = {batch.key: {t.request.model.id for t in batch.tasks} for batch in run.text.values()}
    assert sorted(by_model.values(), key=sorted) == [{MODEL}, {"tiny"}]
    run.run()
    for request in ours + theirs:
        assert texts(done(redis_conn, request.id)) == texts(alone(redis_conn, settings, worker_parts, request))


def test_a_shared_prefix_is_served_from_the_prompt_cache_with_the_same_text(redis_conn, settings, worker_parts):
    run = scheduler(redis_conn, settings, worker_parts)
    first, second = chat(settings, QUESTIONS[0]), chat(settings, QUESTIONS[1])
    submit(redis_conn, settings, first)
    run.run()
    submit(redis_conn, settings, second)
    run.run()  # same scheduler: the first request's cache is there
    cached = done(redis_conn, second.id)
    assert done(redis_conn, first.id)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 10  # at least the system prompt
    assert texts(cached) == texts(alone(redis_conn, settings, worker_parts, second))


def test_n_gives_n_choices(redis_conn, settings, worker_parts):
    request = chat(settings, QUESTIONS[2], max_tokens=12, n=3, temperature=0.9, seed=5)
    submit(redis_conn, settings, request)
    scheduler(redis_conn, settings, worker_parts).run()
    data = done(redis_conn, request.id)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert len(set(texts(data))) > 1  # three draws, not one answer thrice
    assert 3 <= data["usage"]["completion_tokens"] <= 36 and data["usage"]["prompt_tokens"] < 60  # the prompt once
    assert texts(data) == texts(alone(redis_conn, settings, worker_parts, request))  # seeded: reproducible


def test_completions_with_several_prompts_and_n(redis_conn, settings, worker_parts):
    request = contract.TextRequest(f"cmpl-{uuid.uuid4().hex}", ref(settings), contract.Sampling(max_tokens=4),
                                   prompts=["The sky is", "One, two,"], n=2)
    submit(redis_conn, settings, request, func=TEXT_COMPLETION)
    scheduler(redis_conn, settings, worker_parts).run()
    data = done(redis_conn, request.id)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["usage"]["completion_tokens"] == 16


def test_a_request_that_could_never_fit_is_refused_up_front(redis_conn, models_dir, worker_parts, settings):
    models, backends = worker_parts
    models.load(ref(settings))
    model_mb = next(m["bytes"] for m in models.list() if m["id"] == MODEL) / 2**20
    tight = settings.with_overrides(memory_budget_mb=math.ceil(model_mb) + 1, cache_limit_mb=0)  # no room for a cache
    small = build_scheduler(tight, "test-tight", burst=True)
    request = chat(settings, QUESTIONS[0], max_tokens=4000)
    submit(redis_conn, settings, request)
    small.run()
    error = read_log(redis_conn, request.id)[-1]
    assert error["type"] == "error" and (error["data"]["status"], error["data"]["code"]) == (507, "insufficient_storage")
    assert "KV cache" in error["data"]["message"]


def test_a_transcription_keeps_going_while_text_decodes(redis_conn, settings, worker_parts):
    speech = ref(settings, "whisper-tiny.en")
    folder = settings.spool_dir / "job-speech"
    folder.mkdir(parents=True)
    audio = folder / "half.wav"
    audio.write_bytes(build(0.5).read_bytes())
    transcription = contract.TranscriptionRequest("job-speech", speech, str(audio), "half.wav", is_async=True)
    records.create(redis_conn, settings, "job-speech", "transcription", {"model": speech.id})
    texts_ = [chat(settings, f"Write a very long story about {topic}.", max_tokens=200) for topic in ("a dragon", "the sea")]
    for request in texts_:
        submit(redis_conn, settings, request)
    submit(redis_conn, settings, transcription, queue=BATCH, func=TRANSCRIPTION)
    scheduler(redis_conn, settings, worker_parts).run()
    speech_job, text_jobs = fetch_job(redis_conn, "job-speech"), [fetch_job(redis_conn, r.id) for r in texts_]
    assert read_log(redis_conn, "job-speech")[-1]["type"] == "done"
    # The transcription started after the chats and finished before them: it ran between their steps.
    timeline = [(j.id, j.started_at, j.ended_at) for j in [speech_job, *text_jobs]]
    assert all(j.started_at <= speech_job.started_at for j in text_jobs), timeline
    assert speech_job.ended_at <= max(j.ended_at for j in text_jobs), timeline
    assert max(done(redis_conn, r.id)["usage"]["completion_tokens"] for r in texts_) == 200


@pytest.fixture()
def small_chunks(monkeypatch):
    """Prefill in chunks of 64 tokens, so a prompt of a few hundred tokens takes several (and the
    CPU is not kept busy for a minute with thousands)."""
    monkeypatch.setattr(textbatch, "PREFILL_CHUNK", 64)


def test_a_long_prompt_is_processed_in_chunks_between_the_others_tokens(redis_conn, settings, worker_parts,
                                                                          small_chunks):
    short = chat(settings, QUESTIONS[2], max_tokens=40)
    submit(redis_conn, settings, short)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: run.text and any(s.tokens for b in run.text.values()
                                             for m in b.members.values() for s in m.sequences))
    long_prompt = chat(settings, LONG_PROMPT, max_tokens=4)
    submit(redis_conn, settings, long_prompt)
    run._next_look = 0.0  # look at the queue at the next step
    step_until(run, lambda: sum(len(b) for b in run.text.values()) == 2)
    [batch] = run.text.values()
    ours = next(m for t, m in batch.members.items() if t.request.id == short.id).sequences[0]
    theirs = next(m for t, m in batch.members.items() if t.request.id == long_prompt.id).sequences[0]
    assert theirs.prompt_tokens > 6 * textbatch.PREFILL_CHUNK  # several chunks of prefill
    while not theirs.tokens and not ours.finish_reason:
        before = ours.tokens
        run.step()
        assert ours.tokens == before + 1  # every step still gave the short request its next token
    run.run()
    assert texts(done(redis_conn, short.id)) == texts(alone(redis_conn, settings, worker_parts, short))


@pytest.mark.parametrize(("question", "sampling", "joined_while"), [
    (QUESTIONS[2], {}, "decoding"),
    (QUESTIONS[2], {"temperature": 0.9, "seed": 7, "repetition_penalty": 1.3}, "decoding"),
    (LONG_PROMPT, {}, "prefilling"),
])
def test_a_request_decoding_alone_is_taken_over_by_the_batch_with_the_same_text(
        redis_conn, settings, worker_parts, small_chunks, question, sampling, joined_while):
    first = chat(settings, question, max_tokens=20, **sampling)
    submit(redis_conn, settings, first)
    run = scheduler(redis_conn, settings, worker_parts)

    def alone_and(state) -> bool:
        solo = next((b.solo for b in run.text.values() if b.solo), None)
        if solo is None:
            return False
        seq, decoder = solo
        return seq.tokens >= 5 if state == "decoding" else bool(decoder.fed) and not decoder.decoding

    step_until(run, lambda: alone_and(joined_while))
    second = chat(settings, QUESTIONS[4], max_tokens=20)
    submit(redis_conn, settings, second)
    run._next_look = 0.0  # look at the queue at the next step
    step_until(run, lambda: sum(len(b) for b in run.text.values()) == 2)
    [batch] = run.text.values()
    assert batch.solo is None and batch.sequences == 2  # the batched generator has both
    run.run()
    for request in (first, second):
        assert texts(done(redis_conn, request.id)) == texts(alone(redis_conn, settings, worker_parts, request))
