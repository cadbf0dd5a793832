"""Embedding requests in the worker's scheduler (real Redis, the demo embedding model): inputs of many requests
share passes, a large request goes in pieces with a chat decoding between them, a cancel takes one request out."""

from __future__ import annotations

import base64
import uuid
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from jobs import contract, keys
from jobs.events import read_log
from jobs.queues import CHAT_COMPLETION, EMBEDDING, INTERACTIVE, enqueue
from jobs.settings import load_settings
from jobs.store import resolve
from workers.backends import embeddings
from workers.scheduler import Scheduler


def model_ref(models_dir, name: str) -> contract.ModelRef:
    info = resolve(name, load_settings({"models_dir": models_dir}))
    return contract.ModelRef(info.id, str(info.path), info.kind, info.context_length, info.vocab_size)


@pytest.fixture(scope="module")
def ref(models_dir):
    return model_ref(models_dir, "minilm-l6")


@pytest.fixture()
def run(redis_conn, settings, text_worker_parts):
    """A burst-mode scheduler on the session's model manager."""
    models, backends = text_worker_parts
    return Scheduler(redis_conn, settings, models, backends, f"test-{uuid.uuid4().hex[:6]}", burst=True, max_batch=8)


def submit(conn, settings, request, func: str = EMBEDDING) -> str:
    enqueue(conn, settings, INTERACTIVE, func, contract.to_payload(request), request.id)
    return request.id


def embed(ref, texts: list) -> contract.EmbeddingRequest:
    return contract.EmbeddingRequest(f"embd-{uuid.uuid4().hex}", ref, texts)


def terminal(conn, job_id: str) -> dict:
    return read_log(conn, job_id)[-1]


def vectors(conn, job_id: str) -> np.ndarray:
    event = terminal(conn, job_id)
    assert event["type"] == "done", event
    return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in event["data"]["embeddings"]])


def encoder(run, ref) -> embeddings.Encoder:
    return run.models.get(ref).model


def test_inputs_of_many_requests_share_passes_and_each_request_gets_its_own_vectors(redis_conn, settings, run, ref,
                                                                                      monkeypatch):
    texts = [[f"Request {r}, sentence {i}: {'a short one' if i % 2 else 'a somewhat longer sentence than that'}."
              for i in range(r % 3 + 1)] for r in range(6)]
    requests = [embed(ref, t) for t in texts]
    for request in requests:
        submit(redis_conn, settings, request)
    passes = []
    real = embeddings.Encoder.encode
    monkeypatch.setattr(embeddings.Encoder, "encode", lambda self, rows: passes.append(len(rows)) or real(self, rows))
    run.run()
    assert sum(passes) == sum(len(t) for t in texts) and len(passes) < len(requests), passes
    alone = encoder(run, ref)
    for request, t in zip(requests, texts, strict=True):
        expected = np.stack([real(alone, alone.token_ids([text]))[0] for text in t])
        np.testing.assert_allclose(vectors(redis_conn, request.id), expected, atol=1e-5)


def test_a_large_request_goes_in_pieces_and_a_chat_decodes_between_them(redis_conn, settings, run, ref, models_dir,
                                                                         monkeypatch):
    monkeypatch.setattr("workers.scheduler.PASS_TOKENS_CPU", 64)  # tiny passes: the request takes many steps
    big = embed(ref, [f"Sentence number {i} of a long document." for i in range(120)])
    chat = contract.TextRequest(f"chatcmpl-{uuid.uuid4().hex}", model_ref(models_dir, "smollm2-135m"),
                                contract.Sampling(max_tokens=4, temperature=0.0),
                                messages=[{"role": "user", "content": "Hi"}])
    submit(redis_conn, settings, big)
    submit(redis_conn, settings, chat, CHAT_COMPLETION)
    ended = []
    real = Scheduler._end_many
    monkeypatch.setattr(Scheduler, "_end_many", lambda self, done: ended.extend(t.run.job_id for t, _ in done)
                        or real(self, done))
    steps = []
    real_step = embeddings.EmbeddingBatch.step
    monkeypatch.setattr(embeddings.EmbeddingBatch, "step", lambda self: steps.append(1) or real_step(self))
    run.run()
    assert ended == [chat.id, big.id], ended  # the chat did not wait for the whole request
    assert len(steps) >= 5  # in pieces: ~1,400 tokens, at most 2 × 64 a step
    assert terminal(redis_conn, chat.id)["type"] == "done"
    got = vectors(redis_conn, big.id)
    alone = encoder(run, ref)
    np.testing.assert_allclose(got[[0, 77, 119]], alone.encode(alone.token_ids(
        [big.inputs[0], big.inputs[77], big.inputs[119]])), atol=1e-5)


def test_a_canceled_request_leaves_and_the_others_are_answered(redis_conn, settings, run, ref, monkeypatch):
    monkeypatch.setattr("workers.scheduler.PASS_TOKENS_CPU", 64)
    doomed = embed(ref, [f"Canceled sentence {i}." for i in range(60)])
    kept = embed(ref, [f"Kept sentence {i}." for i in range(30)])
    submit(redis_conn, settings, doomed)
    submit(redis_conn, settings, kept)
    while not run.embed or not any(len(m.vectors) and m.left < len(m.ids) for b in run.embed.values()
                                   for m in b.members.values()):
        run.step()
    redis_conn.set(keys.cancel_flag(doomed.id), 1)
    run.run()
    assert terminal(redis_conn, doomed.id)["data"]["code"] == "canceled"
    assert vectors(redis_conn, kept.id).shape == (30, 384)


def test_an_input_past_the_models_room_fails_only_its_request(redis_conn, settings, run, ref):
    long = embed(ref, ["fine", "word " * 300])
    empty = embed(ref, [])  # (the web refuses it; a payload from elsewhere must not take the batch down)
    fine = embed(ref, ["fine"])
    for request in (long, empty, fine):
        submit(redis_conn, settings, request)
    run.run()
    error = terminal(redis_conn, long.id)["data"]
    assert (error["status"], error["param"], error["code"]) == (400, "input[1]", "context_length_exceeded")
    assert terminal(redis_conn, empty.id)["data"]["status"] == 400
    assert vectors(redis_conn, fine.id).shape == (1, 384)


def test_passes_are_cut_by_padded_length_after_sorting():
    batch = embeddings.EmbeddingBatch.__new__(embeddings.EmbeddingBatch)
    batch.pass_tokens = 40
    member = SimpleNamespace(ids=[[0] * n for n in (10, 3, 9, 4, 20, 2)])
    passes = batch._passes([(member, i) for i in range(6)])
    lengths = [[len(member.ids[i]) for _, i in rows] for rows in passes]
    assert lengths == [[2, 3, 4, 9], [10, 20]]  # 4 × 9 = 36 ≤ 40; 5 × 10 > 40; 2 × 20 = 40
    assert all(len(rows) * max(row) <= 40 for rows, row in zip(passes, lengths, strict=True))


def test_pooling_modes_use_only_the_real_tokens():
    hidden = mx.array([[[1.0, 0.0], [3.0, 2.0], [100.0, 100.0]]])  # the last token is padding
    mask = mx.array([[1.0, 1.0, 0.0]])
    assert embeddings.pool(hidden, mask, "mean").tolist() == [[2.0, 1.0]]
    assert embeddings.pool(hidden, mask, "cls").tolist() == [[1.0, 0.0]]
    assert embeddings.pool(hidden, mask, "max").tolist() == [[3.0, 2.0]]
    assert embeddings.pool(hidden, mask, "lasttoken").tolist() == [[3.0, 2.0]]


def test_the_bert_forward_with_cpu_math_gives_mlx_embeddings_own_hidden_states(run, ref):
    model = encoder(run, ref).model
    ids = mx.array([[101, 1037, 2158, 2003, 5983, 2833, 1012, 102], [101, 1996, 2047, 102, 0, 0, 0, 0]])
    mask = (ids != 0).astype(mx.float32)
    ours = embeddings.bert_hidden(model, ids, mask)
    theirs = model(ids, attention_mask=mask).last_hidden_state
    assert mx.abs((ours - theirs) * mask[..., None]).max().item() < 1e-4  # the padding rows' own states differ
