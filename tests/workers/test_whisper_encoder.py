"""The CPU encoder (exp and erf as fused polynomials) against mlx-audio's own, on real Whisper tiny.en."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tests.workers.test_speech import model, ref, worker_parts  # noqa: F401  (fixtures)
from tests.workers.test_speech_batched import samples_of
from workers.backends import whisper, whisper_encoder

pytestmark = pytest.mark.skipif(not whisper.on_cpu(), reason="the polynomial path runs on a CPU only")


def test_exp_and_gelu_stay_close_to_the_exact_functions():
    scores = mx.array(np.linspace(-120, 0, 100_001, dtype=np.float32))
    got = np.array(whisper_encoder._exp_below_max(scores, mx.array(0.0)), dtype=np.float64)
    exact = np.exp(np.array(scores, dtype=np.float64))
    assert np.all(np.abs(got - exact) <= 1e-4 * exact + 1e-30)
    x = mx.array(np.linspace(-10, 10, 100_001, dtype=np.float32))
    exact_gelu = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in np.array(x, dtype=np.float64)])
    assert np.abs(np.array(whisper_encoder._gelu(x)) - exact_gelu).max() < 1e-5
    assert np.abs(np.array(whisper_encoder._gelu(x)) - np.array(nn.gelu(x))).max() < 1e-5


@pytest.mark.parametrize("name", ["garden", "numbers"])
def test_it_gives_mlx_audios_features_and_transcript(model, name):  # noqa: F811
    mel = whisper.window_mel(model, samples_of(name))[None]
    ours, theirs = whisper_encoder.encode(model, mel), model.encoder(mel)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    difference = float(mx.abs(ours - theirs).max())
    assert difference < 0.01 * float(mx.abs(theirs).max()), difference
    # Same tokens through mlx-audio's decoder from either encoder's output.
    options = whisper.DecodingOptions(language="en", temperature=0.0, fp16=False)
    assert model.decode(ours[0], options).tokens == model.decode(theirs[0], options).tokens


def test_windows_encoded_in_groups_equal_each_alone(model):  # noqa: F811
    mels = mx.stack([whisper.window_mel(model, samples_of(name)) for name in ("garden", "numbers", "garden")])
    grouped = whisper_encoder.encode_windows(model, mels, 2)
    alone = mx.concatenate([whisper_encoder.encode(model, mels[i:i + 1]) for i in range(3)])
    assert grouped.shape == (3, 1500, model.dims.n_audio_state)
    assert float(mx.abs(grouped - alone).max()) < 1e-3
