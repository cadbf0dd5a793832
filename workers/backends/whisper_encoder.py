"""Whisper's audio encoder, with the CPU's exp and erf made cheap.

MLX's CPU backend computes exp and erf one element at a time with no vector instructions on x86:
one layer's attention weights of tiny.en (6 heads x 1500 x 1500) took 270 ms to exponentiate on
the project's 2-core machine, numpy 8-14 ms. A 30 s window spent about two thirds of its encoder time
there. Here, on a CPU, the same layers run on mlx-audio's weights with exp and erf written as
polynomials that `mx.compile` fuses into one loop each (52-62 ms and 13 ms against 270 and 89 ms,
bench/NOTES.md). On a GPU the model's own encoder runs: its exp is fast there.
"""

from __future__ import annotations

import math

import mlx.core as mx

_EXP_SQUARINGS = 10
"""exp(x) = exp(x / 2^10)^(2^10): the polynomial only has to be right on [-0.09, 0]."""

_EXP_TERMS = [1 / math.factorial(i) for i in range(4, -1, -1)]  # Taylor, highest power first

# Odd numerator and even denominator of a rational approximation of erf on [-4, 4] (Eigen's and XLA's
# float erf; beyond 4, erf is +-1 in float32), highest power first.
_ERF_NUM = [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02]
_ERF_DEN = [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02]


def encode_windows(model, mels: mx.array, at_once: int) -> mx.array:
    """Encode windows `at_once` at a time, each group computed before the next is started.

    The attention of a group holds a 1500 x 1500 matrix per head and window: a CPU gains nothing from
    holding several (bench/NOTES.md), a GPU takes a few dozen."""
    groups = []
    for start in range(0, mels.shape[0], at_once):
        groups.append(encode(model, mels[start:start + at_once]))
        mx.eval(groups[-1])
    return mx.concatenate(groups)


def encode(model, mels: mx.array) -> mx.array:
    """The encoder's output ([B, 1500, d]) for log-mel windows ([B, 3000, n_mels])."""
    mels = mels.astype(model.dtype)
    if mx.default_device().type != mx.DeviceType.cpu:
        return model.encoder(mels)
    encoder = model.encoder
    x = _gelu(encoder.conv1(mels))
    x = _gelu(encoder.conv2(x))
    x = x + encoder._positional_embedding
    for block in encoder.blocks:
        x = x + _self_attention(block.attn, block.attn_ln(x))
        x = x + block.mlp2(_gelu(block.mlp1(block.mlp_ln(x))))
    return encoder.ln_post(x)


def _self_attention(attn, x: mx.array) -> mx.array:
    """mlx-audio's MultiHeadAttention on x alone, with the softmax through `_exp_below_max`."""
    batch, length, width = x.shape
    scale = (width // attn.n_head) ** -0.25
    q = attn.query(x).reshape(batch, length, attn.n_head, -1).transpose(0, 2, 1, 3) * scale
    k = attn.key(x).reshape(batch, length, attn.n_head, -1).transpose(0, 2, 3, 1) * scale
    v = attn.value(x).reshape(batch, length, attn.n_head, -1).transpose(0, 2, 1, 3)
    scores = q @ k
    weights = _exp_below_max(scores, scores.max(axis=-1, keepdims=True))
    # Normalising the [.., length, 64] output rather than the [.., length, length] weights saves a pass.
    out = (weights @ v) / weights.sum(axis=-1, keepdims=True)
    return attn.out(out.transpose(0, 2, 1, 3).reshape(batch, length, width))


@mx.compile
def _exp_below_max(scores: mx.array, top: mx.array) -> mx.array:
    """exp(scores - top) for scores <= top, within 1e-4 relative (float32 rounding, squared 10 times)."""
    y = mx.maximum(scores - top, -88.0) * (1.0 / 2**_EXP_SQUARINGS)
    p = _EXP_TERMS[0]
    for term in _EXP_TERMS[1:]:
        p = p * y + term
    for _ in range(_EXP_SQUARINGS):
        p = p * p
    return p


@mx.compile
def _gelu(x: mx.array) -> mx.array:
    """GELU with erf as a rational function (within 1e-6 of nn.gelu)."""
    z = mx.clip(x * (1 / math.sqrt(2)), -4.0, 4.0)
    z2 = z * z
    num = _ERF_NUM[0]
    for c in _ERF_NUM[1:]:
        num = num * z2 + c
    den = _ERF_DEN[0]
    for c in _ERF_DEN[1:]:
        den = den * z2 + c
    return 0.5 * x * (1 + z * num / den)
