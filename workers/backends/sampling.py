"""Sampling for sequences that decode together: one computation for the whole batch, whatever each asks.

Each sequence (a row) has its own temperature, top_p, top_k, min_p, penalties, logit bias, grammar
and random stream. mlx-lm's BatchGenerator shares one sampler call only when every row has the same
sampler object; with one per request it samples row by row (a filter chain, a key split and a
draw per sequence per step), which halved the engine at 64 sequences on the H100. Here the rows'
settings are arrays and a step is one computation: the logit bias, repetition, presence and
frequency penalties, the grammars' masks, then one draw for every row.

The draw inverts each row's cumulative distribution at a counter-based uniform: a row's n-th draw
uses a hash of (its seed, n). A seeded request draws the same tokens alone or in any batch, with no
random state to split, carry or hand over; a greedy row (temperature 0) takes its argmax in the same
computation. (One uniform per row, not Gumbel noise per token: on this 2-core CPU the noise for 8
rows of a 49k vocabulary cost more than a third of a decode step.) Filters (top_p, top_k, min_p)
keep the tokens at or above a per-row threshold, found by sorting only the rows that have filters,
once per step.

On a CPU the draw runs in numpy on the host (`host_draw`), with the same definitions and uniforms: MLX's CPU
kernels for its top-k, sort, cumulative sum and reductions are slow there (8 rows of a 49k vocabulary under
top_p: 7.7 ms a step in MLX, 1.2 ms in numpy, on the project's 2-core machine).

Definitions follow mlx-lm where it has them (filters act on the untempered distribution, as its
`make_sampler` does; the repetition penalty looks at the last REPETITION_CONTEXT tokens, prompt
included) and OpenAI's for presence and frequency penalties (counted over the answer so far).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from jobs.contract import Sampling
from workers.backends import cpu_math

CANDIDATES = 1024
"""The most likely tokens a row's top_p and min_p choose among: only they are sorted (sorting 8 rows of a
49k vocabulary took a third of a decode step on this 2-core CPU; the top 1024, a tenth of that). A
nucleus wider than that is cut there; a top_k above it sorts that many."""

REPETITION_CONTEXT = 20
"""Tokens the repetition penalty looks back over (mlx-lm's default context)."""


@dataclass
class Row:
    """One sequence's decoding settings."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top_k
    min_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: object = None  # its GrammarProcessor (workers/backends/grammar.py), if it has a response_format

    @property
    def filtered(self) -> bool:
        """Whether it samples from fewer than all tokens (top_p, top_k or min_p)."""
        return self.temperature > 0 and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0)

    @property
    def penalized(self) -> bool:
        """Whether it has a presence or frequency penalty (needs counts of its answer's tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty)


def row_for(sampling: Sampling, vocab_size: int, seed_offset: int = 0, grammar=None) -> Row:
    """A row's settings from a request's: `seed_offset` gives the choices of one request (`n` > 1)
    distinct streams from one seed; an unseeded request gets a random seed."""
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little")
    top_k = sampling.top_k if 0 < sampling.top_k < vocab_size else 0  # the whole vocabulary: no filter
    return Row(temperature=sampling.temperature, top_p=sampling.top_p, top_k=top_k, min_p=sampling.min_p,
               seed=(seed + seed_offset) % 2**64, repetition_penalty=sampling.repetition_penalty or 1.0,
               presence_penalty=sampling.presence_penalty, frequency_penalty=sampling.frequency_penalty,
               logit_bias=tuple(sampling.logit_bias), grammar=grammar)


class BatchSampler:
    """The sampling state of a batch's rows, in the batch's row order: settings as arrays, the counts
    and recent tokens the penalties need, kept on the device and carried as rows join and leave."""

    def __init__(self, vocab_size: int, host: bool | None = None):
        self.vocab = vocab_size
        # Whether sampled rows draw on the host (numpy): by default on a CPU, where MLX's own kernels are slower.
        self.host = cpu_math.on_cpu() if host is None else host
        self.rows: list[Row] = []
        self.drawn: list[int] = []  # draws each row has made: the counter of its uniforms
        self.counts: mx.array | None = None  # (B, V) occurrences in each row's answer, when a row has penalties
        self.recent: mx.array | None = None  # (B, REPETITION_CONTEXT) last tokens, when a row has a repetition penalty
        self.bias: mx.array | None = None  # (B, V) logit bias, when a row has one
        self._settings: dict = {}

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def reads_inputs(self) -> bool:
        """Whether `process` reads the step's input tokens back on the host (a row's grammar needs them)."""
        return any(r.grammar is not None for r in self.rows)

    def extend(self, rows: list[Row], contexts: list[list[int]], drawn: int = 0) -> None:
        """Add rows; `contexts` are the tokens each has seen (for the repetition penalty's window), `drawn`
        the draws each has made elsewhere (a first token drawn from its prompt's pass)."""
        old = len(self.rows)
        self.rows += rows
        self.drawn += [drawn] * len(rows)
        if any(r.penalized for r in self.rows):
            self.counts = _joined(self.counts, old, mx.zeros((len(rows), self.vocab), mx.float32))
        if any(r.repetition_penalty != 1.0 for r in self.rows):
            self.recent = _joined(self.recent, old, mx.array([_window(c) for c in contexts], mx.int32))
        if any(r.logit_bias for r in self.rows):
            self.bias = _joined(self.bias, old, mx.stack([_bias_row(r.logit_bias, self.vocab) for r in rows]))
        self._settings = {}

    def keep(self, indices: list[int]) -> None:
        """Keep only these rows, in this order (the others left the batch)."""
        self.rows = [self.rows[i] for i in indices]
        self.drawn = [self.drawn[i] for i in indices]
        index = mx.array(indices, mx.int32)
        self.counts = self.counts[index] if self.counts is not None and indices else None
        self.recent = self.recent[index] if self.recent is not None and indices else None
        self.bias = self.bias[index] if self.bias is not None and indices else None
        if not any(r.penalized for r in self.rows):
            self.counts = None
        if not any(r.repetition_penalty != 1.0 for r in self.rows):
            self.recent = None
        if not any(r.logit_bias for r in self.rows):
            self.bias = None
        self._settings = {}

    def _arrays(self) -> dict:
        """The rows' settings as device arrays (made again only when rows join or leave)."""
        if not self._settings:
            rows = self.rows
            sampled = [r.temperature > 0 for r in rows]
            seeds = np.array([r.seed for r in rows], np.uint64)
            inverse = np.array([1 / r.temperature if r.temperature > 0 else 1.0 for r in rows], np.float32)
            self._settings = {
                "sampled": mx.array(sampled, mx.float32),
                "inverse": mx.array(inverse),
                "inverse_host": inverse,
                "seed_lo": (seeds & 0xFFFFFFFF).astype(np.uint32),  # on the host: `uniforms`
                "seed_hi": (seeds >> 32).astype(np.uint32),
                "repetition": mx.array([r.repetition_penalty for r in rows], mx.float32),
                "presence": mx.array([r.presence_penalty for r in rows], mx.float32),
                "frequency": mx.array([r.frequency_penalty for r in rows], mx.float32),
                "floor": mx.full((len(rows),), -mx.inf, mx.float32),  # no filters: every token
                "rows": mx.arange(len(rows)),
                "any_sampled": any(sampled),
            }
            # Filtered rows in groups of one candidate count each (CANDIDATES, or a wider top_k): a row's filters
            # look at as many candidates alone as in any batch (a neighbour's wider top_k cut its nucleus elsewhere).
            widths: dict[int, list[int]] = {}
            for i, r in enumerate(rows):
                if r.filtered:
                    widths.setdefault(min(self.vocab, max(CANDIDATES, r.top_k)), []).append(i)
            self._settings["filtered"] = []
            for width, members in sorted(widths.items()):
                top_p = np.array([rows[i].top_p for i in members], np.float32)
                top_k = np.array([rows[i].top_k or self.vocab for i in members], np.int32)
                min_p = np.array([rows[i].min_p for i in members], np.float32)
                self._settings["filtered"].append({
                    "rows": mx.array(members, mx.int32), "width": width, "top_p": mx.array(top_p),
                    "top_k": mx.array(top_k), "min_p": mx.array(min_p),
                    "members": np.array(members, np.intp), "filters_host": (top_p, top_k, min_p)})
            # Sampled rows without filters: they draw over the whole vocabulary (host_draw's second kind).
            self._settings["unfiltered"] = np.array([i for i, r in enumerate(rows) if r.temperature > 0
                                                     and not r.filtered], np.intp)
        return self._settings

    def process(self, logits: mx.array, inputs: mx.array, generated: list[bool]) -> mx.array:
        """The logits after each row's bias, penalties and grammar. `inputs` are the tokens fed at this
        step, `generated[i]` whether row i's is part of its answer (not its prompt's last token)."""
        settings = self._arrays()
        if self.bias is not None:
            logits = logits + self.bias.astype(logits.dtype)
        if self.recent is not None:
            self.recent = mx.concatenate([self.recent[:, 1:], inputs[:, None].astype(mx.int32)], axis=1)
            logits = repetition(logits, self.recent, settings["repetition"])
        if self.counts is not None:
            self.counts = self.counts.at[settings["rows"], inputs.astype(mx.int32)].add(mx.array(generated, mx.float32))
            logits = penalties(logits, self.counts, settings["presence"], settings["frequency"])
        grammars = [(i, r.grammar) for i, r in enumerate(self.rows) if r.grammar is not None]
        if grammars:
            tokens = inputs.tolist()
            # A mask of None allows every token (a thinking gate between its forced tokens).
            masks = [(i, g.mask_words(tokens[i] if generated[i] else None)) for i, g in grammars]
            masks = [(i, words) for i, words in masks if words is not None]
            if masks:
                logits = masked(logits, [i for i, _ in masks], np.stack([words for _, words in masks]))
        return logits

    def sample(self, logprobs: mx.array) -> mx.array:
        """One token per row, drawn from its (processed, normalized) log-probabilities."""
        settings = self._arrays()
        drawn = np.array(self.drawn, np.uint32)
        self.drawn = [n + 1 for n in self.drawn]
        if not settings["any_sampled"]:  # greedy only: nothing to draw
            return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
        uniform = uniforms(settings["seed_lo"], settings["seed_hi"], drawn)
        if self.host:
            return mx.array(host_draw(np.array(logprobs.astype(mx.float32)), settings, uniform))
        floor = settings["floor"]
        for group in settings["filtered"]:
            rows = group["rows"]
            kept = thresholds(logprobs[rows], group["top_p"], group["top_k"], group["min_p"], group["width"])
            floor = _put(floor, rows, kept)
        return draw(logprobs, settings["inverse"], settings["sampled"], mx.array(uniform), floor)


def _joined(current: mx.array | None, old: int, fresh: mx.array) -> mx.array:
    """The `old` rows' state, then the `fresh` rows'; zeros for the old rows when none of them had any
    (a row without the setting is not changed by zeros)."""
    if current is None:
        current = mx.zeros((old, *fresh.shape[1:]), fresh.dtype)
    return mx.concatenate([current, fresh])


def _put(array: mx.array, rows: mx.array, values: mx.array) -> mx.array:
    """`array` with `values` at `rows` (a new array: the one given may be a setting kept across steps)."""
    out = mx.array(array)
    out[rows] = values
    return out


def _window(tokens: list[int]) -> list[int]:
    """The last REPETITION_CONTEXT tokens, padded at the front with the first of them (a token
    repeated in the window is penalized once, as in mlx-lm)."""
    tail = list(tokens[-REPETITION_CONTEXT:]) or [0]
    return [tail[0]] * (REPETITION_CONTEXT - len(tail)) + tail


def _bias_row(bias: tuple[tuple[int, float], ...], vocab: int) -> mx.array:
    """A dense (V,) bias row."""
    row = np.zeros(vocab, np.float32)
    for token, value in bias:
        row[token] += value
    return mx.array(row)


def _gpu_compiled(fn):
    """`fn` compiled by MLX on a GPU, where fusing the step's elementwise work into a few kernels pays
    (uncompiled Gumbel noise took 0.7 ms of a 6 ms step at 64 rows on the H100; compiled, 0.2); as it is
    on a CPU, where MLX's compiled code ran it slower (35 vs 49 ms for the same noise, 8 rows).

    Compiled once for every batch size (`shapeless`): rows come and go, and on CUDA each new shape of a
    shaped compile was traced and its kernels built again, one decode step taking 3-6 s on the H100 at a
    batch size not met before (the worker's slow-step log, 2026-11-27). `run.traces` counts the traces."""

    def traced(*args):
        run.traces += 1
        return fn(*args)

    compiled = mx.compile(traced, shapeless=True)

    def run(*args):
        return (compiled if mx.default_device() == mx.gpu else fn)(*args)

    run.__doc__, run.traces, run.compiled, run.plain = fn.__doc__, 0, compiled, fn
    return run


@_gpu_compiled
def repetition(logits: mx.array, recent: mx.array, penalty: mx.array) -> mx.array:
    """mlx-lm's repetition penalty for every row: the logits of its recent tokens divided by its penalty
    when positive, multiplied when negative (a penalty of 1 changes nothing)."""
    selected = mx.take_along_axis(logits, recent, axis=-1)
    scale = penalty[:, None].astype(logits.dtype)
    selected = mx.where(selected < 0, selected * scale, selected / scale)
    return mx.put_along_axis(logits, recent, selected, axis=-1)


@_gpu_compiled
def penalties(logits: mx.array, counts: mx.array, presence: mx.array, frequency: mx.array) -> mx.array:
    """OpenAI's presence and frequency penalties: minus presence once for a token in the answer, minus
    frequency per occurrence."""
    return logits - (presence[:, None] * (counts > 0) + frequency[:, None] * counts).astype(logits.dtype)


_BITS = mx.array(np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)))  # bit i of a word: token 32 * word + i


@_gpu_compiled
def allowed_only(logits: mx.array, words: mx.array, bits: mx.array) -> mx.array:
    """(B, W, 32) logits, -inf where the (B, W, 1) packed words' bit is 0 (`bits`: _BITS): one fused kernel on a GPU,
    where unpacking the words op by op took five, each a launch in a host-bound step (bench/device/sampler_probe.py
    --grammar-parts put applying a mask at ~0.2 ms of a 2.9 ms step, H200 2026-11-28)."""
    return mx.where((words & bits) != 0, logits, -mx.inf)


def masked(logits: mx.array, rows: list[int], words: np.ndarray) -> mx.array:
    """Disallow, in the given rows, the tokens whose bit is 0 in their packed masks (32 tokens a word)."""
    width = logits.shape[-1]
    packed = mx.array(words.view(np.uint32))
    if len(rows) == logits.shape[0] and width == 32 * packed.shape[-1]:  # every row, a vocabulary of whole words
        out = allowed_only(logits.reshape(len(rows), -1, 32), packed[:, :, None], _BITS)
        return out.reshape(logits.shape)
    allowed = ((packed[:, :, None] & _BITS) != 0).reshape(len(rows), -1)[:, :width]
    if allowed.shape[-1] < width:  # an output wider than the tokenizer's vocabulary: those tokens never
        allowed = mx.concatenate([allowed, mx.zeros((len(rows), width - allowed.shape[-1]), mx.bool_)], axis=1)
    if len(rows) == logits.shape[0]:  # every row has a mask (rows in order): no gather, copy and scatter
        return mx.where(allowed, logits, -mx.inf)
    index = mx.array(rows, mx.int32)
    logits = mx.array(logits)
    logits[index] = mx.where(allowed, logits[index], -mx.inf)
    return logits


def thresholds(logprobs: mx.array, top_p: mx.array, top_k: mx.array, min_p: mx.array, candidates: int) -> mx.array:
    """Per row, the lowest log-probability its filters keep: the top_k most likely, the fewest most
    likely that make up top_p of the probability, those at least min_p times the likeliest; at least
    one, and at most the `candidates` most likely (only they are sorted)."""
    ordered = logprobs.astype(mx.float32)
    if candidates < ordered.shape[-1]:  # (outside the compiled part: top-k's slice is traced for one shape only)
        ordered = mx.topk(ordered, candidates, axis=-1)
    return cut_points(ordered, top_p, top_k, min_p)


# The filters' arithmetic once the candidates are picked, compiled on a GPU, where a decode step is host-bound:
# uncompiled, a batch with filtered rows launched ~25 small kernels for it at every step.
@_gpu_compiled
def cut_points(candidates: mx.array, top_p: mx.array, top_k: mx.array, min_p: mx.array) -> mx.array:
    """`thresholds` over each row's candidates (in any order)."""
    ordered = -mx.sort(-candidates, axis=-1)
    probs = mx.exp(ordered)
    rank = mx.cumsum(mx.ones_like(probs), axis=-1)  # 1, 2, ... (an arange's length would be traced once)
    before = mx.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
    keep_p = mx.sum(before < top_p[:, None], axis=-1)
    keep_min = mx.sum(ordered >= mx.max(ordered, axis=-1, keepdims=True) + mx.log(mx.maximum(min_p[:, None], 1e-30)),
                      axis=-1)
    keep = mx.maximum(mx.minimum(mx.minimum(keep_p, keep_min), top_k), 1)
    # The keep-th likeliest, as the least of the kept (a gather by a computed index crashed MLX's shapeless compile).
    return mx.min(mx.where(rank <= keep[:, None], ordered, mx.inf), axis=-1)


def _mix(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash with good avalanche (Wellons' lowbias32), on uint32 arrays (products wrap)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def uniforms(seed_lo: np.ndarray, seed_hi: np.ndarray, drawn: np.ndarray) -> np.ndarray:
    """(B,) float32 uniforms in (0, 1): row r's is a function of its seed and draw count only.

    Made on the host, a few microseconds for a batch: on a GPU the same hashes were ~8 kernels a step,
    each a launch in a host-bound step (bench/device/sampler_probe.py)."""
    bits = _mix(_mix(seed_lo ^ _mix(seed_hi + np.uint32(0x9E3779B9))) ^ _mix(drawn))
    return np.clip(bits.astype(np.float32) * np.float32(2.0**-32), np.float32(2.0**-25), np.float32(1 - 2.0**-24))


# Shapes change as rows come and go: on a GPU each new batch size is traced once.
@_gpu_compiled
def draw(logprobs: mx.array, inverse: mx.array, sampled: mx.array, uniform: mx.array, floor: mx.array) -> mx.array:
    """One token per row: drawn from softmax(logprobs / temperature) over the tokens at or above the
    row's `floor` (its filters' threshold; -inf keeps all), by inverting the cumulative distribution at
    the row's uniform (`uniforms`); a greedy row's argmax."""
    scaled = mx.where(logprobs >= floor[:, None], logprobs.astype(mx.float32) * inverse[:, None], -mx.inf)
    top = mx.max(scaled, axis=-1, keepdims=True)
    if cpu_math.polynomials():  # MLX's exp is slow on a CPU (5.1 against 1.2 ms for 8 rows of 49k); kept tokens only
        weights = mx.where(scaled > -mx.inf, cpu_math.exp_below_max(scaled, top), 0.0)
    else:
        weights = mx.exp(scaled - top)
    cumulative = mx.cumsum(weights, axis=-1)
    # The total is the last cumulative sum, read as the max (the same value: a shapeless compile cannot slice).
    target = uniform * mx.max(cumulative, axis=-1)
    # The first token whose cumulative mass reaches the target (a token of probability 0 never does first).
    token = mx.minimum(mx.sum(cumulative < target[:, None], axis=-1), logprobs.shape[-1] - 1)
    return mx.where(sampled > 0, token, mx.argmax(logprobs, axis=-1)).astype(mx.uint32)


def host_draw(logprobs: np.ndarray, settings: dict, uniform: np.ndarray) -> np.ndarray:
    """`draw` with `thresholds`' filters, in numpy: (B,) uint32 tokens from (B, V) float32 log-probabilities,
    `settings` a BatchSampler's (`_arrays`), `uniform` each row's.

    A filtered row draws among its candidates (the `width` likeliest) at or above its threshold, a row without
    filters over the whole vocabulary, each inverting its distribution in token order at its uniform, as `draw`
    does; a greedy row takes its argmax."""
    tokens = logprobs.argmax(axis=-1).astype(np.uint32)
    inverse = settings["inverse_host"]
    with np.errstate(invalid="ignore", over="ignore"):  # a row with nothing allowed draws token 0, as `draw`'s does
        for group in settings["filtered"]:
            members = group["members"]
            rows = logprobs if len(members) == len(logprobs) else logprobs[members]  # (members: every row, in order)
            vocab, width = rows.shape[-1], group["width"]
            # The candidates in token order: a token's place in the cumulative sum is its id's, as in `draw`.
            ids = (np.sort(np.argpartition(rows, vocab - width, axis=-1)[:, vocab - width:], axis=-1) if width < vocab
                   else np.broadcast_to(np.arange(vocab), rows.shape))
            candidates = np.take_along_axis(rows, ids, axis=-1)
            ordered = np.sort(candidates, axis=-1)[:, ::-1]
            floor = _cut_points(ordered, *group["filters_host"])
            scaled = np.where(candidates >= floor[:, None], candidates * inverse[members, None], -np.inf)
            tokens[members] = np.take_along_axis(ids, _inverted(scaled, uniform[members])[:, None], axis=-1)[:, 0]
        rows = settings["unfiltered"]
        if len(rows):
            tokens[rows] = _inverted(logprobs[rows] * inverse[rows, None], uniform[rows])
    return tokens


def _cut_points(ordered: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    """`cut_points` for candidates sorted likeliest first: each row's lowest kept log-probability."""
    before = np.zeros_like(ordered)  # the mass of the likelier tokens (summed exactly so: no cumsum minus itself)
    np.cumsum(np.exp(ordered[:, :-1]), axis=-1, out=before[:, 1:])
    keep_p = (before < top_p[:, None]).sum(axis=-1)
    keep_min = (ordered >= ordered[:, :1] + np.log(np.maximum(min_p[:, None], 1e-30))).sum(axis=-1)
    keep = np.maximum(np.minimum(np.minimum(keep_p, keep_min), top_k), 1)
    return ordered[np.arange(len(ordered)), keep - 1]


def _inverted(scaled: np.ndarray, uniform: np.ndarray) -> np.ndarray:
    """Each row's index whose cumulative mass first reaches its uniform's share of the row's total."""
    weights = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    cumulative = np.cumsum(weights, axis=-1)
    target = uniform * cumulative[:, -1]
    return np.minimum((cumulative < target[:, None]).sum(axis=-1), scaled.shape[-1] - 1)


def make_sampler(sampling: Sampling, vocab_size: int, seed_offset: int = 0) -> Callable[[mx.array], mx.array]:
    """A one-sequence sampler with mlx-lm's interface (logprobs -> token), drawing as a batch row does."""
    rows = BatchSampler(vocab_size)
    rows.extend([row_for(sampling, vocab_size, seed_offset)], [[]])
    return rows.sample


class Processor:
    """A one-sequence logits processor with mlx-lm's interface `(tokens, logits) -> logits`: the logit
    bias, penalties and grammar of a batch row, for the paths that decode with mlx-lm's or mlx-vlm's own
    loop. `tokens` is the prompt and the answer so far; the first call's are the prompt."""

    def __init__(self, row: Row):
        self.rows: BatchSampler | None = None
        self.row = row
        self.prompt: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        """Apply the row's bias, penalties and grammar to one sequence's logits."""
        tokens = tokens.reshape(-1)
        if self.rows is None:  # the first call: the prompt; its last token is the one fed now
            # Sized by the logits: a vision model's output may be wider than its text config says.
            self.rows, self.prompt = BatchSampler(logits.shape[-1]), tokens.size
            self.rows.extend([self.row], [tokens[:-1].tolist()])
        generated = tokens.size > self.prompt
        return self.rows.process(logits, tokens[-1:], [generated])


def logits_processors(sampling: Sampling, tokenizer=None, vocab_size: int = 0, grammar=None,
                      strict: bool = True, gate=None) -> list:
    """One sequence's logits processors for mlx-lm's or mlx-vlm's own loop (none when it needs none).
    The grammar (workers/backends/grammar.py) needs the model's tokenizer and output size; `grammar`
    a matcher compiled beforehand, `strict` whether its failure raises; `gate(grammar)` wraps it (a
    reasoning model's thinking: workers/backends/reasoning.py)."""
    grammar = make_grammar(sampling, tokenizer, vocab_size, grammar, strict)
    row = row_for(sampling, vocab_size, grammar=gate(grammar) if gate is not None else grammar)
    needed = row.grammar is not None or row.logit_bias or row.penalized or row.repetition_penalty != 1.0
    return [Processor(row)] if needed else []


def make_grammar(sampling: Sampling, tokenizer, vocab_size: int, grammar=None, strict: bool = True):
    """A GrammarProcessor for one sequence of a request with a response_format, else None."""
    if not sampling.grammar:
        return None
    from workers.backends.grammar import GrammarProcessor  # llguidance only for requests that use it

    return GrammarProcessor(grammar or sampling.grammar, tokenizer, vocab_size, strict)
