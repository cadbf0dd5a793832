"""The batched sampler's arithmetic (workers/backends/sampling.py), on small made-up distributions."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_repetition_penalty

from jobs.contract import Sampling
from workers.backends import sampling
from workers.backends.sampling import BatchSampler, Row

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.fixture(params=["host", "mlx"])
def draw_path(request, monkeypatch):
    """A test that draws, twice: sampled rows drawing on the host (numpy, a CPU's way) and in MLX (a GPU's, run
    here on the CPU)."""
    monkeypatch.setattr(sampling.cpu_math, "on_cpu", lambda: request.param == "host")  # (whatever the device)
    return request.param


def logprobs(probs, rows: int = 1) -> mx.array:
    return mx.log(mx.array([probs] * rows, mx.float32))


def draws(row: Row, probs, n: int) -> list[int]:
    """`n` successive draws of one row from the same distribution."""
    batch = BatchSampler(len(probs))
    batch.extend([row], [[]])
    return [batch.sample(logprobs(probs)).item() for _ in range(n)]


def test_draws_follow_the_distribution_and_the_temperature(draw_path):
    # Twenty rows drawing 400 times each, in one batch (a sampling call per step, not per draw): ten at
    # temperature 1, ten at 0.5, which squares the probabilities (renormalized): the likeliest gains.
    sharp = np.array(PROBS) ** 2 / sum(p * p for p in PROBS)
    batch = BatchSampler(len(PROBS))
    batch.extend([Row(temperature=1.0 if i < 10 else 0.5, seed=i + 1) for i in range(20)], [[]] * 20)
    tokens = np.array([batch.sample(logprobs(PROBS, 20)).tolist() for _ in range(400)])  # (step, row)
    for rows, expected in ((slice(0, 10), np.array(PROBS)), (slice(10, 20), sharp)):
        counts = np.bincount(tokens[:, rows].ravel(), minlength=4) / tokens[:, rows].size
        assert np.abs(counts - expected).max() < 0.03, counts
        # Each row's own stream follows it too (a row stuck on one token, or copying another, would not).
        for row in tokens[:, rows].T:
            counts = np.bincount(row, minlength=4) / len(row)
            assert np.abs(counts - expected).max() < 0.1, counts
    assert len({tuple(row) for row in tokens.T}) == 20  # twenty streams of their own


@pytest.mark.parametrize(("row", "allowed"), [
    (Row(temperature=1.0, top_k=2, seed=3), {0, 1}),
    (Row(temperature=1.0, top_p=0.7, seed=4), {0, 1}),  # 0.5 alone is short of 0.7; 0.5 + 0.3 is not
    (Row(temperature=1.0, top_p=0.5, seed=5), {0}),
    (Row(temperature=1.0, min_p=0.25, seed=6), {0, 1, 2}),  # at least 0.25 x 0.5
    (Row(temperature=1.0, top_k=3, top_p=0.85, min_p=0.5, seed=7), {0, 1}),  # every filter at once
])
def test_filters_keep_only_what_they_allow(row, allowed, draw_path):
    seen = set(draws(row, PROBS, 400))
    assert seen == allowed


def test_greedy_rows_take_the_argmax_beside_sampled_rows(draw_path):
    batch = BatchSampler(4)
    batch.extend([Row(), Row(temperature=1.0, seed=9), Row(), Row(temperature=1.5, top_k=3, seed=10)], [[]] * 4)
    rows = mx.log(mx.array([PROBS, PROBS, PROBS[::-1], PROBS], mx.float32))
    for _ in range(20):
        tokens = batch.sample(rows).tolist()
        assert tokens[0] == 0 and tokens[2] == 3 and tokens[3] != 3


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(draw_path):
    seeded = Row(temperature=1.0, top_p=0.9, seed=42)
    alone = draws(seeded, PROBS, 50)
    batch = BatchSampler(4)
    batch.extend([Row(temperature=0.7, seed=1)], [[]])
    tokens = []
    for step in range(50):
        if step == 0:
            batch.extend([seeded, Row()], [[], []])  # it joins a batch already under way
        if step == 20:
            batch.keep([1, 2])  # the row before it leaves
        tokens.append(batch.sample(logprobs(PROBS, len(batch))).tolist()[1 if step < 20 else 0])
    assert tokens == alone
    assert draws(Row(temperature=1.0, top_p=0.9, seed=43), PROBS, 50) != alone


def test_choices_of_one_seeded_request_draw_differently(draw_path):
    request = Sampling(temperature=1.0, seed=5)
    first, second = (sampling.row_for(request, 4, offset) for offset in (0, 1))
    assert draws(first, PROBS, 30) != draws(second, PROBS, 30)


def test_logit_bias_bans_and_forces(draw_path):
    batch = BatchSampler(4)
    batch.extend([Row(logit_bias=((0, -100.0),)), Row(temperature=1.0, logit_bias=((3, 100.0),), seed=1), Row()],
                 [[]] * 3)
    logits = batch.process(logprobs(PROBS, 3), mx.array([0, 0, 0]), [False] * 3)
    tokens = batch.sample(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()
    assert tokens == [1, 3, 0]


def test_presence_and_frequency_penalties_count_only_the_answer():
    batch = BatchSampler(4)
    batch.extend([Row(presence_penalty=1.0), Row(frequency_penalty=0.5), Row()], [[2, 2, 2]] * 3)
    zeros = mx.zeros((3, 4))
    # The first input is the prompt's last token: not counted.
    assert batch.process(zeros, mx.array([2, 2, 2]), [False] * 3).tolist() == [[0.0] * 4] * 3
    batch.process(zeros, mx.array([1, 1, 1]), [True] * 3)
    out = batch.process(zeros, mx.array([1, 1, 1]), [True] * 3).tolist()
    assert out[0] == [0.0, -1.0, 0.0, 0.0]  # once, however often
    assert out[1] == [0.0, -1.0, 0.0, 0.0]  # 0.5 per occurrence, twice
    assert out[2] == [0.0] * 4


def test_repetition_penalty_is_mlx_lms():
    context = [5, 1, 7, 1, 3]
    values = [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0, 0.0, -0.5]]
    expected = make_repetition_penalty(1.5, 20)(mx.array(context + [6]), mx.array(values))  # (writes in place)
    logits = mx.array(values)
    batch = BatchSampler(8)
    batch.extend([Row(repetition_penalty=1.5)], [context])
    assert np.allclose(batch.process(logits, mx.array([6]), [False]), expected)


def test_a_row_without_settings_leaves_the_logits_alone_beside_rows_with_them():
    batch = BatchSampler(4)
    batch.extend([Row(repetition_penalty=2.0, presence_penalty=1.0, logit_bias=((1, 3.0),)), Row()],
                 [[0, 1], [0, 1]])
    logits = mx.array([[1.0, 2.0, -1.0, 0.5]] * 2)
    batch.process(logits, mx.array([1, 1]), [True, True])
    out = batch.process(logits, mx.array([1, 1]), [True, True])
    assert out[1].tolist() == [1.0, 2.0, -1.0, 0.5]
    assert out[0].tolist() != out[1].tolist()


def test_grammar_masks_apply_to_their_rows_only():
    words = np.zeros((1, 1), np.uint32)
    words[0, 0] = 0b0100  # only token 2
    out = sampling.masked(mx.zeros((2, 4)), [1], words)
    assert out[0].tolist() == [0.0] * 4
    assert [math.isinf(v) for v in out[1].tolist()] == [True, True, False, True]


def test_top_p_chooses_among_the_candidates_only_and_top_k_widens_them(monkeypatch, draw_path):
    monkeypatch.setattr(sampling, "CANDIDATES", 2)  # as 1024 of a real vocabulary
    assert set(draws(Row(temperature=1.0, top_p=0.7, seed=8), PROBS, 300)) == {0, 1}
    assert set(draws(Row(temperature=1.0, top_p=0.95, seed=9), PROBS, 300)) == {0, 1}  # the nucleus is cut there
    assert set(draws(Row(temperature=1.0, top_k=3, seed=10), PROBS, 300)) == {0, 1, 2}


def test_masks_of_every_row_apply_word_by_word():
    # Every row masked and a vocabulary of whole words: the one-kernel path (allowed_only), bit i of word w for
    # token 32 * w + i.
    words = np.zeros((2, 2), np.uint32)
    words[0, 0], words[0, 1], words[1, 1] = 0b1001, 1 << 31, 0xFFFFFFFF
    out = sampling.masked(mx.ones((2, 64)), [0, 1], words)
    assert [i for i, v in enumerate(out[0].tolist()) if not math.isinf(v)] == [0, 3, 63]
    assert [i for i, v in enumerate(out[1].tolist()) if not math.isinf(v)] == list(range(32, 64))


def test_a_mask_narrower_than_the_output_disallows_the_rest():
    words = np.full((1, 1), 0xFFFFFFFF, np.uint32)  # a grammar over 32 tokens, all allowed
    out = sampling.masked(mx.zeros((1, 40)), [0], words)
    assert [math.isinf(v) for v in out[0].tolist()] == [False] * 32 + [True] * 8


def test_the_compiled_steps_serve_every_batch_size_from_one_trace():
    # On a GPU the draw and the penalties run compiled; rows come and go, and a compile per batch size was
    # rebuilt at each new one (seconds on CUDA). Compiled for every size, they trace once and compute what
    # the plain functions do.
    compiled = (sampling.draw, sampling.penalties, sampling.repetition, sampling.cut_points, sampling.allowed_only)
    vocab, before = 500, [fn.traces for fn in compiled]
    for rows in (3, 5, 2):
        logprobs = mx.log(mx.softmax(mx.random.normal((rows, vocab), key=mx.random.key(rows)), axis=-1))
        args = (logprobs, mx.full((rows,), 1.3), mx.array([1.0, 0.0] * (rows // 2) + [1.0] * (rows % 2)),
                mx.array(sampling.uniforms(np.arange(rows, dtype=np.uint32), np.arange(rows, dtype=np.uint32) * 7,
                                           np.full(rows, 4, np.uint32))), mx.full((rows,), -mx.inf))
        assert mx.array_equal(sampling.draw.compiled(*args), sampling.draw(*args)).item()
        counts = (mx.random.uniform(shape=(rows, vocab), key=mx.random.key(9)) > 0.9).astype(mx.float32)
        args = (logprobs, counts, mx.full((rows,), 0.5), mx.full((rows,), 0.25))
        assert mx.allclose(sampling.penalties.compiled(*args), sampling.penalties(*args)).item()
        recent = mx.random.randint(0, vocab, (rows, sampling.REPETITION_CONTEXT), key=mx.random.key(rows))
        args = (logprobs, recent, mx.full((rows,), 1.2))
        assert mx.array_equal(sampling.repetition.compiled(*args), sampling.repetition(*args)).item()
        for width in (vocab, 64 * rows):  # the candidates of another model, or of a wider top_k
            args = (logprobs[:, :width] if width < vocab else logprobs, mx.array([0.9, 0.3, 1.0, 0.5, 0.99][:rows]),
                    mx.array([7, 400, 1, 50, 500][:rows], mx.int32), mx.array([0.0, 0.05, 0.0, 0.2, 0.0][:rows]))
            assert mx.array_equal(sampling.cut_points.compiled(*args), sampling.cut_points(*args)).item()
        words = mx.random.randint(0, 2**31, (rows, 16, 1), key=mx.random.key(rows)).astype(mx.uint32)
        args = (mx.random.normal((rows, 16, 32), key=mx.random.key(rows)), words, sampling._BITS)
        assert mx.array_equal(sampling.allowed_only.compiled(*args), sampling.allowed_only(*args)).item()
    assert [fn.traces for fn in compiled] == [n + 1 for n in before]


def test_a_seeds_uniforms_are_the_ones_it_always_had():
    # Made on the host since 2026-11-28 (on the device before): a seeded request keeps drawing what it drew.
    seeds = np.array([0, 1, 42, 2**32 - 1, 2**32, 2**63 + 12345, 7 * 2**40 + 3], np.uint64)
    drawn = np.array([0, 1, 5, 127, 3, 1000, 2**20], np.uint32)
    got = sampling.uniforms((seeds & 0xFFFFFFFF).astype(np.uint32), (seeds >> 32).astype(np.uint32), drawn)
    assert got.dtype == np.float32
    assert got.tolist() == [0.5793412327766418, 0.5254772305488586, 0.8607051968574524, 0.0006986570078879595,
                            0.46145060658454895, 0.7029715776443481, 0.8595072031021118]


def test_the_filters_threshold_is_the_keep_th_likeliest_token():
    # top_k 3 keeps the 3 likeliest; top_p 0.5 the fewest whose mass reaches it; min_p 0.3 those at least 0.3
    # times the likeliest (0.4: 0.3 and 0.2 too, 0.1 not); at least one.
    probs = mx.array([[0.1, 0.4, 0.2, 0.3]] * 4)
    out = sampling.thresholds(mx.log(probs), mx.array([1.0, 0.5, 1.0, 1e-9]), mx.array([3, 4, 4, 4], mx.int32),
                              mx.array([0.0, 0.0, 0.3, 0.0]), sampling.CANDIDATES)
    assert mx.allclose(mx.exp(out), mx.array([0.2, 0.3, 0.2, 0.4])).item()


def test_a_filtered_row_draws_among_its_own_candidates_whatever_its_neighbours_ask(draw_path):
    # A vocabulary wider than CANDIDATES: a top_p row draws only among its CANDIDATES likeliest tokens, and a
    # neighbour with a top_k wider than that does not change what the seeded top_p row draws (its filters were
    # computed over the neighbour's wider candidates, and its nucleus cut elsewhere).
    vocab = 3 * sampling.CANDIDATES
    logits = mx.random.normal((vocab,), key=mx.random.key(5)) * 0.01  # nearly flat: the nucleus is wide
    row = logits - mx.logsumexp(logits)
    likeliest = set(np.argsort(-np.array(row))[:sampling.CANDIDATES].tolist())
    top_p = Row(temperature=1.0, top_p=0.99, seed=11)

    def run(rows: list[Row], steps: int = 40) -> list[int]:
        batch = BatchSampler(vocab)
        batch.extend(rows, [[]] * len(rows))
        return [batch.sample(mx.stack([row] * len(rows))).tolist()[0] for _ in range(steps)]

    alone = run([top_p])
    assert set(alone) <= likeliest and len(set(alone)) > 30
    assert run([top_p, Row(temperature=1.0, top_k=2 * sampling.CANDIDATES, seed=12)]) == alone


def test_the_host_draws_what_mlx_draws():
    # Sixty-four rows of every kind on peaked random distributions of a 3,000-token vocabulary (candidates 1,024):
    # the numpy draw and MLX's pick the same tokens but where the two exps round a uniform across a boundary.
    vocab, rows = 3000, [Row(), Row(temperature=1.0, seed=1), Row(temperature=0.7, top_p=0.9, seed=2),
                         Row(temperature=1.0, top_k=40, seed=3), Row(temperature=0.8, min_p=0.05, seed=4),
                         Row(temperature=1.3, top_k=1500, top_p=0.95, seed=5)] * 11
    host, device = BatchSampler(vocab, host=True), BatchSampler(vocab, host=False)
    for batch in (host, device):
        batch.extend(rows[:64], [[]] * 64)
    same = total = 0
    for step in range(10):
        logits = 4 * mx.random.normal((64, vocab), key=mx.random.key(step))
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        a, b = host.sample(logprobs).tolist(), device.sample(logprobs).tolist()
        same, total = same + sum(x == y for x, y in zip(a, b, strict=True)), total + 64
    assert same >= 0.99 * total, (same, total)
