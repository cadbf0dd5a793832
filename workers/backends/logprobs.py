"""Log-probabilities of the generated tokens (OpenAI's `logprobs` / `top_logprobs`), one entry per token.

An entry is OpenAI's chat shape: {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}; web/render/openai.py turns lists of them into completions' older shape. Log-probabilities
are those the token was sampled from (after a repetition penalty or a response_format's mask).
"""

from __future__ import annotations

import mlx.core as mx

FLOOR = -9999.0
"""What a token the sampler could not pick (probability 0: -inf, not JSON) reports, as OpenAI does."""


def entry(tokenizer, token: int, logprobs, top: int) -> dict:
    """The entry of `token`, sampled from the `logprobs` vector, with the `top` most likely alternatives."""
    vector = mx.array(logprobs).reshape(-1)
    alternatives = []
    if top:
        ids = mx.argpartition(-vector, kth=top - 1)[:top]
        pairs = sorted(zip(ids.tolist(), vector[ids].tolist(), strict=True), key=lambda pair: -pair[1])
        alternatives = [token_entry(tokenizer, i, value) for i, value in pairs]
    return {**token_entry(tokenizer, token, vector[token].item()), "top_logprobs": alternatives}


def token_entry(tokenizer, token: int, logprob: float) -> dict:
    """{"token", "logprob", "bytes"} for one token (a piece of a multi-byte character decodes to U+FFFD)."""
    text = tokenizer.decode([token])
    return {"token": text, "logprob": max(FLOOR, float(logprob)), "bytes": list(text.encode("utf-8"))}
