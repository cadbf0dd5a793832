"""exp, softmax attention, logsumexp and GELU that are fast on a CPU too.

MLX's CPU backend computes exp and erf one element at a time with no vector instructions on x86:
6 x 1500 x 1500 float32 (one layer's attention weights in Whisper tiny's encoder) took 270 ms to
exponentiate on the project's 2-core machine, where numpy takes 8-14 ms; a `mx.compile`d `mx.exp`
is no faster. Written as polynomials of multiplies and adds, which `mx.compile` fuses into one
loop, they take 52-62 ms (exp) and 13 ms (GELU on 1500 x 1536, against 89 ms): bench/NOTES.md at 521c3a7.
On a GPU each function here is MLX's own op, which is fast there, and so it is on a CPU where MLX cannot
fuse: it builds its CPU kernels with g++ at run time, and without one the polynomials run op by op,
slower than MLX's exp (390-430 ms against 270).
"""

from __future__ import annotations

import functools
import logging
import math
import shutil

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

_EXP_SQUARINGS = 10
"""exp(x) = exp(x / 2^10)^(2^10): the polynomial only has to be right on [-0.09, 0]."""

_EXP_TERMS = [1 / math.factorial(i) for i in range(4, -1, -1)]  # Taylor, highest power first

# Odd numerator and even denominator of a rational approximation of erf on [-4, 4] (Eigen's and XLA's
# float erf; beyond 4, erf is +-1 in float32), highest power first.
_ERF_NUM = [-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
            -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02]
_ERF_DEN = [-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02]


def on_cpu() -> bool:
    """Whether MLX computes on the CPU here (no Metal or CUDA device by default)."""
    return mx.default_device().type == mx.DeviceType.cpu


def polynomials() -> bool:
    """Whether the polynomials pay here: on a CPU, with the compiler MLX fuses CPU kernels with."""
    return on_cpu() and _can_fuse()


@functools.cache
def _can_fuse() -> bool:
    """Whether MLX can build fused CPU kernels (it runs g++, which a slim container may lack)."""
    if shutil.which("g++"):
        return True
    log.warning("no g++ on PATH: MLX cannot fuse CPU kernels, so Whisper uses MLX's own (slower) exp and erf")
    return False


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, bias: mx.array | None = None) -> mx.array:
    """softmax(q k^T * scale + bias) v for heads laid out [B, heads, length, dim] (`bias`: an additive mask that
    broadcasts to the scores, or None)."""
    if not polynomials():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=bias)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    if bias is not None:
        scores = scores + bias
    weights = exp_below_max(scores, scores.max(axis=-1, keepdims=True))
    # Normalising the [.., length, dim] output rather than the [.., length, keys] weights saves a pass.
    return (weights @ v) / weights.sum(axis=-1, keepdims=True)


def logsumexp(x: mx.array) -> mx.array:
    """log(sum(exp(x))) over the last axis."""
    if not polynomials():
        return mx.logsumexp(x, axis=-1)
    top = x.max(axis=-1, keepdims=True)
    empty = top == -mx.inf  # a row with nothing allowed in it
    top = mx.where(empty, 0.0, top)
    return mx.where(empty[..., 0], -mx.inf, top[..., 0] + mx.log(exp_below_max(x, top).sum(axis=-1)))


def gelu(x: mx.array) -> mx.array:
    """GELU (the exact one, with erf)."""
    return _gelu_polynomial(x) if polynomials() else nn.gelu(x)


@mx.compile
def exp_below_max(x: mx.array, top: mx.array) -> mx.array:
    """exp(x - top) for x <= top (-inf included), within 1e-4 relative (float32 rounding, squared 10 times) down to
    -87, exp(-87) below (~1.6e-38, the least normal float32's neighbour: nothing a sum of such terms notices)."""
    # Clamped at -87, not lower: exp(-88) is a subnormal float32, and x86 computes those ~100 times slower. A
    # sampled row under top_p is -inf but for ~a thousand tokens: at -88 its draw took 29 ms for 8 rows of 49k
    # on a 2-core CPU instead of 1.3, and every step of such requests paid it.
    y = mx.maximum(x - top, -87.0) * (1.0 / 2**_EXP_SQUARINGS)
    p = _EXP_TERMS[0]
    for term in _EXP_TERMS[1:]:
        p = p * y + term
    for _ in range(_EXP_SQUARINGS):
        p = p * p
    return p


@mx.compile
def _gelu_polynomial(x: mx.array) -> mx.array:
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
