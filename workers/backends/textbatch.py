"""Continuous batching of text requests on one model (mlx-lm's BatchGenerator).

Every request for the model decodes in one batch: a request joins at the next step (its prompt
processed in chunks of PREFILL_CHUNK tokens between decode steps, so a long prompt delays the
others by one chunk at most) and leaves when it is done or canceled. Each sequence (a choice) has
its own sampler (workers/backends/sampling.py), stop strings (matched on text, never streamed),
token budget and usage count. A finished sequence's KV cache goes to the worker's prompt cache, from
which a later request that starts the same way (a system prompt, a conversation's earlier turns)
resumes instead of processing that prefix again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from mlx_lm.generate import BatchGenerator, make_stop_sequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from jobs.contract import Choice, TextResult
from jobs.errors import Canceled, ModelTooLarge
from jobs.events import DELTA
from workers.backends import sampling, textgen
from workers.backends.base import Outcome

PREFILL_CHUNK = 512
"""Prompt tokens processed per step: how long a new prompt may hold up the others' next token."""


@dataclass
class Sequence:
    """One choice being generated."""

    task: object
    index: int
    prompt_tokens: int
    cached_tokens: int
    detokenizer: object
    stops: textgen.StopBuffer
    parts: list[str] = field(default_factory=list)
    pending: str = ""  # generated since its last delta went out
    tokens: int = 0
    finish_reason: str | None = None


@dataclass
class Member:
    """A request in the batch: its sequences and when its deltas last went out."""

    task: object
    sequences: list[Sequence]
    last_sent: float = -math.inf

    @property
    def done(self) -> bool:
        """Whether every one of its sequences has finished."""
        return all(s.finish_reason for s in self.sequences)


def kv_bytes_per_token(model, float32: bool) -> int:
    """KV-cache bytes one token takes in this model (keys and values, every layer): from its config."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 0) or 0
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (getattr(args, "hidden_size", 0) // heads if heads else 0)
    return 2 * len(getattr(model, "layers", ())) * kv_heads * head_dim * (4 if float32 else 2)


def batchable(model) -> bool:
    """Whether the model's caches can be merged into a batch (as mlx_lm.server decides)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


class TextBatch:
    """The text requests decoding together on one resident model."""

    def __init__(self, resident, settings, prompt_cache, max_batch: int, models):
        self.resident, self.settings, self.prompt_cache, self.models = resident, settings, prompt_cache, models
        self.kv_per_token = kv_bytes_per_token(resident.model, resident.float32)
        self.waiting: deque = deque()  # (task, prompts, bytes): requests that wait for KV memory
        self.reserved: dict[object, int] = {}  # what each request's KV cache may grow to
        self.key = str(resident.info.path)
        self.tokenizer = resident.processor
        self.vocab = textgen.output_size(resident.model, self.tokenizer)
        self.generator = BatchGenerator(resident.model, completion_batch_size=max_batch,
                                        prefill_batch_size=max_batch, prefill_step_size=PREFILL_CHUNK)
        self.stop_tokens = make_stop_sequences(self.tokenizer)
        self.members: dict[object, Member] = {}
        self.by_uid: dict[int, Sequence] = {}
        self.interval = settings.stream_interval_ms / 1000

    def __len__(self) -> int:
        return len(self.members) + len(self.waiting)

    @property
    def tasks(self) -> list:
        """Every request in the batch, decoding or waiting for memory."""
        return [*self.members, *(task for task, _, _ in self.waiting)]

    @property
    def sequences(self) -> int:
        """How many choices are being generated."""
        return len(self.by_uid)

    def add(self, task) -> None:
        """Join the batch at the next step: one sequence per input and choice (`n`)."""
        request = task.request
        prompts = []  # every input checked before any is inserted: a refusal leaves the batch untouched
        for prompt in request.inputs:
            ids = self._prompt_ids(prompt)
            prompts.append((ids, textgen.token_budget(len(ids), request.sampling.max_tokens,
                                                      request.model.context_length)))
        need = self.kv_per_token * request.n * sum(len(ids) + budget for ids, budget in prompts)
        if need > self._kv_memory():
            raise ModelTooLarge(f"the request's KV cache may grow to {need / 2**20:.0f} MiB but the worker has "
                                f"{self._kv_memory() / 2**20:.0f} MiB beside its models; ask for fewer tokens")
        self.waiting.append((task, prompts, need))
        self._let_in()

    def _kv_memory(self) -> int:
        """What the memory budget leaves beside the resident models: for KV caches, active and kept."""
        return max(0, self.models.budget_bytes - self.models.used_bytes())

    def _let_in(self) -> None:
        """Insert waiting requests, in order, while their KV caches fit (the prompt cache makes room)."""
        while self.waiting:
            task, prompts, need = self.waiting[0]
            room = self._kv_memory() - sum(self.reserved.values()) - need
            if room < 0:
                return
            if self.prompt_cache.nbytes > room:
                self.prompt_cache.trim_to(n_bytes=room)
            self.waiting.popleft()
            self.reserved[task] = need
            request = task.request
            sequences = [self._insert(task, i * request.n + copy, ids, budget, copy)
                         for i, (ids, budget) in enumerate(prompts) for copy in range(request.n)]
            self.members[task] = Member(task, sequences)

    def remove(self, task) -> None:
        """Take a request out of the batch (canceled, failed or timed out); the others go on."""
        self.waiting = deque(item for item in self.waiting if item[0] is not task)
        self.reserved.pop(task, None)
        member = self.members.pop(task, None)
        if member is None:
            return
        uids = [uid for uid, seq in self.by_uid.items() if seq.task is task]
        self.generator.remove(uids)
        for uid in uids:
            del self.by_uid[uid]

    def step(self) -> list[tuple[object, Outcome | Exception]]:
        """One decode step of the batch (and one prefill chunk); the requests that ended in it, each
        with its answer or the error that ended it (a cancel)."""
        self._let_in()
        _, responses = self.generator.next()
        stopped = []  # ended by one of our stop strings: mlx-lm still counts them as running
        for response in responses:
            seq = self.by_uid.get(response.uid)
            if seq is None or not self._advance(seq, response.token, response.finish_reason):
                continue
            del self.by_uid[response.uid]
            if response.finish_reason is None:
                stopped.append(response.uid)
            else:  # its cache serves later requests that start the same way
                self.prompt_cache.insert_cache(self.key, list(response.all_tokens), response.prompt_cache)
        if stopped:
            for cache, tokens in self.generator.remove(stopped, return_prompt_caches=True).values():
                self.prompt_cache.insert_cache(self.key, list(tokens), cache)
        if responses and self.prompt_cache.nbytes:  # kept caches never crowd out running requests
            self.prompt_cache.trim_to(n_bytes=max(0, self._kv_memory() - sum(self.reserved.values())))
        return self._publish_and_collect()

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list):
            return textgen.chat_prompt(self.tokenizer, prompt)
        return textgen.text_prompt(self.tokenizer, prompt)

    def _insert(self, task, index: int, ids: list[int], budget: int, copy: int) -> Sequence:
        """Insert one sequence, resuming from the longest cached prefix of its prompt."""
        request = task.request
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.key, ids)
        if cache is not None and not rest:  # the whole prompt is cached: its last token must be fed again
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = ids[-1:]
            else:
                cache, rest = None, ids
        cached = len(ids) - len(rest)
        (uid,) = self.generator.insert(
            [rest], max_tokens=[budget], caches=[cache], all_tokens=[ids[:cached]],
            samplers=[sampling.make_sampler(request.sampling, self.vocab, copy)],
            logits_processors=[sampling.logits_processors(request.sampling)], stop_sequences=[self.stop_tokens])
        seq = Sequence(task, index, len(ids), cached, self.tokenizer.detokenizer,
                       textgen.StopBuffer(request.sampling.stop))
        self.by_uid[uid] = seq
        return seq

    @staticmethod
    def _advance(seq: Sequence, token: int, finish_reason: str | None) -> bool:
        """Feed one generated token to its sequence; True when the sequence has finished.

        mlx-lm's finish reasons: "stop" for an end-of-sequence token, "length" for the budget.
        """
        seq.tokens += 1  # an end-of-sequence token was generated too: it counts
        if finish_reason == "stop":  # end of sequence: not part of the text
            seq.detokenizer.finalize()
        else:
            seq.detokenizer.add_token(token)
            if finish_reason:
                seq.detokenizer.finalize()
        text, matched = seq.stops.feed(seq.detokenizer.last_segment)
        if matched:
            finish_reason = "stop"
        elif finish_reason:
            text += seq.stops.flush()
        seq.parts.append(text)
        seq.pending += text
        seq.finish_reason = finish_reason
        return finish_reason is not None

    def _publish_and_collect(self) -> list[tuple[object, Outcome | Exception]]:
        """Send the deltas that are due (one round trip for all); return the requests that ended:
        finished, or canceled by their client (its reply to a delta says so)."""
        now, due, ended = time.monotonic(), [], []
        for member in self.members.values():
            if member.done:
                ended.append((member.task, self._outcome(member)))
            elif now - member.last_sent >= self.interval and any(s.pending for s in member.sequences):
                due.append(member)
        if due:
            canceled = self._send([(m.task, self._deltas(m)) for m in due])
            for member, cancel in zip(due, canceled, strict=True):
                member.last_sent = now
                if cancel:
                    tokens = sum(s.tokens for s in member.sequences)
                    ended.append((member.task, Canceled(f"canceled after {tokens} generated tokens")))
        for task, result in ended:
            if isinstance(result, Exception):
                self.remove(task)
            self.members.pop(task, None)
            self.reserved.pop(task, None)
        return ended

    def _send(self, batches: list) -> list[bool]:
        """Publish several requests' deltas in one round trip; whether each one's client canceled."""
        publisher = batches[0][0].run.publisher
        return publisher.publish_pipelined([(task.run.job_id, events) for task, events in batches])

    @staticmethod
    def _deltas(member: Member) -> list:
        events = [(DELTA, {"index": s.index, "text": s.pending}) for s in member.sequences if s.pending]
        for seq in member.sequences:
            seq.pending = ""
        return events

    def _outcome(self, member: Member) -> Outcome:
        """The answer of a finished request; its last deltas go out with it in one round trip."""
        request = member.task.request
        choices = [Choice(s.index, "".join(s.parts), s.finish_reason) for s in member.sequences]
        prompts = {s.index // request.n: s for s in member.sequences}  # a prompt counts once for its n choices
        result = TextResult(request.model.id, choices, sum(s.prompt_tokens for s in prompts.values()),
                            sum(s.tokens for s in member.sequences), int(time.time()),
                            cached_tokens=sum(s.cached_tokens for s in prompts.values()))
        return Outcome(result.as_dict(), before=self._deltas(member))

    def close(self) -> None:
        """Give back what the generator holds (the last request has left)."""
        self.generator.close()
