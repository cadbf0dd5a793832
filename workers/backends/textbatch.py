"""Continuous batching of text requests on one model (mlx-lm's BatchGenerator).

Every request for the model decodes in one batch: a request joins at the next step and leaves when
it is done or canceled. Its prompts are processed first, in turns of at most PREFILL_CHUNK tokens
(workers/backends/prefill.py: a new request's before the rest of a big one's); while anyone
decodes, prompt processing gets at most half of the time, so a long prompt delays the others'
tokens by one turn at most and a short request starts within a turn or two of arriving; the turn that
finishes a prompt draws its choices' first tokens (a request's first token does not wait for a decode
step). Decoding holds up to `max_batch` sequences, shared out among requests fewest-first, and a request with
nothing decoding yet always starts one, so none waits for another's many choices to finish.
Decoding is one forward pass and one sampling computation for every sequence
(workers/backends/decoding.py, workers/backends/sampling.py), whatever each one's sampling settings.
Each sequence (a choice) has its own stop strings (matched on text, never streamed), token budget and
usage count. A finished sequence's KV cache goes to the worker's prompt cache, from
which a later request that starts the same way (a system prompt, a conversation's earlier turns)
resumes instead of processing that prefix again.

A request joins once it is prepared (tokenized, counted, its grammar compiled) beside the MLX thread
(workers/backends/prepare.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import generation_stream, maybe_set_recommended_wired_limit
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from jobs.contract import Choice, TextResult
from jobs.errors import Canceled
from workers.backends import (
    cpu_math,
    prefill,
    prepare,
    quantized_kv,
    reasoning,
    sampling,
    textgen,
    toolcalls,
    vision_batch,
)
from workers.backends.base import Outcome
from workers.backends.choice import Member, Sequence
from workers.backends.decoding import DecodeBatch, Joining, kept_rows
from workers.backends.prefill import Prompt, Start, Together
from workers.backends.prompt_disk import DISK_MIN_TOKENS, in_memory, namespace_for
from workers.backends.publishing import BackgroundPublisher
from workers.backends.text import choice_events
from workers.models import batch_key

log = logging.getLogger(__name__)

SLOW_STEP_S = 0.1
"""A step that takes longer is logged at DEBUG level (MLXQ_LOG_LEVEL=DEBUG), with what it did."""

PREFILL_CHUNK = 512
"""Prompt tokens processed per turn: how long a new prompt may hold up the others' next token."""

BURST_TOKENS = 4096
"""Prompt tokens one turn may process when they are all new prompts that it finishes (a burst of chats): as
many as MERGE_BYTES lets one pass hold. A long prompt still goes PREFILL_CHUNK at a time."""

MERGE_BYTES = 256 * 2**20
"""At most this much padded KV cache for the prompts processed in one pass: merging copies their cached
prefixes (a long shared system prompt times 32 prompts would be gigabytes, briefly)."""

def kv_bytes_per_token(model, float32: bool, kv=None) -> int:
    """KV-cache bytes one token takes in this model (keys and values, every layer): from its config. Quantized
    (`kv`, a jobs.kv_quant.KVQuant), a head's vector is its packed integers and a scale and a bias per group,
    in the model's dtype: what the cache's arrays really hold."""
    args = getattr(model, "args", None)
    heads = getattr(args, "num_attention_heads", 0) or 0
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = quantized_kv.head_dims(model) or 0
    element = 4 if float32 else 2
    vector = (head_dim * kv.bits // 8 + 2 * (head_dim // kv.group_size) * element) if kv else head_dim * element
    return 2 * len(getattr(model, "layers", ())) * kv_heads * vector


def batchable(model) -> bool:
    """Whether the model's caches can be merged into a batch (as mlx_lm.server decides)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


@dataclass
class Timeline:
    """Where a request's first token waited (kept at DEBUG level, logged when it ends): its times since
    it was taken, and the batch's turns between then and its first token."""

    taken: float
    turns: Counter  # the batch's turns when it was taken; once its first token is drawn, the turns since
    prepared: float | None = None
    joined: float | None = None
    first: float | None = None

    def __str__(self) -> str:
        def ms(at: float | None) -> str:
            return "-" if at is None else f"{1000 * (at - self.taken):.1f} ms"

        return (f"prepared at {ms(self.prepared)}, joined at {ms(self.joined)}, first token at {ms(self.first)} "
                f"after it was taken; turns before its first token: {self.turns['prefill']} prompt processing, "
                f"{self.turns['decode']} decoding")


class TextBatch:
    """The text requests decoding together on one resident model."""

    def __init__(self, resident, settings, prompt_cache, max_batch: int, models, disk=None, vision=None):
        self.resident, self.settings, self.prompt_cache, self.models = resident, settings, prompt_cache, models
        # A vision model's chats decode on its language model's mlx-lm twin (workers/backends/vision_batch.py).
        self.vision = vision
        self.model = vision.model if vision is not None else resident.model
        # None: unquantized (a vision model's caches always are, as on its one-request path: docs/operations.md)
        self.kv = quantized_kv.for_model(self.model, resident.info.path, settings) if vision is None else None
        self.kv_per_token = kv_bytes_per_token(self.model, resident.float32, self.kv)
        self.burst_tokens = min(BURST_TOKENS, MERGE_BYTES // max(1, self.kv_per_token))  # a burst's turn, at most
        self.preparing: dict[object, Future] = {}  # requests being prepared, off the MLX thread
        self.fresh: list[Future] = []  # preparations submitted since the last step
        self.refused: list[tuple[object, Exception]] = []  # prepared into an error: ended at the next step
        self.waiting: deque = deque()  # (task, Prepared): requests that wait for KV memory
        self.reserved: dict[object, int] = {}  # what each request's KV cache may grow to
        self.key = batch_key(resident.info.path, getattr(resident, "adapter", None))  # a batch per model and adapter
        # Kept caches are found by model and KV quantization: a cache of another kind never joins this batch's.
        self.cache_key = self.key if self.kv is None else f"{self.key}#kv{self.kv.bits}g{self.kv.group_size}"
        # The prompt cache's disk tier (workers/backends/prompt_disk.py), for a model whose caches it can keep.
        self.disk_ns = disk and vision is None and namespace_for(resident, self.kv, settings.adapters_dir)
        self.disk = disk if self.disk_ns else None
        if self.disk:
            self.disk.register(self.cache_key, self.disk_ns)
        self.tokenizer = vision.tokenizer if vision is not None else resident.processor
        self.vocab = textgen.output_size(self.model, self.tokenizer)
        self.max_batch = max_batch
        self.stream = generation_stream
        self.decoder = DecodeBatch(self.model, self.vocab, set(self.tokenizer.eos_token_ids), self.stream)
        self._old_wired_limit = maybe_set_recommended_wired_limit()  # as mlx-lm's generators do (Metal)
        self.members: dict[object, Member] = {}
        self.prefilling: list[Prompt] = []  # prompts being processed
        self.ready: list[Start] = []  # choices whose prompts are processed, waiting for room to decode
        self.next_turn_at = 0.0  # while anyone decodes, no prompt-processing turn before this (monotonic)
        self._order = itertools.count()
        self.interval = settings.stream_interval_ms / 1000
        self.turns = Counter()  # the batch's turns so far: "prefill" and "decode"
        self.timelines: dict[object, Timeline] = {}  # at DEBUG level: where each request's first token waited
        self.publishing: BackgroundPublisher | None = None  # sends the deltas beside the decode loop
        self.canceled: set[str] = set()  # jobs whose clients canceled, as the replies to their deltas said
        self.spent = Counter()  # at DEBUG level: seconds per part of the batch's steps (the scheduler logs them)
        self.leaving: list = []  # the caches of the sequences that left at this step, kept after their answers

    def __len__(self) -> int:
        return len(self.members) + len(self.waiting) + len(self.preparing) + len(self.refused)

    @property
    def tasks(self) -> list:
        """Every request in the batch: decoding, waiting for memory, being prepared or refused."""
        return [*self.members, *(task for task, _ in self.waiting), *self.preparing,
                *(task for task, _ in self.refused)]

    @property
    def sequences(self) -> int:
        """How many choices are decoding."""
        return len(self.decoder)

    def _decoding(self) -> Counter:
        """How many choices each request has decoding."""
        return Counter(slot.key.task for slot in self.decoder.slots)

    def add(self, task) -> None:
        """Join the batch once prepared: one sequence per input and choice (`n`). A request that cannot
        be served (too long, too big for memory, a bad grammar) ends at a step with its error."""
        # With the disk tier on, a prompt long enough to have an entry there is prepared on a thread (reading the
        # entry is part of it), never on this one.
        light = prepare.LIGHT_CHARS if not self.disk else min(prepare.LIGHT_CHARS, DISK_MIN_TOKENS)
        # (a chat on a vision model never is light: its images are read and its template rendered on a thread)
        future = prepare.submit(self._prepare, task.request, light)
        self.preparing[task] = future
        self.fresh.append(future)
        if log.isEnabledFor(logging.DEBUG):
            self.timelines[task] = Timeline(time.monotonic(), Counter(self.turns))

    def _prepare(self, request) -> prepare.Prepared:
        """The request prepared for this batch's model (on a preparing thread)."""
        if request.kind == "multimodal":
            return vision_batch.prepare(request, self.vision, self.vocab, self.kv_per_token, self._kv_memory,
                                        lambda media, ids: in_memory(self.prompt_cache, media.namespace(self.cache_key),
                                                                     ids))
        prepared = prepare.prepare(request, self.tokenizer, self.vocab, self.kv_per_token, self._kv_memory)
        if self.disk:  # a prefix on disk longer than the memory tier's is read here, not on the MLX thread
            prepared.loaded = [self.disk.load(self.disk_ns, ids, in_memory(self.prompt_cache, self.cache_key, ids))
                               for ids, _ in prepared.prompts]
        return prepared

    def _collect_prepared(self) -> None:
        """Move the prepared requests to the waiting line, and those that cannot be served to `refused`
        (the next step ends them with their errors)."""
        for task, future in list(self.preparing.items()):
            if not future.done():
                continue
            del self.preparing[task]
            if task in self.timelines:
                self.timelines[task].prepared = time.monotonic()
            try:
                self.waiting.append((task, future.result()))
            except Exception as exc:  # noqa: BLE001 (the request's own error, told to its client)
                self.refused.append((task, exc))
        self._let_in()

    def _kv_memory(self) -> int:
        """What the memory budget leaves beside the resident models: for KV caches, active and kept."""
        return max(0, self.models.budget_bytes - self.models.used_bytes())

    def _let_in(self) -> None:
        """Insert waiting requests, in order, while their KV caches fit (the prompt cache makes room)."""
        while self.waiting:
            task, prepared = self.waiting[0]
            need = prepared.need
            room = self._kv_memory() - sum(self.reserved.values()) - need
            if room < 0:
                return
            if self.prompt_cache.nbytes > room:
                self.prompt_cache.trim_to(n_bytes=room)
            self.waiting.popleft()
            self.reserved[task] = need
            for loaded in prepared.loaded:  # read from disk: the memory tier serves them from now on
                if loaded is not None:
                    self.prompt_cache.insert_cache(self.cache_key, loaded.tokens, loaded.cache)
            sequences = []
            for i, (ids, budget) in enumerate(prepared.prompts):
                prompt = self._prompt(task, i, ids, budget, prepared.grammar,
                                      prepared.media[i] if prepared.media else None)
                self._count_lookup(task, len(prompt.fed), bool(prepared.loaded and prepared.loaded[i]), len(ids))
                sequences += [start.seq for start in prompt.starts]
                self.prefilling.append(prompt)
            self.members[task] = Member(task, sequences)
            if any(prepared.loaded):  # its prompts hold views of them now: the memory tier keeps to its room
                self._trim_kept()
            if task in self.timelines:
                self.timelines[task].joined = time.monotonic()

    def _count_lookup(self, task, cached: int, from_disk: bool, length: int) -> None:
        """Note where a prompt's cached prefix came from, for /metrics (recorded when its request ends): the
        memory tier, or the disk tier, which counts the prompts it could have served (long ones that the memory
        tier did not serve as far as it keeps)."""
        task.cache_lookups.append(("memory", bool(cached) and not from_disk, 0 if from_disk else cached))
        if self.disk and (from_disk or (length >= DISK_MIN_TOKENS and cached < DISK_MIN_TOKENS)):
            task.cache_lookups.append(("disk", from_disk and bool(cached), cached))

    def remove(self, task) -> None:
        """Take a request out of the batch (canceled, failed or timed out); the others go on."""
        self.timelines.pop(task, None)
        self.preparing.pop(task, None)  # its preparation may finish; nobody collects it
        self.refused = [item for item in self.refused if item[0] is not task]
        self.waiting = deque(item for item in self.waiting if item[0] is not task)
        self.reserved.pop(task, None)
        member = self.members.pop(task, None)
        if member is None:
            return
        self.prefilling = [p for p in self.prefilling if p.task is not task]
        self.ready = [s for s in self.ready if s.task is not task]
        self.decoder.remove(member.sequences)

    def step(self) -> list[tuple[object, Outcome | Exception]]:
        """One turn of the batch: a decode step for everyone decoding, or a turn of prompt processing;
        the requests that ended in it, each with its answer or the error that ended it (a cancel)."""
        began = time.monotonic()
        if self.preparing and not (self.members or self.waiting):  # nothing to do meanwhile
            wait(list(self.preparing.values()), timeout=prepare.IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        if self.fresh:  # the requests taken since the last step join at this one if ready soon (one wait
            # for all of them: 64 requests taken at once waited 2 ms each, 128 ms before anyone's next token)
            wait(self.fresh, timeout=prepare.PREPARE_WAIT_S)
            self.fresh = []
        self._collect_prepared()
        refused, self.refused = self.refused, []
        turn = self._prefill_turn_due()
        if turn or self.sequences:
            self.turns["prefill" if turn else "decode"] += 1
        started = time.monotonic()
        if turn:
            self._prefill(turn)
            # Wall time, not the decode steps' own: a decode step's work overlaps the publishing
            # around it (its next token is computed while this one is handed out).
            self.next_turn_at = max(self.next_turn_at, 2 * time.monotonic() - started)
            left_s = 0.0
        else:
            left_s = self._decode()
        joined = time.monotonic()
        self._start_ready()
        publishing = time.monotonic()
        results = refused + self._publish_and_collect()
        ended = time.monotonic()
        if log.isEnabledFor(logging.DEBUG):
            self.spent.update({"steps": 1, "rows": self.sequences, "admitting": started - began,
                               "prefill" if turn else "decode": joined - started, "leaving": left_s,
                               "joining": publishing - joined, "publishing": ended - publishing})
        if ended - began > SLOW_STEP_S and log.isEnabledFor(logging.DEBUG):
            done = (f"prefill of {len(turn)} prompts, {sum(n for _, n in turn)} tokens" if turn
                    else f"decode of {self.sequences} sequences")
            log.debug("slow step: %.0f ms, %s (%d preparing, %d waiting); admitting %.0f ms, the %s %.0f ms "
                      "(of which leaving %.0f ms), joining %.0f ms, publishing %.0f ms",
                      1000 * (ended - began), done, len(self.preparing), len(self.waiting), 1000 * (started - began),
                      "turn" if turn else "step", 1000 * (joined - started), 1000 * left_s,
                      1000 * (publishing - joined), 1000 * (ended - publishing))
        return results

    def _prefill_turn_due(self) -> list[tuple[Prompt, int]]:
        """The prompt-processing turn to take now, if one is due: always when nobody decodes, at once for
        a new request's prompt that one turn finishes, else once the decoders have had as long as
        the last turn took (prompt processing gets at most half of the time)."""
        decoding = self._decoding()
        started = decoding + Counter(start.task for start in self.ready)
        room = sum(started.values()) < self.max_batch  # a request with nothing started may always start
        eligible = [p for p in self.prefilling if room or not started[p.task]]
        turn = prefill.plan(eligible, started, PREFILL_CHUNK, self.burst_tokens)
        if not turn or not decoding:
            return turn
        first, tokens = turn[0]
        # A new request whose whole prompt one turn processes goes at once; the last chunk of a long one
        # waits its turn like the others (it would hold the decoders up a second turn in a row).
        new = not started[first.task] and tokens == first.left and not first.turns
        return turn if new or time.monotonic() >= self.next_turn_at else []

    def _prefill(self, turn: list[tuple[Prompt, int]]) -> None:
        """Process the turn's prompts; the choices of those that are done draw their first tokens."""
        together = self._together([prompt for prompt, tokens in turn if tokens == prompt.left and prompt.plain])
        done = []  # (prompt, the logits at its last token)
        with mx.stream(self.stream):
            if together:
                done += zip(together, prefill.feed_together(self.model, together), strict=True)
            for prompt, tokens in turn:
                prompt.turns += 1
                if prompt not in together:
                    logits = prompt.feed(self.model, tokens)
                    if logits is not None:
                        done.append((prompt, logits))
            if done:
                self._first_tokens(done)

    def _first_tokens(self, done: list[tuple[Prompt, mx.array]]) -> None:
        """Each choice of the processed prompts draws its first token from its prompt's last logits (one
        sampling computation for all, as a decode step's) and hands it out; those that go on get ready to
        decode, those that end at it (an end of sequence, a budget of one) keep their caches. Drawn here,
        a first token does not wait for the batch's next decode step (~10 ms beside 64 rows on a GPU, a
        tenth of a second and more on a CPU)."""
        starts = [(start, prompt, logits) for prompt, logits in done for start in prompt.ready()]
        for prompt, _ in done:
            self.prefilling.remove(prompt)
        rows = sampling.BatchSampler(self.vocab)
        rows.extend([start.row for start, _, _ in starts], [prompt.fed[:-1] for _, prompt, _ in starts])
        last = mx.array([prompt.fed[-1] for _, prompt, _ in starts], mx.uint32)
        logits = rows.process(mx.stack([logits for _, _, logits in starts]), last, [False] * len(starts))
        logprobs = logits - cpu_math.logsumexp(logits)[:, None]
        tokens = rows.sample(logprobs).tolist()
        ended = []
        for row, ((start, _, _), token) in enumerate(zip(starts, tokens, strict=True)):
            finish = "stop" if token in self.decoder.eos else ("length" if start.budget <= 1 else None)
            wanted = start.task.request.sampling.logprobs is not None
            if start.seq.advance(token, finish, logprobs[row] if wanted else None):
                ended.append((start.own_cache(), start.fed, start.seq.cache_key))
            else:
                start.first = token
                self.ready.append(start)
            timeline = self.timelines.get(start.task)
            if timeline is not None and timeline.first is None:
                timeline.first, timeline.turns = time.monotonic(), self.turns - timeline.turns
        if ended:  # their caches serve later requests that start the same way (`keep_left`)
            self.leaving.append(ended)

    def _together(self, whole: list[Prompt]) -> list[Prompt]:
        """The prompts of a turn to process in one pass: those that fit MERGE_BYTES once their cached
        prefixes are padded to the longest (shortest prefixes first); none if only one does."""
        whole = sorted(whole, key=lambda p: len(p.fed))
        for n in range(len(whole), 1, -1):
            if n * max(len(p.fed) + p.left for p in whole[:n]) * self.kv_per_token <= MERGE_BYTES:
                chosen = whole[:n]
                prefill.share_prefixes(chosen)
                # Those resuming from one entry side by side: merge_rows copies each such run once per layer.
                return sorted(chosen, key=lambda p: (len(p.fed), prefill.prefix_source(p) or 0))
        return []

    def _decode(self) -> float:
        """One token for every decoding sequence; those that finished leave (their caches are kept after their
        answers: `keep_left`). The seconds they took to leave the batch (for the slow-step log)."""
        began = time.monotonic()
        waited = self.decoder.waited_s
        tokens = self.decoder.step()
        if log.isEnabledFor(logging.DEBUG):
            self.spent["engine"] += time.monotonic() - began
            self.spent["engine_wait"] += self.decoder.waited_s - waited  # (of it, for the device)
        finished = [out.key for out in tokens if out.key.advance(out.token, out.finish_reason, out.logprobs)]
        if not finished:
            return 0.0
        began = time.monotonic()  # their caches serve later requests that start the same way (`keep_left`)
        if len(finished) == len(self.decoder):  # everyone leaves: the rows are cut from the cache later
            keys = [slot.key.cache_key for slot in self.decoder.slots]
            self.leaving.append((*self.decoder.clear(), keys))
        else:  # cut now: the rows that stay are filtered out of the same layers
            gone = set(map(id, finished))
            keys = [slot.key.cache_key for slot in self.decoder.slots if id(slot.key) in gone]  # in the decoder's order
            kept = self.decoder.remove(finished, keep_caches=True)
            self.leaving.append([(cache, fed, key) for (cache, fed), key in zip(kept, keys, strict=True)])
        return time.monotonic() - began

    def keep_left(self) -> None:
        """Keep the caches of the sequences that left at this step, once their requests are answered (the
        scheduler calls it after ending them): at 64 streams ending together, cutting and evaluating their
        caches took ~90 ms on the H100, and every answer waited for it."""
        if not self.leaving:
            return
        began = time.monotonic()
        kept = []
        for left in self.leaving:
            if isinstance(left, tuple):  # a cache as the decoder left it, every row of it leaving
                cache, batched, fed, keys = left
                kept += zip(kept_rows(cache, list(range(len(fed)))) if batched else [cache], fed, keys, strict=True)
            else:
                kept += left
        self.leaving = []
        self._keep(kept)
        if log.isEnabledFor(logging.DEBUG):
            self.spent["keeping"] += time.monotonic() - began

    def _keep(self, kept: list[tuple[list, list[int], str | None]]) -> None:
        """Put finished sequences' caches in the prompt cache (cache, its tokens, its key: None for the batch's
        own, an image chat's for its images: `vision_batch.Media.namespace`). Each is a row cut from the batch's
        buffers: evaluated now, it becomes a copy of its own; left lazy, the kept entry would hold
        the whole batch's keys and values for as long as it stays (GiBs, never freed while idle).
        One evaluation for all of them: each is a wait for the device. Kept caches never crowd out
        running requests (`_trim_kept`)."""
        if not kept:
            return
        mx.eval([c.state for cache, _, _ in kept for c in cache])
        for cache, tokens, key in kept:
            self.prompt_cache.insert_cache(key or self.cache_key, list(tokens), cache)
            if self.disk and key is None:  # written by the disk tier's thread; the MLX thread goes on
                self.disk.save(self.disk_ns, list(tokens), cache)
        self._trim_kept()

    def _start_ready(self) -> None:
        """Start the ready choices that have room to decode: the requests with the fewest decoding
        first, and any request's first whatever the room (so none waits for another's choices)."""
        if not self.ready:
            return
        decoding = self._decoding()
        total = sum(decoding.values())
        joining = []
        for start in sorted(self.ready, key=lambda s: (decoding[s.task], s.order)):
            if decoding[start.task] and total >= self.max_batch:
                continue
            joining.append(start)
            decoding[start.task] += 1
            total += 1
        self.ready = [start for start in self.ready if start not in joining]
        # The choices of prompts processed in one pass join with that pass's batch cache as it is, when all
        # of them join now; the others with caches of their own (cut out of it where they still are in one).
        passes: dict[Together, list[Start]] = {}
        for start in joining:
            if start.in_pass is not None:
                passes.setdefault(start.in_pass[0], []).append(start)
        whole = [starts for together, starts in passes.items() if len(starts) == together.rows > 1]
        in_whole = {start for starts in whole for start in starts}
        for starts in whole:
            together = starts[0].in_pass[0]
            starts.sort(key=lambda start: start.in_pass[1])
            self.decoder.insert_many([self._joining(start, None) for start in starts], together.cache)
            for start in starts:
                start.in_pass = None
        cut = [start.own_cache() for start in self.ready if start.in_pass is not None]
        if cut:  # waiting for room: copies of their own now, which do not keep the pass's cache alive
            mx.eval([c.state for cache in cut for c in cache])
        self.decoder.insert_many([self._joining(start, start.own_cache()) for start in joining
                                  if start not in in_whole])

    @staticmethod
    def _joining(start: Start, cache: list | None) -> Joining:
        """A ready choice as it joins the decoder, with its cache (None: a row of the batch cache it joins with)."""
        return Joining(start.seq, cache, start.fed, start.first, start.budget, start.row,
                       start.task.request.sampling.logprobs is not None)

    def _trim_kept(self) -> None:
        """Kept caches never crowd out running requests."""
        if self.prompt_cache.nbytes:
            self.prompt_cache.trim_to(n_bytes=max(0, self._kv_memory() - sum(self.reserved.values())))

    def _prompt(self, task, index: int, ids: list[int], budget: int, grammar, media=None) -> Prompt:
        """One input of a request and its `n` choices, resuming from the longest cached prefix of it (an image
        chat's from one with the same images: `media`, its vision_batch.Media)."""
        request = task.request
        key = media.namespace(self.cache_key) if media is not None else None
        cache, rest = self.prompt_cache.fetch_nearest_cache(key or self.cache_key, ids)
        if cache is not None and not rest:  # the whole prompt is cached: its last token must be fed again
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = ids[-1:]
            else:
                cache, rest = None, ids
        cached = len(ids) - len(rest)
        order = next(self._order)
        starts = []
        thinking = reasoning.plan(request, self.tokenizer, ids)
        for copy in range(request.n):
            # A grammar's failure ends this sequence, not the batch (its request is told: _outcome).
            constraint = sampling.make_grammar(request.sampling, self.tokenizer, self.vocab, grammar, strict=False)
            row = sampling.row_for(request.sampling, self.vocab, copy,
                                   reasoning.gate(thinking, self.tokenizer, self.vocab, constraint, budget))
            seq = Sequence(task, index * request.n + copy, len(ids), cached, self.tokenizer.detokenizer,
                           textgen.StopBuffer(request.sampling.stop), tokenizer=self.tokenizer,
                           tools=toolcalls.for_request(request, self.tokenizer), grammar=row.grammar,
                           thoughts=reasoning.thoughts(thinking), cache_key=key)
            starts.append(Start(seq, budget, row, order))
        cache = cache if cache is not None else quantized_kv.make_cache(self.model, self.kv)
        prompt = Prompt(task, starts, cache, ids[:cached], list(rest), order, namespace=key or self.cache_key)
        if media is not None and vision_batch.has_images(rest, self.vision.image_token):
            prompt.embed = vision_batch.Pending(self.vision, ids, media)  # (not when its images are all cached)
        return prompt

    def _publish_and_collect(self) -> list[tuple[object, Outcome | Exception]]:
        """Hand the deltas that are due to the publishing thread (one round trip for all); return the requests
        that ended: finished, or canceled by their client (a reply to their deltas said so)."""
        now, due, ended = time.monotonic(), [], []
        for member in self.members.values():
            if member.done:
                ended.append((member.task, self._outcome(member)))
            elif now - member.last_sent >= self.interval and any(s.pending_any for s in member.sequences):
                due.append(member)
        if due:
            self._send([(m.task, self._deltas(m)) for m in due])
            for member in due:
                member.last_sent = now
        if self.publishing is not None:
            self.canceled |= self.publishing.collect()
        if self.canceled:
            finished = {task for task, _ in ended}
            for member in self.members.values():
                if member.task.run.job_id in self.canceled and member.task not in finished:
                    tokens = sum(s.tokens for s in member.sequences)
                    ended.append((member.task, Canceled(f"canceled after {tokens} generated tokens")))
            self.canceled = set()  # each one ended now, or already ending, or gone
        for task, result in ended:
            timeline = self.timelines.pop(task, None)
            if timeline is not None:
                queued = "-" if task.waited_s is None else f"{1000 * task.waited_s:.1f} ms"
                member = self.members.get(task)
                prompts = {s.index // task.request.n: s.prompt_tokens for s in member.sequences} if member else {}
                prompt = sum(prompts.values())
                log.debug("text request %s (%d prompt tokens): %s in its queue, %s", task.job.id, prompt, queued,
                          timeline)
            if isinstance(result, Exception):
                self.remove(task)
            self.members.pop(task, None)
            self.reserved.pop(task, None)
        return ended

    def _send(self, batches: list) -> None:
        """Hand several requests' deltas to the publishing thread (one round trip for all; cancels come back in
        its replies, collected at the next steps)."""
        now = time.time()
        for task, _ in batches:
            task.run.first_output_at = task.run.first_output_at or now
        if self.publishing is None:
            self.publishing = BackgroundPublisher(batches[0][0].run.publisher)
        self.canceled |= self.publishing.submit([(task.run.job_id, events) for task, events in batches])

    def flush(self) -> None:
        """Wait until every delta handed over is published: the requests that end now are answered after them."""
        if self.publishing is not None:
            self.canceled |= self.publishing.flush()

    @staticmethod
    def _deltas(member: Member) -> list:
        events = [event for s in member.sequences
                  for event in choice_events(s.index, s.pending_reasoning, s.pending, s.pending_logprobs,
                                             s.pending_calls)]
        for seq in member.sequences:
            seq.pending, seq.pending_reasoning, seq.pending_logprobs, seq.pending_calls = "", "", [], []
        return events

    def _outcome(self, member: Member) -> Outcome | Exception:
        """The answer of a finished request; its last deltas go out with it in one round trip. A request
        one of whose sequences its grammar could not follow ends with that error instead."""
        request = member.task.request
        failed = next((s.grammar.error for s in member.sequences if s.grammar and s.grammar.error), None)
        if failed:
            from workers.backends.grammar import GrammarFailed

            return GrammarFailed(failed)
        wanted = request.sampling.logprobs is not None
        choices = [Choice(s.index, "".join(s.parts), s.finish_reason, s.logprobs if wanted else None,
                          s.tool_calls or None, s.stop_sequence, s.reasoning_text,
                          s.thoughts.tokens if s.thoughts else 0) for s in member.sequences]
        prompts = {s.index // request.n: s for s in member.sequences}  # a prompt counts once for its n choices
        result = TextResult(request.model.id, choices, sum(s.prompt_tokens for s in prompts.values()),
                            sum(s.tokens for s in member.sequences), int(time.time()),
                            cached_tokens=sum(s.cached_tokens for s in prompts.values()))
        return Outcome(result.as_dict(), before=self._deltas(member))

    def close(self) -> None:
        """Give back what decoding held (the last request has left)."""
        self.keep_left()
        if self.publishing is not None:
            self.publishing.close()
            self.publishing = None
        if self._old_wired_limit is not None:
            mx.synchronize(self.stream)
            mx.set_wired_limit(self._old_wired_limit)
            self._old_wired_limit = None
