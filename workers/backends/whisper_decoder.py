"""Whisper's greedy decoder for a batch of windows, on mlx-audio's model weights.

mlx-audio's `model.decode` accepts a batch too, but it was built for one window at a time: its
timestamp rules walk every sequence in Python and read the tokens back to the host at every step,
and its cross-attention lays the encoder's keys and values out into heads again for every token
(on the 2-core CPU that copy cost 30 ms a step at 8 windows, more than the rest of the step). Here
the rules are array operations, the cross-attention keys and values are laid out once per batch,
the host looks at the batch only every few steps, and windows that have finished leave the batch.
The rules are OpenAI Whisper's (timestamps in pairs, never decreasing, a timestamp first, the
first no later than 1 s, a timestamp forced when timestamps are likelier than any word).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_audio.stt.models.whisper.decoding import DecodingResult, compression_ratio, get_suppress_tokens

from workers.backends import cpu_math

CHECK_EVERY = 8
"""Steps between looks at which windows have finished (each look waits for the device)."""

_MAX_INITIAL_TIMESTAMP = 50  # 1.0 s in 20 ms steps: Whisper's max_initial_timestamp


def decode_features(model, features: mx.array, tokenizer, prompt: list[int], temperature: float = 0.0
                    ) -> list[DecodingResult]:
    """Decode encoded windows (whisper_encoder's output, [B, 1500, d]) with timestamps; one result per window."""
    n_ctx = model.dims.n_text_ctx
    initial = initial_tokens(tokenizer, prompt, n_ctx)
    sot_index = initial.index(tokenizer.sot)
    step = _Stepper(model, features)
    hidden = step(mx.array([initial] * features.shape[0]))
    # Only two positions of the prompt need the vocabulary projection (with a client prompt of 200
    # tokens and 64 windows, all of them would be 2.6 GB of logits).
    no_speech = _no_speech_probs(step.logits(hidden[:, sot_index]), tokenizer)
    logits = step.logits(hidden[:, -1])
    rules = _Rules(tokenizer, logits.shape[-1])
    rows = list(range(features.shape[0]))
    state = _RowState(len(rows))
    finished: dict[int, tuple[list[int], float]] = {}
    history: list[mx.array] = []
    for n in range(min(n_ctx // 2, n_ctx - len(initial))):
        token, logprob = _choose(*rules.apply(logits, state, n), temperature)
        token = mx.where(state.done, tokenizer.eot, token)
        state.update(token, logprob, tokenizer)
        mx.async_eval(state.last, state.done, state.logprob_sum)  # the device works while the next step is built
        history.append(token)
        if (n + 1) % CHECK_EVERY == 0 and _retire(rows, state, history, step, finished, tokenizer):
            break
        logits = step.logits(step(state.last[:, None])[:, -1])  # the rows still in the batch
    else:  # out of room: what is left ends here
        _retire(rows, state, history, step, finished, tokenizer, everything=True)
    no_speech = no_speech.tolist()
    return [_result(tokens, logprob_sum, no_speech[row], temperature, tokenizer)
            for row, (tokens, logprob_sum) in sorted(finished.items())]


def initial_tokens(tokenizer, prompt: list[int], n_ctx: int) -> list[int]:
    """What the decoder is fed before the first sampled token: the prompt (its tail), then the start sequence."""
    return ([tokenizer.sot_prev] + prompt[-(n_ctx // 2 - 1):] if prompt else []) + list(tokenizer.sot_sequence)


def token_logprobs(model, features: mx.array, tokenizer, prompt: list[int], sequences: list[list[int]]
                   ) -> list[list[float]]:
    """The log-probability of each token of each window's decoded sequence, given its audio (`features`,
    [B, 1500, d]) and the tokens before it (include[]=logprobs).

    One decoder pass over each finished sequence, so both Whisper paths (mlx-audio's decoder and this one)
    report the same thing: the model's own distribution, before Whisper's suppression and timestamp rules."""
    initial = initial_tokens(tokenizer, prompt, model.dims.n_text_ctx)
    scores = []
    for row, tokens in enumerate(sequences):
        if not tokens:
            scores.append([])
            continue
        step = _Stepper(model, features[row:row + 1])
        # The hidden state at each position predicts the token after it: from the last of `initial` on.
        hidden = step(mx.array([initial + tokens]))[0, len(initial) - 1:-1]
        logits = step.logits(hidden)
        chosen = mx.take_along_axis(logits, mx.array(tokens)[:, None], axis=-1)[:, 0]
        scores.append((chosen - cpu_math.logsumexp(logits)).tolist())
    return scores


class _Stepper:
    """The decoder's forward pass with its caches: self-attention keys/values grow, cross-attention's are fixed."""

    def __init__(self, model, features: mx.array):
        decoder = model.decoder
        self.decoder, self.heads = decoder, model.dims.n_text_head
        self.scale = (model.dims.n_text_state // self.heads) ** -0.5
        # Laid out in heads and made contiguous once: a strided view would be copied again at every step.
        self.cross = [(mx.contiguous(self._split(block.cross_attn.key(features))),
                       mx.contiguous(self._split(block.cross_attn.value(features)))) for block in decoder.blocks]
        self.cache: list[tuple[mx.array, mx.array]] | None = None
        self.offset = 0

    def __call__(self, tokens: mx.array) -> mx.array:
        """The decoder's last hidden states for `tokens` ([B, T]) following what was fed before."""
        decoder, length = self.decoder, tokens.shape[1]
        x = decoder.token_embedding(tokens) + decoder.positional_embedding[self.offset:self.offset + length]
        cache = []
        for i, block in enumerate(decoder.blocks):
            h = block.attn_ln(x)
            q, k, v = (self._split(proj(h)) for proj in (block.attn.query, block.attn.key, block.attn.value))
            if self.cache is not None:
                k = mx.concatenate([self.cache[i][0], k], axis=2)
                v = mx.concatenate([self.cache[i][1], v], axis=2)
            cache.append((k, v))
            if length > 1:  # the prompt, causally
                y = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal")
            else:
                y = cpu_math.attention(q, k, v, self.scale)
            x = x + block.attn.out(self._merge(y))
            q = self._split(block.cross_attn.query(block.cross_attn_ln(x)))
            x = x + block.cross_attn.out(self._merge(cpu_math.attention(q, *self.cross[i], self.scale)))
            x = x + block.mlp2(cpu_math.gelu(block.mlp1(block.mlp_ln(x))))
        self.cache, self.offset = cache, self.offset + length
        return decoder.ln(x)

    def logits(self, hidden: mx.array) -> mx.array:
        """Float32 logits over the vocabulary for hidden states ([B, d])."""
        return self.decoder.token_embedding.as_linear(hidden).astype(mx.float32)

    def keep(self, index: mx.array) -> None:
        """Keep only the rows at `index` (windows that have not finished)."""
        self.cache = [(k[index], v[index]) for k, v in self.cache]
        self.cross = [(k[index], v[index]) for k, v in self.cross]

    def _split(self, x: mx.array) -> mx.array:
        batch, length, _ = x.shape
        return x.reshape(batch, length, self.heads, -1).transpose(0, 2, 1, 3)

    @staticmethod
    def _merge(x: mx.array) -> mx.array:
        batch, heads, length, dim = x.shape
        return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * dim)


class _RowState:
    """Per window: the last two tokens, the last timestamp, whether it has ended, its log-probability sum."""

    def __init__(self, rows: int):
        self.last = mx.full((rows,), -1, dtype=mx.int32)
        self.penultimate = mx.full((rows,), -1, dtype=mx.int32)
        self.last_timestamp = mx.full((rows,), -1, dtype=mx.int32)
        self.done = mx.zeros((rows,), dtype=mx.bool_)
        self.logprob_sum = mx.zeros((rows,), dtype=mx.float32)

    def update(self, token: mx.array, logprob: mx.array, tokenizer) -> None:
        """Take in the tokens just chosen."""
        self.logprob_sum = self.logprob_sum + mx.where(self.done, 0.0, logprob)
        self.penultimate, self.last = self.last, token
        self.last_timestamp = mx.where(token >= tokenizer.timestamp_begin, token, self.last_timestamp)
        self.done = self.done | (token == tokenizer.eot)

    def keep(self, index: mx.array) -> None:
        """Keep only the rows at `index`."""
        for name in ("last", "penultimate", "last_timestamp", "done", "logprob_sum"):
            setattr(self, name, getattr(self, name)[index])


class _Rules:
    """Whisper's logit filters (suppressed tokens, a blank start, timestamp rules) as array operations."""

    def __init__(self, tokenizer, vocab: int):
        self.begin, self.eot = tokenizer.timestamp_begin, tokenizer.eot
        ids = mx.arange(vocab)
        self.is_timestamp, self.is_text = ids >= self.begin, ids < self.eot
        self.ids = ids
        suppressed = np.zeros(vocab, dtype=bool)
        suppressed[list(get_suppress_tokens(tokenizer, "-1"))] = True
        if tokenizer.no_timestamps is not None:
            suppressed[tokenizer.no_timestamps] = True
        first = suppressed.copy()
        first[: self.begin] = True  # a window starts with a timestamp...
        first[self.begin + _MAX_INITIAL_TIMESTAMP + 1:] = True  # ...within its first second
        self.suppressed, self.first = mx.array(suppressed), mx.array(first)

    def apply(self, logits: mx.array, state: _RowState, sampled: int) -> tuple[mx.array, mx.array]:
        """Logits with forbidden tokens at -inf for each window after `sampled` tokens, and their logsumexp."""
        if sampled == 0:
            logits = mx.where(self.first, -mx.inf, logits)
            return logits, cpu_math.logsumexp(logits)
        last_ts = state.last >= self.begin
        penultimate_ts = (state.penultimate >= self.begin) if sampled >= 2 else mx.ones_like(last_ts)
        # After a pair (or at the start) text must follow; after a lone timestamp, a timestamp or the end.
        forbid = (last_ts & penultimate_ts)[:, None] & self.is_timestamp
        forbid = forbid | (last_ts & ~penultimate_ts)[:, None] & self.is_text
        # Timestamps never go back, and a segment is never empty.
        floor = mx.where(last_ts & ~penultimate_ts, state.last_timestamp, state.last_timestamp + 1)
        floor = mx.where(state.last_timestamp >= 0, floor, self.begin)
        forbid = forbid | (self.is_timestamp & (self.ids[None] < floor[:, None]))
        logits = mx.where(forbid | self.suppressed, -mx.inf, logits)
        # When the timestamps together are likelier than any single word, a timestamp comes next. (Compared
        # as logits: both sides share the normaliser, whose exp over the whole vocabulary costs the most.)
        timestamp = cpu_math.logsumexp(logits[:, self.begin:])
        forced = timestamp > mx.max(logits[:, :self.begin], axis=-1)
        normaliser = mx.where(forced, timestamp, cpu_math.logsumexp(logits))
        return mx.where(forced[:, None] & ~self.is_timestamp, -mx.inf, logits), normaliser


def _choose(logits: mx.array, normaliser: mx.array, temperature: float) -> tuple[mx.array, mx.array]:
    """The next token of each window (greedy, or sampled when hot) and its log-probability."""
    if temperature > 0:
        token = mx.random.categorical(logits / temperature)
    else:
        token = mx.argmax(logits, axis=-1)
    token = token.astype(mx.int32)
    return token, mx.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - normaliser


def _retire(rows: list[int], state: _RowState, history: list[mx.array], step: _Stepper,
            finished: dict, tokenizer, everything: bool = False) -> bool:
    """Move windows that have ended (all of them with `everything`) out of the batch; True when none is left."""
    done = np.ones(len(rows), dtype=bool) if everything else np.array(state.done)
    if not done.any():
        return False
    tokens = np.array(mx.stack(history, axis=1)) if history else np.zeros((len(rows), 0), dtype=np.int32)
    sums = np.array(state.logprob_sum)
    for index in np.flatnonzero(done):
        sequence = tokens[index].tolist()
        if tokenizer.eot in sequence:
            sequence = sequence[:sequence.index(tokenizer.eot)]
        finished[rows[index]] = (sequence, float(sums[index]))
    keep = np.flatnonzero(~done)
    if len(keep) == 0:
        return True
    index = mx.array(keep)
    rows[:] = [rows[i] for i in keep]
    history[:] = [token[index] for token in history]
    state.keep(index)
    step.keep(index)
    return False


def _no_speech_probs(logits: mx.array, tokenizer) -> mx.array:
    """Probability of Whisper's no-speech token at the start-of-transcript position."""
    if tokenizer.no_speech is None:
        return mx.full((logits.shape[0],), float("nan"))
    return mx.softmax(logits, axis=-1)[:, tokenizer.no_speech]


def _result(tokens: list[int], logprob_sum: float, no_speech: float, temperature: float, tokenizer
            ) -> DecodingResult:
    """One window's outcome, in mlx-audio's shape (what segments.split_segments reads)."""
    text = tokenizer.decode(tokens).strip()
    return DecodingResult(audio_features=None, language=tokenizer.language, tokens=tokens, text=text,
                          avg_logprob=logprob_sum / (len(tokens) + 1), no_speech_prob=no_speech,
                          temperature=temperature, compression_ratio=compression_ratio(text))
