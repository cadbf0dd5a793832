"""Continuous batching in the worker's scheduler, with the real demo models, Redis and RQ (in this process).

Each test compares what a request gives inside a batch with what it gives alone, so a batch that
mixed up its members, dropped one or changed one's sampling would fail. What a request gives alone is
computed once per module for each distinct request (the `alone` fixture), and the tests share a few
greedy requests (`chat`'s default of 12 tokens) so that most references are computed once for all.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import uuid
from collections import Counter

import mlx_lm.models.llama as llama
import pytest
from rq.job import JobStatus

from jobs import contract, keys, records
from jobs.errors import ContextLengthExceeded
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
from tests.long_audio import FIXTURES
from tests.random_model import build as build_random_model
from workers.backends import prepare, textbatch, textgen
from workers.backends.prefill import Prompt, plan
from workers.main import build_scheduler
from workers.scheduler import Scheduler

MODEL = "smollm2-135m"
SYSTEM = {"role": "system", "content": "You are a patient teacher who answers in plain words, briefly."}
FOX = "the quick brown fox jumps over the lazy dog. "
LONG_PROMPT = "Summarise this: " + FOX * 16  # ~190 tokens: three chunks of small_chunks' 64
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "What do bees make?", "Count from one to five.", "What is rain?"]


def ref(settings, name: str = MODEL) -> contract.ModelRef:
    """A model as a request carries it."""
    info = resolve(name, settings)
    return contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


def chat(settings, question: str, model=None, max_tokens: int = 12, n: int = 1, **sampling) -> contract.TextRequest:
    """A greedy chat request (unless `sampling` says otherwise)."""
    sampling = {"temperature": 0.0, **sampling}
    return contract.TextRequest(f"chatcmpl-{uuid.uuid4().hex}", model or ref(settings),
                                contract.Sampling(max_tokens=max_tokens, **sampling),
                                messages=[SYSTEM, {"role": "user", "content": question}], n=n)


def submit(conn, settings, request, queue: str = INTERACTIVE, func: str = CHAT_COMPLETION) -> str:
    enqueue(conn, settings, queue, func, contract.to_payload(request), request.id)
    return request.id


@pytest.fixture(scope="module")
def worker_parts(text_worker_parts):
    """The model manager and backends (shared with test_text_backend: tests/workers/conftest.py)."""
    return text_worker_parts


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


@pytest.fixture(scope="module")
def references() -> dict:
    """What each distinct request gave alone in this module: {its contents: (prefill chunk, done data)}."""
    return {}


@pytest.fixture()
def alone(redis_conn, settings, worker_parts, references):
    """What a request gives when it runs by itself (a fresh scheduler: no prompt cache); each distinct
    request runs alone once per module, and later tests reuse its answer."""
    def run_alone(request) -> dict:
        key = json.dumps({**contract.to_payload(request), "id": None}, sort_keys=True)
        if key not in references:
            solo = dataclasses.replace(request, id=f"solo-{uuid.uuid4().hex}")
            submit(redis_conn, settings, solo)
            scheduler(redis_conn, settings, worker_parts).run()
            references[key] = (textbatch.PREFILL_CHUNK, done(redis_conn, solo.id))
        chunk, data = references[key]
        if chunk != textbatch.PREFILL_CHUNK:  # computed under the other prefill chunk (small_chunks)
            # Reused only for a prompt that either chunk processes whole, the same way.
            assert data["usage"]["prompt_tokens"] <= min(chunk, textbatch.PREFILL_CHUNK), request
        return data
    return run_alone


def texts(data: dict) -> list[str]:
    return [c["text"] for c in data["choices"]]


def step_until(run: Scheduler, condition, limit: int = 5000) -> None:
    for _ in range(limit):
        if condition():
            return
        run.step()
    raise AssertionError("the condition never held")


MIXED = [  # what clients send: greedy, the APIs' default temperature, filters, penalties, a bias
    {"max_tokens": 4}, {"temperature": 1.0, "seed": 1, "max_tokens": 6},
    {"temperature": 0.7, "top_p": 0.9, "seed": 2, "max_tokens": 6},
    {"temperature": 0.8, "top_k": 40, "seed": 3, "max_tokens": 6}, {"temperature": 0.9, "repetition_penalty": 1.3, "seed": 4},
    {"temperature": 1.0, "presence_penalty": 1.5, "frequency_penalty": 0.5, "seed": 5, "max_tokens": 6},
    {"temperature": 0.6, "min_p": 0.1, "logit_bias": ((13, -100.0), (30, 5.0)), "seed": 6, "max_tokens": 6},
    {"max_tokens": 4},
]  # (few tokens each: a row that drew from another's stream, or another's argmax, shows in its first few, and
#     rows still decode after others have left; the one with a penalty asks 12, as the takeover test's
#     request does, so that one answer alone serves both, and the batch decodes 12 steps for the rows below)


def test_requests_decode_together_and_each_gives_what_it_gives_alone(redis_conn, settings, worker_parts,
                                                                      alone):
    # One batch, started once, for what several tests used to check with a batch each:
    # - eight requests with different sampling decode together; each gives what it gives alone: the
    #   greedy ones their argmax, the seeded ones the same draws (a row's random stream is its own);
    # - one canceled mid-batch stops, and the others finish intact;
    # - stop strings and max_tokens are each request's own (three rows with one prompt);
    # - n gives n choices, distinct draws, the prompt counted once, and seeded: what it gives alone.
    requests = [chat(settings, QUESTIONS[i % len(QUESTIONS)], **mixed) for i, mixed in enumerate(MIXED)]
    victim = chat(settings, QUESTIONS[3])
    long_answer = texts(alone(chat(settings, QUESTIONS[2])))[0]
    stop = long_answer.split()[4]  # a word in the middle of the answer
    stopped, short, full = (chat(settings, QUESTIONS[2], stop=(stop,)), chat(settings, QUESTIONS[2], max_tokens=5),
                            chat(settings, QUESTIONS[2]))
    choices = chat(settings, QUESTIONS[2], max_tokens=4, n=3, temperature=0.9, seed=5)
    everyone = [*requests, victim, stopped, short, full, choices]
    for request in everyone:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts, max_batch=16)
    step_until(run, lambda: sum(len(b) for b in run.text.values()) == len(everyone))
    assert len(run.text) == 1  # one model, one batch, every request in it
    step_until(run, lambda: any(e["type"] == "delta" for e in read_log(redis_conn, victim.id)))
    redis_conn.set(keys.cancel_flag(victim.id), 1, ex=60)
    run.run()
    jobs = [fetch_job(redis_conn, r.id) for r in requests]
    assert max(j.started_at for j in jobs) < min(j.ended_at for j in jobs)  # they really overlapped
    # The canceled one ended with its error, its job failed.
    error = read_log(redis_conn, victim.id)[-1]
    assert error["type"] == "error" and error["data"]["code"] == "canceled"
    assert fetch_job(redis_conn, victim.id).get_status() == JobStatus.FAILED
    # Stop strings and max_tokens.
    stopped, short, full = (done(redis_conn, r.id) for r in (stopped, short, full))
    assert texts(stopped)[0] == long_answer[: long_answer.index(stop)]
    assert stopped["choices"][0]["finish_reason"] == "stop" and stop not in texts(stopped)[0]
    assert short["usage"]["completion_tokens"] == 5 and short["choices"][0]["finish_reason"] == "length"
    assert texts(full)[0] == long_answer
    # n choices.
    data = done(redis_conn, choices.id)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert len(set(texts(data))) > 1  # three draws, not one answer thrice
    assert 3 <= data["usage"]["completion_tokens"] <= 12 and data["usage"]["prompt_tokens"] < 60  # the prompt once
    # Each gives what it gives alone (the n request too: seeded, reproducible).
    for request in [*requests, choices]:
        assert texts(done(redis_conn, request.id)) == texts(alone(request))


def test_a_burst_of_chats_joins_the_decoder_as_its_prompt_pass_left_it(redis_conn, settings, worker_parts, alone,
                                                                      monkeypatch):
    # Chats that arrive together are processed in one pass; with one choice each, the decoder takes that
    # pass's batch cache as it is (no row cut out and merged again) and each still gives what it gives alone.
    from workers.backends.decoding import DecodeBatch
    from workers.backends.prefill import Together

    requests = [chat(settings, QUESTIONS[i % len(QUESTIONS)], **mixed) for i, mixed in enumerate(MIXED)]
    joins, cut = [], []
    insert, row = DecodeBatch.insert_many, Together.row
    monkeypatch.setattr(DecodeBatch, "insert_many", lambda self, joining, batch_cache=None: (
        joins.append((len(joining), batch_cache is not None)), insert(self, joining, batch_cache))[1])
    monkeypatch.setattr(Together, "row", lambda self, i: cut.append(i) or row(self, i))
    for request in requests:
        submit(redis_conn, settings, request)
    scheduler(redis_conn, settings, worker_parts, max_batch=16).run()
    monkeypatch.undo()
    assert sum(n for n, whole in joins if whole) >= 2 and not cut, (joins, cut)
    assert all(whole or n <= 1 for n, whole in joins), joins  # a lone prompt is processed on its own
    for request in requests:
        assert texts(done(redis_conn, request.id)) == texts(alone(request))


@pytest.fixture(scope="module")
def second_model(tmp_path_factory, models_dir):
    """A tiny random model with the demo model's config and tokenizer: another text model for the store."""
    store = tmp_path_factory.mktemp("store")
    build_random_model(models_dir / MODEL, store / "tiny", {"num_hidden_layers": 2, "hidden_size": 64,
                                                            "num_attention_heads": 2, "num_key_value_heads": 1,
                                                            "intermediate_size": 128}, "float32")
    (store / "tiny" / "mlxq.json").write_text(json.dumps({"kind": "text", "source": "dir:test"}))
    return contract.ModelRef("tiny", str(store / "tiny"), "text", 8192, 49152)


def test_a_second_models_requests_decode_in_a_batch_of_their_own(redis_conn, settings, worker_parts,
                                                                 second_model, alone):
    ours = [chat(settings, QUESTIONS[0], max_tokens=4), chat(settings, QUESTIONS[1], max_tokens=4),
            chat(settings, QUESTIONS[2])]
    theirs = [chat(settings, q, model=second_model, max_tokens=8) for q in QUESTIONS[3:]]
    for request in ours + theirs:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: sum(len(b) for b in run.text.values()) == 6)
    by_model = {batch.key: {t.request.model.id for t in batch.tasks} for batch in run.text.values()}
    assert sorted(by_model.values(), key=sorted) == [{MODEL}, {"tiny"}]
    run.run()
    for request in ours + theirs:
        assert texts(done(redis_conn, request.id)) == texts(alone(request))


def test_a_shared_prefix_is_served_from_the_prompt_cache_with_the_same_text(redis_conn, settings,
                                                                            worker_parts, alone):
    run = scheduler(redis_conn, settings, worker_parts)
    first, second = chat(settings, QUESTIONS[0], max_tokens=4), chat(settings, QUESTIONS[1], max_tokens=4)
    submit(redis_conn, settings, first)
    run.run()
    submit(redis_conn, settings, second)
    run.run()  # same scheduler: the first request's cache is there
    cached = done(redis_conn, second.id)
    assert done(redis_conn, first.id)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 10  # at least the system prompt
    assert texts(cached) == texts(alone(second))


def test_a_burst_that_shares_a_cached_system_prompt_copies_it_once_per_layer(redis_conn, settings, worker_parts,
                                                                             alone, monkeypatch):
    from workers.backends import prefill

    run = scheduler(redis_conn, settings, worker_parts)
    first = chat(settings, QUESTIONS[0], max_tokens=4)
    submit(redis_conn, settings, first)
    run.run()  # its cache is kept: the burst's prompts resume from its system prompt
    passes = []
    merge = prefill.merge_rows
    monkeypatch.setattr(prefill, "merge_rows", lambda layers, sources: passes.append(sources) or merge(layers, sources))
    burst = [chat(settings, question, max_tokens=4) for question in QUESTIONS[1:4]]
    for request in burst:
        submit(redis_conn, settings, request)
    run.run()
    monkeypatch.undo()
    sources = passes[0]  # the first layer's: every prompt of the pass resumes from the one kept entry
    assert len(sources) == 3 and sources[0] is not None and len(set(sources)) == 1
    for request in burst:
        data = done(redis_conn, request.id)
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 10
        assert texts(data) == texts(alone(request))


def test_a_burst_resuming_from_several_entries_shares_what_they_have_in_common(redis_conn, settings, worker_parts,
                                                                              alone, monkeypatch):
    from workers.backends import prefill

    monkeypatch.setitem(prefill.SHARE_TAIL, "cpu", 32)  # a GPU's: a few cached tokens are processed again
    run = scheduler(redis_conn, settings, worker_parts)
    for question in ("What is the capital of France?", "Name three colours."):
        submit(redis_conn, settings, chat(settings, question, max_tokens=4))
        run.run()  # two kept entries: each prompt below has the most in common with one of them
    passes = []
    merge = prefill.merge_rows
    monkeypatch.setattr(prefill, "merge_rows", lambda layers, sources: passes.append((sources, [c.size() for c in layers]))
                        or merge(layers, sources))
    burst = [chat(settings, question, max_tokens=4) for question in
             ("What is the capital of Spain?", "Name three animals.", "What is the capital of Peru?")]
    for request in burst:
        submit(redis_conn, settings, request)
    run.run()
    sources, lengths = passes[0]
    # One entry, to what the three prompts share (the chat template's start), for every row.
    assert sources[0] is not None and len(set(sources)) == 1 and len(set(lengths)) == 1
    for request in burst:
        data = done(redis_conn, request.id)
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == lengths[0]
        assert texts(data) == texts(alone(request))


def test_completions_with_several_prompts_and_n(redis_conn, settings, worker_parts):
    request = contract.TextRequest(f"cmpl-{uuid.uuid4().hex}", ref(settings), contract.Sampling(max_tokens=4),
                                   prompts=["The sky is", "One, two,"], n=2)
    submit(redis_conn, settings, request, func=TEXT_COMPLETION)
    scheduler(redis_conn, settings, worker_parts).run()
    data = done(redis_conn, request.id)
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    assert data["usage"]["completion_tokens"] == 16


@pytest.fixture(scope="module")
def tight_worker(worker_parts, redis_url, models_dir):
    """Overrides for a worker with room for the demo model and nothing else (no KV cache fits), and its
    model manager and backends (built once: the tests share its loaded model)."""
    import mlx.core as mx

    models, _ = worker_parts
    settings = load_settings({"redis_url": redis_url, "models_dir": models_dir})
    models.load(ref(settings))
    model_mb = next(m["bytes"] for m in models.list() if m["id"] == MODEL) / 2**20
    tight = {"memory_budget_mb": math.ceil(model_mb) + 1, "cache_limit_mb": 0}
    limit = mx.set_cache_limit(0)
    small = build_scheduler(settings.with_overrides(**tight), "test-tight", burst=True)
    mx.set_cache_limit(limit)  # the process's: a limit of 0 left behind would slow the tests after this one
    return tight, small.models, small.backends


@pytest.mark.parametrize("prepare_wait_s", [5.0, 0.0])  # refused while joining, or at a later step
def test_a_request_that_could_never_fit_is_refused_up_front(redis_conn, settings, tight_worker, monkeypatch,
                                                             prepare_wait_s):
    monkeypatch.setattr(prepare, "PREPARE_WAIT_S", prepare_wait_s)
    tight, models, backends = tight_worker
    small = Scheduler(redis_conn, settings.with_overrides(**tight), models, backends, "test-tight",
                      burst=True)
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
    audio = folder / "garden.wav"
    # One fixture: 15 s, one window, one piece. That a transcription gets a piece after every
    # SPEECH_TURN_S of text, again and again, is tested in-process in test_admission.py
    # (test_a_transcription_gets_a_piece_after_speech_turn_s_of_text).
    audio.write_bytes((FIXTURES / "garden.wav").read_bytes())
    transcription = contract.TranscriptionRequest("job-speech", speech, str(audio), "garden.wav", is_async=True)
    records.create(redis_conn, settings, "job-speech", "transcription", {"model": speech.id})
    # Chats that cannot end on their own (their end tokens biased away) outlast the transcription however
    # fast or busy the machine; they are canceled once it is done.
    eos = sorted(worker_parts[0].get(ref(settings)).processor.eos_token_ids)
    never_ending = tuple((token, -100.0) for token in eos)
    chats = [chat(settings, f"Write a long story about {topic}.", max_tokens=2000, logit_bias=never_ending)
             for topic in ("a dragon", "the sea")]
    for request in chats:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)

    def decoded() -> int:
        return sum(s.tokens for b in run.text.values() for m in b.members.values() for s in m.sequences)

    # The chats decode first (waited on, not timed: on a busy machine their preparing and prefill may
    # take longer than the text's share of turns before a solo task's piece), then the transcription comes.
    step_until(run, lambda: decoded() >= 2)
    submit(redis_conn, settings, transcription, queue=BATCH, func=TRANSCRIPTION)
    run.admission.look_now()
    # Taken beside the chats (it may run its one piece at the step that takes it).
    step_until(run, lambda: any(e["type"] in ("done", "error") for e in read_log(redis_conn, "job-speech")))
    at_end = decoded()
    assert read_log(redis_conn, "job-speech")[-1]["type"] == "done"
    # It started after the chats had decoded, and finished while they still decoded, which they go on
    # doing after it: it ran between their steps.
    speech_job, text_jobs = fetch_job(redis_conn, "job-speech"), [fetch_job(redis_conn, r.id) for r in chats]
    timeline = [(j.id, j.started_at, j.ended_at) for j in [speech_job, *text_jobs]]
    assert all(j.started_at <= speech_job.started_at and j.ended_at is None for j in text_jobs), timeline
    assert sum(len(b) for b in run.text.values()) == 2
    step_until(run, lambda: decoded() >= at_end + 2, limit=50)
    for request in chats:
        redis_conn.set(keys.cancel_flag(request.id), 1, ex=60)
    run.run()
    ends = [read_log(redis_conn, r.id)[-1] for r in chats]
    assert all(e["type"] == "error" and e["data"]["code"] == "canceled" for e in ends), ends


@pytest.fixture()
def small_chunks(monkeypatch):
    """Prefill in chunks of 64 tokens, so a prompt of a few hundred tokens takes several (and the
    CPU is not kept busy for a minute with thousands)."""
    monkeypatch.setattr(textbatch, "PREFILL_CHUNK", 64)


@pytest.fixture()
def prepared_when_taken(monkeypatch):
    """A request joins its batch at the step that takes it, however long its preparation takes (up to a
    generous bound): tests that count steps until a token must not count a busy machine's slow tokenizing."""
    monkeypatch.setattr(prepare, "PREPARE_WAIT_S", 60.0)


def test_a_long_prompt_is_processed_in_chunks_between_the_others_tokens(redis_conn, settings, worker_parts,
                                                                          small_chunks, processed,
                                                                          prepared_when_taken, alone):
    short = chat(settings, QUESTIONS[2])
    submit(redis_conn, settings, short)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: run.text and any(s.tokens for b in run.text.values()
                                             for m in b.members.values() for s in m.sequences))
    long_prompt = chat(settings, LONG_PROMPT, max_tokens=4)
    submit(redis_conn, settings, long_prompt)
    run.admission.look_now()  # look at the queue at the next step
    # Joined once prepared (at the step that takes it: tokenizing it on a busy machine may take longer
    # than a step, and the short request's tokens would run out meanwhile).
    step_until(run, lambda: any(t.request.id == long_prompt.id for b in run.text.values() for t in b.members))
    [batch] = run.text.values()
    ours = next(m for t, m in batch.members.items() if t.request.id == short.id).sequences[0]
    theirs = next(m for t, m in batch.members.items() if t.request.id == long_prompt.id).sequences[0]
    assert theirs.prompt_tokens > 2 * textbatch.PREFILL_CHUNK  # several chunks of prefill
    without_token = chunks = 0
    while not theirs.tokens and not ours.finish_reason:
        before, tokens_before = ours.tokens, processed[0]
        run.step()
        # Every step gives the short request its next token, or processes one chunk of the long
        # prompt; never two steps in a row without a token.
        without_token = 0 if ours.tokens == before + 1 else without_token + 1
        assert without_token <= 1 and processed[0] - tokens_before <= textbatch.PREFILL_CHUNK + 1
        chunks += without_token
    assert chunks >= 1  # and the long prompt went on meanwhile (at most half of the time is its)
    run.run()
    assert texts(done(redis_conn, short.id)) == texts(alone(short))


@pytest.mark.parametrize(("question", "sampling", "joined_while"), [
    (QUESTIONS[2], {}, "decoding"),
    (QUESTIONS[4], MIXED[4], "decoding"),  # seeded, with a penalty
    (LONG_PROMPT, {"max_tokens": 4}, "prefilling"),
])
def test_a_request_decoding_alone_is_taken_over_by_the_batch_with_the_same_text(
        redis_conn, settings, worker_parts, small_chunks, prepared_when_taken, alone, question, sampling,
        joined_while):
    first = chat(settings, question, **sampling)
    submit(redis_conn, settings, first)
    run = scheduler(redis_conn, settings, worker_parts)

    def alone_and(state) -> bool:
        if state == "prefilling":
            return any(p.fed for b in run.text.values() for p in b.prefilling)
        return any(len(b.decoder) == 1 and b.decoder.slots[0].handed >= 5 for b in run.text.values())

    step_until(run, lambda: alone_and(joined_while))
    second = chat(settings, QUESTIONS[3], max_tokens=4)
    submit(redis_conn, settings, second)
    run.admission.look_now()  # look at the queue at the next step
    if joined_while == "decoding":
        step_until(run, lambda: sum(b.sequences for b in run.text.values()) == 2)
        [batch] = run.text.values()
        assert batch.decoder.batched  # one batch cache holds both
    else:  # the short one goes first, alone, while the long prompt is still being processed
        step_until(run, lambda: any(len(b.decoder) == 1 and b.decoder.slots[0].key.task.request.id == second.id
                                    for b in run.text.values()))
    run.run()
    for request in (first, second):
        assert texts(done(redis_conn, request.id)) == texts(alone(request))


@pytest.fixture()
def processed(monkeypatch):
    """A count of the tokens the demo model processes (prompt and decode, padding included): a spy on
    the real model's forward pass."""
    count = [0]
    forward = llama.Model.__call__

    def counting(self, inputs, *args, **kwargs):
        count[0] += inputs.size
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(llama.Model, "__call__", counting)
    return count


def first_token_step(run: Scheduler, request, limit: int = 500) -> int:
    """Step until the request has generated a token; how many steps that took."""
    for steps in range(1, limit + 1):
        run.step()
        for batch in run.text.values():  # what a step hands to the publishing thread is published when it is done
            batch.flush()
        log = read_log(run.conn, request.id)
        if any(e["type"] in ("delta", "done") for e in log):
            return steps
    raise AssertionError("no token came")


def test_a_first_token_comes_from_its_prompts_own_pass(redis_conn, settings, worker_parts, prepared_when_taken,
                                                      alone):
    # While another request decodes, a new request's first token goes out at the step that processes its
    # prompt, not at a decode step after it; an answer of one token never joins the decoders at all.
    other = chat(settings, QUESTIONS[2])
    submit(redis_conn, settings, other)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: run.text and any(b.sequences for b in run.text.values()))
    batch = next(iter(run.text.values()))
    for max_tokens in (1, 4):
        request = chat(settings, QUESTIONS[0], max_tokens=max_tokens)
        submit(redis_conn, settings, request)
        run.admission.look_now()
        assert first_token_step(run, request) == 1  # taken, prepared, its prompt processed: its token is out
        assert batch.sequences == (1 if max_tokens == 1 else 2)
    run.run()
    assert texts(done(redis_conn, request.id)) == texts(alone(request))
    assert texts(done(redis_conn, other.id)) == texts(alone(other))


def test_a_short_request_starts_within_a_chunk_or_two_while_long_prompts_prefill(
        redis_conn, settings, worker_parts, small_chunks, processed, prepared_when_taken, alone, caplog):
    caplog.set_level(logging.DEBUG, logger=textbatch.__name__)  # each request's timeline, logged as it ends
    longs = [chat(settings, f"{i}: Summarise this: {FOX * 16}", max_tokens=4) for i in range(2)]  # 3 chunks
    for request in longs:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: run.text and sum(len(b.prefilling) for b in run.text.values()) == 2
               and any(p.fed for b in run.text.values() for p in b.prefilling))
    short = chat(settings, QUESTIONS[1], max_tokens=4)
    job_id = submit(redis_conn, settings, short)
    run.admission.look_now()
    before = processed[0]
    steps = first_token_step(run, short)
    # Its own prompt and one decode step, plus at most one chunk of the long prompts: not a chunk of
    # each long prompt for each step it waited (mlx-lm's generator fed every prompt each step).
    assert processed[0] - before <= 2 * textbatch.PREFILL_CHUNK + 2, (processed[0] - before, steps)
    assert all(not any(e["type"] == "done" for e in read_log(redis_conn, r.id)) for r in longs)
    run.run()
    assert texts(done(redis_conn, short.id)) == texts(alone(short))
    # The DEBUG timeline says the same: its first token came at its own turn, nobody decoding before it.
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"text request {job_id} ")]
    assert "turns before its first token: 1 prompt processing, 0 decoding" in line, line


def test_a_short_request_does_not_wait_for_a_big_requests_many_choices(redis_conn, settings, worker_parts,
                                                                        prepared_when_taken, alone):
    big = contract.TextRequest(f"cmpl-{uuid.uuid4().hex}", ref(settings),
                               contract.Sampling(max_tokens=6, temperature=1.0, seed=3),
                               prompts=[f"Story {i}: once upon a time" for i in range(4)], n=2)
    submit(redis_conn, settings, big, func=TEXT_COMPLETION)
    run = scheduler(redis_conn, settings, worker_parts, max_batch=4)
    step_until(run, lambda: run.text and sum(b.sequences for b in run.text.values()) == 4)
    short = chat(settings, QUESTIONS[1], max_tokens=4)
    submit(redis_conn, settings, short)
    run.admission.look_now()
    # Its prompt, then a step that takes it into the generator, then its first token: not after the
    # 4 choices that wait for a place before it (mlx-lm's generator queued it behind them).
    assert first_token_step(run, short) <= 4
    [batch] = run.text.values()
    assert batch.sequences == 5 and batch.ready  # the big request's others still wait
    run.run()
    data = done(redis_conn, big.id)
    assert len(data["choices"]) == 8 and texts(done(redis_conn, short.id)) == texts(
        alone(short))


def test_a_turn_of_prompt_processing_goes_to_a_request_with_nothing_started_its_shortest_prompt_first():
    big, long_one, new = object(), object(), object()
    prompts = [Prompt(big, [], [], [], list(range(30)), 0), Prompt(long_one, [], [], [], list(range(2000)), 1),
               Prompt(big, [], [], [], list(range(30)), 2), Prompt(new, [], [], [], list(range(900)), 3),
               Prompt(new, [], [], [], list(range(40)), 4)]
    started = Counter({big: 3})  # the big request already has choices decoding
    turn = plan(prompts, started, 512)
    # The new request's short prompt alone (the long ones do not fit whole in what is left, and the
    # big request's prompts wait for the requests that have nothing under way).
    assert [(p.order, n) for p, n in turn] == [(4, 40)]
    # Long prompts in arrival order, a chunk at a time; the big request's only when none is left.
    assert [(p.order, n) for p, n in plan(prompts[:4], started, 512)] == [(1, 512)]
    assert [(p.order, n) for p, n in plan([prompts[0], prompts[2]], started, 512)] == [(0, 30), (2, 30)]
    # With room for a burst the same: the long prompts and the big request's stay out of a turn of new ones.
    assert [(p.order, n) for p, n in plan(prompts, started, 512, 4096)] == [(4, 40)]


def test_a_burst_of_new_short_prompts_takes_one_turn_past_the_chunk_and_a_long_prompt_still_a_chunk():
    chats = [Prompt(object(), [], [], [], list(range(50)), i) for i in range(40)]  # 2,000 tokens, all new
    long_one = Prompt(object(), [], [], [], list(range(3000)), 40)
    under_way = Prompt(object(), [], [], [], list(range(60)), 41)
    under_way.turns = 1  # a prompt whose processing has begun is not part of a burst
    turn = plan([*chats, long_one, under_way], Counter(), 512, 4096)
    assert [(p.order, n) for p, n in turn] == [(i, 50) for i in range(40)]
    assert [(p.order, n) for p, n in plan(chats, Counter(), 512, 1000)] == [(i, 50) for i in range(20)]
    assert [(p.order, n) for p, n in plan(chats, Counter(), 512)] == [(i, 50) for i in range(10)]  # no burst room
    assert [(p.order, n) for p, n in plan([long_one, *chats[:2]], Counter(), 512, 4096)] == [(0, 50), (1, 50)]
    assert [(p.order, n) for p, n in plan([long_one], Counter(), 512, 4096)] == [(40, 512)]


def test_a_prompt_too_long_to_fit_is_refused_from_its_length_before_it_is_tokenized(worker_parts, settings):
    models, _ = worker_parts
    tokenizer = models.get(ref(settings)).processor
    huge = [{"role": "user", "content": "word " * 12_000_000}]  # 60 MB
    started = time.perf_counter()
    with pytest.raises(ContextLengthExceeded, match="characters"):
        textgen.prompt_ids(tokenizer, huge, None, 8192)
    assert time.perf_counter() - started < 5  # tokenizing it took 81 s
    # Text under the bound is tokenized and counted as before.
    assert len(textgen.prompt_ids(tokenizer, [{"role": "user", "content": "Hi"}], None, 8192)) < 40


def test_whole_prompts_that_share_a_turn_are_processed_in_one_pass_as_they_would_be_alone(
        worker_parts, settings, monkeypatch):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from workers.backends.prefill import feed_together

    models, _ = worker_parts
    resident = models.get(ref(settings))
    tokenizer = resident.processor
    ids = [tokenizer.encode(f"Story {i}: once upon a time" + ", by the river" * i) for i in range(4)]
    cached = [0, 5, 0, 12]  # two of them resume from a cached prefix of their own length

    def prompts():
        out = [Prompt(None, [], make_prompt_cache(resident.model), [], list(i), n) for n, i in enumerate(ids)]
        for prompt, n in zip(out, cached, strict=True):
            if n:
                prompt.feed(resident.model, n)
        return out

    alone_ones, together = prompts(), prompts()
    assert all(p.plain for p in together)
    alone_logits = [prompt.feed(resident.model, prompt.left) for prompt in alone_ones]
    calls, heads = [], []
    forward = llama.Model.__call__
    monkeypatch.setattr(llama.Model, "__call__", lambda self, x, *a, **k: calls.append(x.shape) or forward(self, x, *a, **k))
    embedding = type(resident.model.model.embed_tokens)  # the demo model's output layer is its tied embedding
    head = embedding.as_linear
    monkeypatch.setattr(embedding, "as_linear", lambda self, x: heads.append(x.shape[:2]) or head(self, x))
    together_logits = feed_together(resident.model, together)
    monkeypatch.undo()
    # One pass, padded to the longest part left; the output layer on each prompt's last token only.
    assert calls == [(4, max(len(i) - n for i, n in zip(ids, cached, strict=True)))]
    assert heads == [(4, 1)]
    for a, b, logits_a, logits_b in zip(alone_ones, together, alone_logits, together_logits, strict=True):
        assert (a.fed, a.rest, a.cache[0].offset) == (b.fed, b.rest, b.cache[0].offset) and not b.rest
        # The same next-token distribution as processed alone (padding is masked, positions kept), and
        # the same as the full forward pass's at the prompt's last token.
        full = resident.model(mx.array(a.fed)[None])[0, -1]
        for logits in (logits_a, logits_b):
            assert mx.allclose(full, logits, atol=1e-3).item() and mx.argmax(full).item() == mx.argmax(logits).item()
        # The caches hold the whole prompt: the next token feeds on from them as from a full pass.
        token = mx.array([[mx.argmax(full).item()]])
        next_a = resident.model(token, cache=a.cache)[0, -1]
        next_b = resident.model(token, cache=b.cache)[0, -1]
        assert mx.allclose(next_a, next_b, atol=1e-3).item() and mx.argmax(next_a).item() == mx.argmax(next_b).item()


def test_leaving_rows_keep_the_caches_mlx_lm_would_extract(worker_parts, settings):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from workers.backends.decoding import DecodeBatch, Joining, kept_rows
    from workers.backends.sampling import Row

    models, _ = worker_parts
    resident = models.get(ref(settings))
    vocab = textgen.output_size(resident.model, resident.processor)
    decoder = DecodeBatch(resident.model, vocab, set())
    joining, keys = [], [object() for _ in range(3)]  # the decoder tells its sequences apart by identity
    for i, n in enumerate((3, 11, 6)):  # prompts of different lengths: each row its own left padding
        ids = list(range(100 + i, 100 + i + n))
        prompt = Prompt(None, [], make_prompt_cache(resident.model), [], ids, i)
        prompt.feed(resident.model, n)
        joining.append(Joining(keys[i], prompt.cache, prompt.fed, 7, 100, Row()))
    decoder.insert_many(joining)
    for _ in range(3):
        decoder.step()
    mx.eval(decoder.inputs)
    expected = {i: [c.extract(i) for c in decoder.cache] for i in (0, 2)}
    kept = decoder.remove([keys[0], keys[2]], keep_caches=True)
    assert [len(fed) for _, fed in kept] == [3 + 3, 6 + 3]  # the prompt and the three tokens the steps fed
    for (cache, fed), i in zip(kept, (0, 2), strict=True):
        for mine, theirs in zip(cache, expected[i], strict=True):
            assert mine.offset == theirs.offset == len(fed)
            assert mx.array_equal(mine.keys, theirs.keys).item() and mx.array_equal(mine.values, theirs.values).item()
    assert len(decoder) == 1 and decoder.slots[0].key is keys[1]
    # The last one leaves with the batch's cache as it is, for its row to be cut after its answer is out.
    decoder.insert_many([Joining(keys[0], kept[0][0], kept[0][1], 7, 100, Row())])
    decoder.step()
    mx.eval(decoder.inputs)
    expected = [[c.extract(i) for c in decoder.cache] for i in range(2)]
    cache, batched, fed = decoder.clear()
    assert batched and len(decoder) == 0 and decoder.cache == [] and decoder.inputs is None
    assert [len(f) for f in fed] == [11 + 4, 3 + 3 + 1]
    for row, cut in enumerate(kept_rows(cache, [0, 1])):
        for mine, theirs in zip(cut, expected[row], strict=True):
            assert mine.offset == theirs.offset == len(fed[row])
            assert mx.array_equal(mine.keys, theirs.keys).item() and mx.array_equal(mine.values, theirs.values).item()


def test_rows_of_every_cache_kind_leave_as_their_own_extract_cuts_them():
    # A model may mix plain layers with sliding-window ones (and recurrent states): only the plain batch caches
    # are cut from a padding read once; every other kind through its own extract.
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RotatingKVCache

    from workers.backends.decoding import kept_rows

    def filled(cache, n: int, seed: int):
        key = mx.random.key(seed)
        cache.update_and_fetch(mx.random.normal((1, 2, n, 4), key=key), mx.random.normal((1, 2, n, 4), key=key))
        return cache

    lengths = (3, 11, 6)
    layers = [BatchKVCache.merge([filled(KVCache(), n, i) for i, n in enumerate(lengths)]),
              BatchRotatingKVCache.merge([filled(RotatingKVCache(max_size=8), n, 10 + i) for i, n in enumerate(lengths)])]
    for row, cut in zip((0, 2), kept_rows(layers, [0, 2]), strict=True):
        for mine, layer in zip(cut, layers, strict=True):
            theirs = layer.extract(row)
            assert type(mine) is type(theirs)
            for a, b in zip(mine.state, theirs.state, strict=True):
                assert mx.array_equal(a, b).item()


def test_kept_caches_are_copies_of_their_rows_not_views_of_the_batch(redis_conn, settings, worker_parts):
    import gc

    import mlx.core as mx

    requests = [chat(settings, q, max_tokens=4) for q in QUESTIONS]
    for request in requests:
        submit(redis_conn, settings, request)
    run = scheduler(redis_conn, settings, worker_parts)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    run.run()
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    # What stays after the batch is gone is the prompt cache's entries: a row each. A lazy row cut from
    # the batch held the batch's whole key and value buffers (every row, room for 256 tokens each).
    assert run.prompt_cache.nbytes > 0
    assert held <= 1.25 * run.prompt_cache.nbytes + 2**20, (held, run.prompt_cache.nbytes)


def test_a_request_being_prepared_does_not_hold_up_the_batch(redis_conn, settings, worker_parts, monkeypatch,
                                                             alone):
    import threading

    gate = threading.Event()
    real_prepare = textbatch.TextBatch._prepare

    def slow_prepare(self, request):  # the real preparation, held back until the test lets it go
        if request.id == slow.id:
            assert gate.wait(60)
        return real_prepare(self, request)

    monkeypatch.setattr(textbatch.TextBatch, "_prepare", slow_prepare)
    monkeypatch.setattr(prepare, "LIGHT_CHARS", 0)  # prepared on a thread, as a long prompt or many tools are
    first = chat(settings, QUESTIONS[2])
    slow = chat(settings, QUESTIONS[1], max_tokens=4)
    submit(redis_conn, settings, first)
    run = scheduler(redis_conn, settings, worker_parts)
    step_until(run, lambda: any(b.sequences for b in run.text.values()))
    submit(redis_conn, settings, slow)
    run.admission.look_now()
    step_until(run, lambda: any(b.preparing for b in run.text.values()))
    [batch] = run.text.values()
    [ours] = [m for t, m in batch.members.items() if t.request.id == first.id]
    before = ours.sequences[0].tokens
    for _ in range(5):  # its preparation takes as long as it takes; the batch steps on meanwhile
        run.step()
    assert ours.sequences[0].tokens >= before + 4 and batch.preparing
    gate.set()
    run.run()
    for request in (first, slow):
        assert texts(done(redis_conn, request.id)) == texts(alone(request))
