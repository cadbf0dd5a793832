"""Whisper's audio encoder: mlx-audio's on a GPU; on a CPU the same layers on its weights, with the
softmax and GELU of `cpu_math` (MLX's CPU exp and erf made two thirds of a window's encoder time)."""

from __future__ import annotations

import mlx.core as mx

from workers.backends import cpu_math


def encode_windows(model, mels: mx.array, at_once: int) -> mx.array:
    """Encode windows `at_once` at a time, each group computed before the next is started.

    The attention of a group holds a 1500 x 1500 matrix per head and window: a CPU gains nothing from
    holding several (bench/NOTES.md at 521c3a7), a GPU takes a few dozen."""
    groups = []
    for start in range(0, mels.shape[0], at_once):
        groups.append(encode(model, mels[start:start + at_once]))
        mx.eval(groups[-1])
    return mx.concatenate(groups)


def encode(model, mels: mx.array) -> mx.array:
    """The encoder's output ([B, 1500, d]) for log-mel windows ([B, 3000, n_mels])."""
    mels = mels.astype(model.dtype)
    if not cpu_math.polynomials():
        return model.encoder(mels)
    encoder = model.encoder
    x = cpu_math.gelu(encoder.conv1(mels))
    x = cpu_math.gelu(encoder.conv2(x))
    x = x + encoder._positional_embedding
    for block in encoder.blocks:
        x = x + _self_attention(block.attn, block.attn_ln(x))
        x = x + block.mlp2(cpu_math.gelu(block.mlp1(block.mlp_ln(x))))
    return encoder.ln_post(x)


def _self_attention(attn, x: mx.array) -> mx.array:
    """mlx-audio's MultiHeadAttention of x on itself, through cpu_math.attention."""
    batch, length, width = x.shape
    q, k, v = (proj(x).reshape(batch, length, attn.n_head, -1).transpose(0, 2, 1, 3)
               for proj in (attn.query, attn.key, attn.value))
    out = cpu_math.attention(q, k, v, scale=(width // attn.n_head) ** -0.5)
    return attn.out(out.transpose(0, 2, 1, 3).reshape(batch, length, width))
