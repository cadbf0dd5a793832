"""Continuous batching of text requests on one model (mlx-lm's BatchGenerator).

Every request for the model decodes in one batch: a request joins at the next step (its prompt
processed in chunks of PREFILL_CHUNK tokens between decode steps, so a long prompt delays the
others by one chunk at most) and leaves when it is done or canceled. Each sequence (a choice) has
its own sampler (workers/backends/sampling.py), stop strings (matched on text, never streamed),
token budget and usage count. A finished sequence's KV cache goes to the worker's prompt cache, from
which a later request that starts the same way (a system prompt, a conversation's earlier turns)
resumes instead of processing that prefix again.

A request that is alone, with one choice, decodes on its own (workers/backends/solo.py), at the
speed of a single stream; when another joins, the batch takes it over, cache and all.
"""

from __future__ import annotations

import time
from collections import deque

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, make_stop_sequences
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from jobs.contract import Choice, TextResult
from jobs.errors import Canceled, ModelTooLarge
from workers.backends import sampling, textgen, toolcalls
from workers.backends.base import Outcome
from workers.backends.choice import Member, Sequence
from workers.backends.solo import SoloDecoder
from workers.backends.text import delta

PREFILL_CHUNK = 512
"""Prompt tokens processed per step: how long a new prompt may hold up the others' next token."""


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
        self.solo: tuple[Sequence, SoloDecoder] | None = None  # the lone sequence, decoding on its own
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
        return len(self.by_uid) + (self.solo is not None)

    def add(self, task) -> None:
        """Join the batch at the next step: one sequence per input and choice (`n`)."""
        request = task.request
        prompts = []  # every input checked before any is inserted: a refusal leaves the batch untouched
        for prompt in request.inputs:
            ids = textgen.prompt_ids(self.tokenizer, prompt, request.tools)
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
            alone = not self.members and not self.waiting and len(prompts) * request.n == 1
            if not alone and self.solo is not None:
                self._hand_over()
            sequences = [self._insert(task, i * request.n + copy, ids, budget, copy, alone)
                         for i, (ids, budget) in enumerate(prompts) for copy in range(request.n)]
            self.members[task] = Member(task, sequences)

    def remove(self, task) -> None:
        """Take a request out of the batch (canceled, failed or timed out); the others go on."""
        self.waiting = deque(item for item in self.waiting if item[0] is not task)
        self.reserved.pop(task, None)
        member = self.members.pop(task, None)
        if member is None:
            return
        if self.solo is not None and self.solo[0].task is task:
            self.solo = None
        uids = [uid for uid, seq in self.by_uid.items() if seq.task is task]
        self.generator.remove(uids)
        for uid in uids:
            del self.by_uid[uid]

    def step(self) -> list[tuple[object, Outcome | Exception]]:
        """One decode step of the batch (and one prefill chunk); the requests that ended in it, each
        with its answer or the error that ended it (a cancel)."""
        self._let_in()
        if self.solo is not None:
            self._step_solo()
            return self._publish_and_collect()
        _, responses = self.generator.next()
        stopped = []  # ended by one of our stop strings: mlx-lm still counts them as running
        for response in responses:
            seq = self.by_uid.get(response.uid)
            if seq is None or not seq.advance(response.token, response.finish_reason, response.logprobs):
                continue
            del self.by_uid[response.uid]
            if response.finish_reason is None:
                stopped.append(response.uid)
            else:  # its cache serves later requests that start the same way
                self.prompt_cache.insert_cache(self.key, list(response.all_tokens), response.prompt_cache)
        if stopped:
            for cache, tokens in self.generator.remove(stopped, return_prompt_caches=True).values():
                self.prompt_cache.insert_cache(self.key, list(tokens), cache)
        if responses:
            self._trim_kept()
        return self._publish_and_collect()

    def _trim_kept(self) -> None:
        """Kept caches never crowd out running requests."""
        if self.prompt_cache.nbytes:
            self.prompt_cache.trim_to(n_bytes=max(0, self._kv_memory() - sum(self.reserved.values())))

    def _insert(self, task, index: int, ids: list[int], budget: int, copy: int, alone: bool) -> Sequence:
        """Start one sequence (on its own when `alone`), resuming from the longest cached prefix of its
        prompt."""
        request = task.request
        cache, rest = self.prompt_cache.fetch_nearest_cache(self.key, ids)
        if cache is not None and not rest:  # the whole prompt is cached: its last token must be fed again
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = ids[-1:]
            else:
                cache, rest = None, ids
        cached = len(ids) - len(rest)
        sampler = sampling.make_sampler(request.sampling, self.vocab, copy)
        processors = sampling.logits_processors(request.sampling, self.tokenizer, self.vocab)
        seq = Sequence(task, index, len(ids), cached, self.tokenizer.detokenizer,
                       textgen.StopBuffer(request.sampling.stop), tokenizer=self.tokenizer,
                       tools=toolcalls.for_request(request, self.tokenizer))
        if alone:
            self.solo = seq, SoloDecoder(self.resident.model, ids[:cached], rest, cache, sampler, processors,
                                         budget, set(self.tokenizer.eos_token_ids), PREFILL_CHUNK)
        else:
            self._insert_batched(seq, rest, cache, ids[:cached], budget, sampler, processors)
        return seq

    def _insert_batched(self, seq, prompt, cache, fed, budget, sampler, processors) -> None:
        (uid,) = self.generator.insert([prompt], max_tokens=[budget], caches=[cache], all_tokens=[fed],
                                       samplers=[sampler], logits_processors=[processors],
                                       stop_sequences=[self.stop_tokens])
        self.by_uid[uid] = seq

    def _step_solo(self) -> None:
        """A prefill chunk or one token of the lone sequence; its cache is kept when it finishes."""
        seq, solo = self.solo
        with mx.stream(self.generator.stream):
            out = solo.step()
        if out is not None and seq.advance(*out, solo.last_logprobs):
            self.solo = None
            self.prompt_cache.insert_cache(self.key, list(solo.fed), solo.cache)
            self._trim_kept()

    def _hand_over(self) -> None:
        """Move the lone sequence into the batched generator, which another request is joining."""
        seq, solo = self.solo
        self.solo = None
        prompt = solo.rest
        if solo.decoding:  # the token being computed is handed out; decoding goes on from it
            with mx.stream(self.generator.stream):
                token, finish_reason = solo.take_pending()
            if seq.advance(token, finish_reason, solo.last_logprobs):
                self.prompt_cache.insert_cache(self.key, list(solo.fed), solo.cache)
                return
            prompt = [token]
        self._insert_batched(seq, prompt, solo.cache, solo.fed, solo.left, solo.sampler, solo.processors)

    def _publish_and_collect(self) -> list[tuple[object, Outcome | Exception]]:
        """Send the deltas that are due (one round trip for all); return the requests that ended:
        finished, or canceled by their client (its reply to a delta says so)."""
        now, due, ended = time.monotonic(), [], []
        for member in self.members.values():
            if member.done:
                ended.append((member.task, self._outcome(member)))
            elif now - member.last_sent >= self.interval and any(s.pending or s.pending_calls
                                                                   for s in member.sequences):
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
        publisher, now = batches[0][0].run.publisher, time.time()
        for task, _ in batches:
            task.run.first_output_at = task.run.first_output_at or now
        return publisher.publish_pipelined([(task.run.job_id, events) for task, events in batches])

    @staticmethod
    def _deltas(member: Member) -> list:
        events = [delta(s.index, s.pending, s.pending_logprobs, s.pending_calls) for s in member.sequences
                  if s.pending or s.pending_logprobs or s.pending_calls]
        for seq in member.sequences:
            seq.pending, seq.pending_logprobs, seq.pending_calls = "", [], []
        return events

    def _outcome(self, member: Member) -> Outcome:
        """The answer of a finished request; its last deltas go out with it in one round trip."""
        request = member.task.request
        wanted = request.sampling.logprobs is not None
        choices = [Choice(s.index, "".join(s.parts), s.finish_reason, s.logprobs if wanted else None,
                          s.tool_calls or None, s.stop_sequence) for s in member.sequences]
        prompts = {s.index // request.n: s for s in member.sequences}  # a prompt counts once for its n choices
        result = TextResult(request.model.id, choices, sum(s.prompt_tokens for s in prompts.values()),
                            sum(s.tokens for s in member.sequences), int(time.time()),
                            cached_tokens=sum(s.cached_tokens for s in prompts.values()))
        return Outcome(result.as_dict(), before=self._deltas(member))

    def close(self) -> None:
        """Give back what the generator holds (the last request has left)."""
        self.generator.close()
