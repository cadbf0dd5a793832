"""cpu_math (exp, attention, logsumexp and GELU as fused polynomials) against MLX's own ops, and the
CPU encoder and decoder built on them against mlx-audio's, on real Whisper tiny.en."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.speech_clips import Clip, sentences, spaced, whole
from tests.workers.test_speech import model, ref, worker_parts  # noqa: F401  (fixtures)
from workers.backends import cpu_math, whisper, whisper_decoder, whisper_encoder

pytestmark = pytest.mark.skipif(not cpu_math.polynomials(), reason="the polynomials run on a CPU with g++ only")


def window_of(model, clip: Clip) -> mx.array:  # noqa: F811
    """The log-mel window of a clip."""
    return whisper.window_mel(model, clip.samples.astype(np.float32) / 32768)


@pytest.fixture(scope="module")
def speech_window(model) -> mx.array:  # noqa: F811
    """One window of words and figures: garden's first sentence, then numbers' (an encoder pass costs a
    window whatever it holds; its decoding, the words: two sentences, not two whole recordings)."""
    return window_of(model, spaced([sentences("garden", 0), sentences("numbers", 0)], gap_s=0.5))


@pytest.fixture(scope="module")
def ours(model, speech_window) -> mx.array:  # noqa: F811
    """Our encoder's features of `speech_window` (both encoder tests use them)."""
    return whisper_encoder.encode(model, speech_window[None])


def test_exp_and_gelu_stay_close_to_the_exact_functions():
    scores = mx.array(np.linspace(-120, 0, 100_001, dtype=np.float32))
    got = np.array(cpu_math.exp_below_max(scores, mx.array(0.0)), dtype=np.float64)
    exact = np.exp(np.array(scores, dtype=np.float64))
    assert np.all(np.abs(got - exact) <= 1e-4 * exact + 1e-30)
    x = mx.array(np.linspace(-10, 10, 100_001, dtype=np.float32))
    exact_gelu = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in np.array(x, dtype=np.float64)])
    assert np.abs(np.array(cpu_math.gelu(x)) - exact_gelu).max() < 1e-5
    assert np.abs(np.array(cpu_math.gelu(x)) - np.array(nn.gelu(x))).max() < 1e-5


def test_exp_never_makes_a_subnormal_float():
    # x86 computes subnormals ~100 times slower: a top_p row (-inf but for its candidates) paid it at every token.
    out = np.array(cpu_math.exp_below_max(mx.array([-mx.inf, -1000.0, -88.0, -87.5]), mx.array(0.0)))
    assert np.all(out >= np.finfo(np.float32).tiny)


def test_attention_and_logsumexp_match_mlx():
    mx.random.seed(0)
    q, k, v = (mx.random.normal((2, 6, n, 64)) for n in (5, 300, 300))
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert float(mx.abs(cpu_math.attention(q, k, v, 0.125) - theirs).max()) < 1e-4
    logits = mx.random.normal((3, 51864)) * 8
    logits = mx.where(mx.arange(51864) % 7 == 0, -mx.inf, logits)  # forbidden tokens, as the rules make them
    assert float(mx.abs(cpu_math.logsumexp(logits) - mx.logsumexp(logits, axis=-1)).max()) < 1e-4
    nothing = mx.full((2, 10), -mx.inf)  # a row where everything is forbidden
    assert cpu_math.logsumexp(nothing).tolist() == [-math.inf, -math.inf]


def test_the_encoder_gives_mlx_audios_features_and_transcript(model, speech_window, ours):  # noqa: F811
    theirs = model.encoder(speech_window[None])
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    difference = float(mx.abs(ours - theirs).max())
    assert difference < 0.01 * float(mx.abs(theirs).max()), difference
    # Same tokens through mlx-audio's decoder from either encoder's output, and through ours.
    options = whisper.DecodingOptions(language="en", temperature=0.0, fp16=False)
    reference = model.decode(theirs[0], options)
    assert "apple" in reference.text and "oranges" in reference.text  # both sentences were heard
    expected = reference.tokens
    assert model.decode(ours[0], options).tokens == expected
    tokenizer = model.get_tokenizer(language="en", task="transcribe")
    assert whisper_decoder.decode_features(model, ours, tokenizer, [])[0].tokens == expected


def test_windows_encoded_in_groups_equal_each_alone(model, speech_window, ours):  # noqa: F811
    other = window_of(model, whole("numbers"))
    mels = mx.stack([speech_window, other, speech_window])  # a group of two, then one left over
    grouped = whisper_encoder.encode_windows(model, mels, 2)
    alone = mx.concatenate([ours, whisper_encoder.encode(model, other[None]), ours])  # (the same window: once)
    assert grouped.shape == (3, 1500, model.dims.n_audio_state)
    assert float(mx.abs(grouped - alone).max()) < 1e-3


def test_without_a_compiler_mlxs_own_ops_are_used(monkeypatch, tmp_path):
    # MLX fuses CPU kernels with g++: without it the polynomials would run op by op, slower than mx.exp.
    monkeypatch.setenv("PATH", str(tmp_path))
    cpu_math._can_fuse.cache_clear()
    try:
        assert not cpu_math.polynomials()
        q, k, v = (mx.random.normal((1, 6, n, 64)) for n in (3, 40, 40))
        expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
        assert mx.array_equal(cpu_math.attention(q, k, v, 0.125), expected)
        x = mx.random.normal((2, 100))
        assert mx.array_equal(cpu_math.gelu(x), nn.gelu(x))
        assert mx.array_equal(cpu_math.logsumexp(x), mx.logsumexp(x, axis=-1))
    finally:
        monkeypatch.undo()
        cpu_math._can_fuse.cache_clear()
    assert cpu_math.polynomials()
