"""Embeddings: text encoders (BERT and its kin, run by mlx-embeddings) turning each input into one vector.

The inputs of every embedding request of a model wait in its `EmbeddingBatch`; each of its steps takes the
oldest ones (up to STEP_TOKENS_PER_PASS passes' worth), sorts them by length, pads them into passes of at most
`pass_tokens` tokens and encodes them, so many small requests share a pass and one large request goes in pieces.
The scheduler runs those steps in turn with the text batches' steps and the transcriptions' windows
(workers/admission.py): a chat waits at most one step of embeddings.

Pooling and normalization follow the model's sentence-transformers files (jobs.model_files.embedding_facts).
"""

from __future__ import annotations

import base64
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from jobs.contract import EmbeddingRequest, EmbeddingResult
from jobs.errors import Canceled, InvalidRequest
from jobs.keys import cancel_flag
from jobs.model_files import EmbeddingFacts, embedding_facts
from workers.backends import cpu_math, prepare
from workers.backends.base import Outcome

PASS_TOKENS_GPU = 16384
"""The most tokens of one pass (rows times the longest row) on a GPU: a pass of MiniLM takes a few ms there."""
PASS_TOKENS_CPU = 2048
"""The same on a CPU, where a pass of 2,048 tokens of MiniLM takes ~0.1-0.2 s (two cores): a chat beside a large
embedding request waits about that long between its tokens."""
STEP_TOKENS_PER_PASS = 2
"""How many passes' worth of the oldest inputs a step takes (then sorts by length and packs into passes): more
room to group inputs of like length, for a longer step."""


class Encoder:
    """A loaded embedding model: its mlx-embeddings module, tokenizer and pooling."""

    def __init__(self, model, tokenizer, facts: EmbeddingFacts, vocab_size: int):
        self.model, self.tokenizer, self.facts, self.vocab_size = model, tokenizer, facts, vocab_size
        self.prefix, self.suffix = _special_tokens(tokenizer)
        # BERT runs through bert_hidden; other encoders (xlm-roberta, modernbert) through their own module.
        self.bert = getattr(getattr(model, "config", None), "model_type", None) == "bert"
        self.pad_id = next((i for i in map(tokenizer.token_to_id, ("[PAD]", "<pad>")) if i is not None), 0)

    def parameters(self):
        """The module's parameters (what the model manager counts)."""
        return self.model.parameters()

    def token_ids(self, inputs: list) -> list[list[int]]:
        """Each input's token ids, special tokens included: texts tokenized, token-id lists wrapped as texts are."""
        texts = [(i, text) for i, text in enumerate(inputs) if isinstance(text, str)]
        encoded = self.tokenizer.encode_batch([text for _, text in texts]) if texts else []
        ids: list[list[int]] = [[] for _ in inputs]
        for (i, _), encoding in zip(texts, encoded, strict=True):
            ids[i] = encoding.ids
        for i, item in enumerate(inputs):
            if not isinstance(item, str):
                ids[i] = [*self.prefix, *item, *self.suffix]
        return ids

    def encode(self, rows: list[list[int]]) -> np.ndarray:
        """One pass: the rows padded to the longest, encoded, pooled (and normalized): float32, one row each."""
        longest = max(len(row) for row in rows)
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(rows), longest), dtype=np.float32)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = row
            mask[r, :len(row)] = 1.0
        mask_mx = mx.array(mask)
        if self.bert:
            hidden = bert_hidden(self.model, mx.array(ids), mask_mx).astype(mx.float32)
        else:
            hidden = self.model(mx.array(ids), attention_mask=mask_mx).last_hidden_state.astype(mx.float32)
        vectors = pool(hidden, mask_mx, self.facts.pooling)
        if self.facts.normalize:
            vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return np.array(vectors)


def bert_hidden(model, ids: mx.array, mask: mx.array) -> mx.array:
    """The last hidden states of mlx-embeddings' BERT for padded rows (`mask` 1 on real tokens), its own modules
    run with cpu_math's attention and GELU: fused kernels on a GPU, and on a CPU polynomials in place of MLX's exp
    and erf, which take an element at a time there (they were most of a pass)."""
    x = model.embeddings(ids)
    bias = ((mask - 1.0) * 1e9)[:, None, None, :]  # padding keys get nothing (rows are never all padding)
    for layer in model.encoder.layer:
        heads = layer.attention.self
        rows, length, width = x.shape
        q, k, v = (proj(x).reshape(rows, length, heads.num_attention_heads, -1).transpose(0, 2, 1, 3)
                   for proj in (heads.query, heads.key, heads.value))
        context = cpu_math.attention(q, k, v, scale=heads.attention_head_size ** -0.5, bias=bias)
        attended = layer.attention.output(context.transpose(0, 2, 1, 3).reshape(rows, length, width), x)
        x = layer.output(cpu_math.gelu(layer.intermediate.dense(attended)), attended)
    return x


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """One vector per row of `hidden` (rows, tokens, width) from its real tokens (`mask` 1), as `mode` says."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(axis=1).astype(mx.int32) - 1
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.where(mask[..., None] > 0, hidden, -mx.inf).max(axis=1)
    return (hidden * mask[..., None]).sum(axis=1) / mx.maximum(mask.sum(axis=1, keepdims=True), 1.0)


def _special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text's own ([CLS] and [SEP] for BERT), found by encoding a
    word with and without them."""
    bare = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a").ids
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    return [], []


def load_encoder(path: Path, float32: bool) -> tuple[Encoder, None]:
    """Load an embedding model directory: mlx-embeddings' module for its architecture, its tokenizer.json."""
    from mlx_embeddings.utils import load_model
    from tokenizers import Tokenizer

    from jobs.model_files import read_json, vocab_size_of

    path = Path(path)
    facts = embedding_facts(path)
    if facts is None:
        raise InvalidRequest(f"{path.name} is not an embedding model (its config.json has no hidden_size)",
                             code="invalid_model", param="model")
    model = load_model(path, path_to_repo=str(path))
    if float32:
        model.set_dtype(mx.float32)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.no_truncation()  # an input past the model's room is refused, never cut short
    tokenizer.no_padding()
    return Encoder(model, tokenizer, facts, vocab_size_of(read_json(path / "config.json") or {}) or 0), None


class EmbeddingBackend:
    """Loads embedding models for the model manager; their requests run in an `EmbeddingBatch`."""

    model_kind = "embedding"
    resumable = False

    def load(self, path: Path, float32: bool):
        """(Encoder, None) for a model directory."""
        return load_encoder(path, float32)

    def run(self, request, job, models):
        """Never called: the scheduler puts embedding requests in their model's EmbeddingBatch."""
        raise NotImplementedError("embedding requests run in an EmbeddingBatch")


@dataclass(eq=False)
class Member:
    """One request's inputs in the batch, and their vectors as they come."""

    task: object
    request: EmbeddingRequest
    ids: list[list[int]] | None = None  # None while its inputs are tokenized on a preparing thread
    tokenizing: Future | None = None
    vectors: list = field(default_factory=list)
    taken: int = 0  # inputs handed to a pass so far (they are taken in order)
    left: int = 0  # inputs whose vectors have not come yet


class EmbeddingBatch:
    """The embedding requests of one model: their inputs encoded together, a few passes a step."""

    def __init__(self, resident, pass_tokens: int, conn):
        self.resident, self.pass_tokens, self.conn = resident, pass_tokens, conn
        self.encoder: Encoder = resident.model
        self.key = f"{resident.info.path}#embedding"
        self.members: dict[object, Member] = {}  # in the order they came: the oldest inputs go first
        self.waiting = False  # (the admission policy's question to text batches: never waits for memory)
        self.spent = Counter()  # DEBUG: where the loop's time goes (the scheduler's summary)

    def __len__(self) -> int:
        return len(self.members)

    @property
    def tasks(self) -> list:
        """The tasks of the requests in the batch."""
        return list(self.members)

    def add(self, task) -> None:
        """Take a request: its inputs are tokenized and checked on a preparing thread (the MLX thread spent 1-2 ms
        on 32 texts), then encoded in the steps to come."""
        self.members[task] = Member(task, task.request, tokenizing=prepare.THREADS.submit(self._tokens, task.request))

    def _tokens(self, request: EmbeddingRequest) -> list[list[int]]:
        """The request's inputs' token ids; InvalidRequest names the first input that does not fit the model."""
        if not request.inputs:  # (the web refuses it first; a payload may not come from it)
            raise InvalidRequest("'input' must not be empty.", code="invalid_value", param="input")
        ids = self.encoder.token_ids(request.inputs)
        room, vocab = self.encoder.facts.max_tokens, self.encoder.vocab_size
        for i, (item, row) in enumerate(zip(request.inputs, ids, strict=True)):
            param = "input" if len(ids) == 1 else f"input[{i}]"
            if not isinstance(item, str) and vocab and any(not 0 <= t < vocab for t in item):
                raise InvalidRequest(f"'{param}' holds a token id outside the vocabulary of model "
                                     f"'{request.model.id}' (0 to {vocab - 1}).", code="invalid_value", param=param)
            if len(row) > room:
                raise InvalidRequest(f"'{param}' is {len(row)} tokens long; model '{request.model.id}' takes at most "
                                     f"{room} tokens per input, special tokens included. Split it into shorter "
                                     "pieces.", code="context_length_exceeded", param=param)
        return ids

    def remove(self, task) -> None:
        """Take a request out (canceled, timed out); its inputs already in a pass are simply not used."""
        self.members.pop(task, None)

    def step(self) -> list[tuple[object, Outcome | Exception]]:
        """Encode the oldest inputs (a few passes); return the requests that ended: all their vectors came, or
        their client canceled."""
        ended = self._canceled() + self._tokenized()
        picked = self._pick()
        started = time.monotonic()
        for rows in self._passes(picked):
            vectors = self.encoder.encode([member.ids[i] for member, i in rows])
            for (member, i), vector in zip(rows, vectors, strict=True):
                member.vectors[i] = vector
                member.left -= 1
        self.spent["engine"] += time.monotonic() - started
        self.spent["steps"] += 1
        self.spent["rows"] += len(picked)
        for member in list(self.members.values()):
            if member.ids is not None and member.left == 0:
                del self.members[member.task]
                ended.append((member.task, self._outcome(member)))
        return ended

    def _canceled(self) -> list[tuple[object, Exception]]:
        """The requests whose clients asked to cancel them (one round trip for all), taken out."""
        if not self.members:
            return []
        with self.conn.pipeline(transaction=False) as pipe:
            for task in self.members:
                pipe.exists(cancel_flag(task.run.job_id))
            flags = pipe.execute()
        gone = [task for task, flag in zip(list(self.members), flags, strict=True) if flag]
        for task in gone:
            del self.members[task]
        return [(task, Canceled("the job was canceled")) for task in gone]

    def _tokenized(self) -> list[tuple[object, Exception]]:
        """Take in the requests whose inputs are tokenized (waiting a little for one when none is ready); those
        refused (an input too long) leave with their error."""
        pending = [m.tokenizing for m in self.members.values() if m.ids is None]
        if pending and all(m.ids is None for m in self.members.values()):  # nothing to encode meanwhile
            wait(pending, timeout=prepare.IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        refused = []
        for member in list(self.members.values()):
            if member.ids is None and member.tokenizing.done():
                try:
                    member.ids = member.tokenizing.result()
                except Exception as exc:  # noqa: BLE001 (the request's own error: its client is told)
                    del self.members[member.task]
                    refused.append((member.task, exc))
                    continue
                member.vectors, member.left = [None] * len(member.ids), len(member.ids)
        return refused

    def _pick(self) -> list[tuple[Member, int]]:
        """The oldest inputs not yet encoded, up to STEP_TOKENS_PER_PASS passes' worth of tokens (one at least)."""
        picked, tokens, budget = [], 0, self.pass_tokens * STEP_TOKENS_PER_PASS
        for member in self.members.values():
            while member.ids is not None and member.taken < len(member.ids):
                length = len(member.ids[member.taken])
                if picked and tokens + length > budget:
                    return picked
                picked.append((member, member.taken))
                member.taken += 1
                tokens += length
        return picked

    def _passes(self, picked: list[tuple[Member, int]]) -> list[list[tuple[Member, int]]]:
        """The picked inputs sorted by length and cut into passes of at most pass_tokens tokens, padding included."""
        passes, current = [], []
        for item in sorted(picked, key=lambda item: len(item[0].ids[item[1]])):
            length = len(item[0].ids[item[1]])
            if current and (len(current) + 1) * length > self.pass_tokens:
                passes.append(current)
                current = []
            current.append(item)
        return passes + [current] if current else passes

    def _outcome(self, member: Member) -> Outcome:
        """A finished request's answer: its vectors, in its inputs' order."""
        vectors = np.ascontiguousarray(np.stack(member.vectors), dtype="<f4")
        result = EmbeddingResult(model=member.request.model.id,
                                 embeddings=[base64.b64encode(row.tobytes()).decode("ascii") for row in vectors],
                                 dimensions=int(vectors.shape[1]), prompt_tokens=sum(len(r) for r in member.ids))
        # RQ keeps a summary: the vectors are in the done event (and an async job's record) already.
        return Outcome(result.as_dict(), kept={"model": result.model, "inputs": len(result.embeddings),
                                               "dimensions": result.dimensions, "prompt_tokens": result.prompt_tokens})

    def flush(self) -> None:
        """Nothing to send ahead of the ends (embeddings publish only their answers)."""

    def keep_left(self) -> None:
        """Nothing to keep of finished requests (no prompt cache for embeddings)."""

    def close(self) -> None:
        """Nothing to free: the model stays with the model manager."""
