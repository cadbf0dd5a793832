"""The scheduler: the worker's main loop, the one thread that touches MLX, and the execution of its work.

It takes jobs from the queues when its admission policy says so (workers/admission.py: which job
joins, from which queue, when, and whose turn the next piece is), parses each one's request once
(jobs.contract), and runs them:

- **Text** requests for one model decode together in that model's batch (workers/backends/
  textbatch.py): a request joins at the next step, leaves when it is done or canceled. One piece
  of work is one step of a batch, for everyone in it.
- **Embedding** requests for one model are encoded together in that model's embedding batch
  (workers/backends/embeddings.py): one piece of work is a few padded passes over the oldest inputs.
- **Solo** requests (transcriptions, and text on a model that cannot batch) run one per lane, in
  pieces (a backend's `run`, workers/backends/base.py): the interactive one before the batch one.

A job's deadline (its RQ timeout) is checked between pieces; nothing interrupts a piece from
outside. A warm stop takes no new job, lets text finish and hands a resumable transcription back
to the queue at its next window (jobs.lifecycle.continue_job); a cold stop ends everything with
`worker_shutdown`. A Redis outage longer than the connection's own retries is waited out, then what
can resume is handed back and the rest fails.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque

import redis
from rq import Queue
from rq.job import Job

from jobs import contract, queues
from jobs.errors import InvalidRequest, JobError, JobTimeout, WorkerShutdown
from jobs.lifecycle import JobRun
from jobs.settings import Settings
from workers import rqjobs, worker_metrics
from workers.admission import Admission
from workers.backends import prompt_disk, vision_batch
from workers.backends.base import Outcome
from workers.backends.embeddings import PASS_TOKENS_CPU, PASS_TOKENS_GPU, EmbeddingBatch
from workers.backends.prompt_cache import PromptCache
from workers.backends.textbatch import TextBatch, batchable
from workers.models import batch_key
from workers.running import Task, hand_back, record_many, resumable, tell_many

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
LOG_SPENT_EVERY_S = 2.0
"""At DEBUG level, how often the loop logs where its time went (per batch step, by part)."""
EXPIRY_EVERY_S = 1.0
"""How often the scheduler looks for models idle past their keep-alive (MLXQ_MODEL_TTL_S, a request's keep_alive)."""


class Scheduler:
    """Runs the worker's jobs through the backends until stopped (the admission policy's `Floor`)."""

    def __init__(self, conn: redis.Redis, settings: Settings, models, backends: dict, name: str,
                 burst: bool = False, max_batch: int = 8, queue_names=queues.WORKER_QUEUES, serves=None):
        self.conn, self.settings, self.models, self.backends = conn, settings, models, backends
        self.name, self.burst, self.max_batch = name, burst, max_batch
        self.serves = serves  # the model ids this worker is dedicated to (None: any model)
        self.queues = {queue: queues.get_queue(queue, conn) for queue in queue_names}
        self.text: dict[str, TextBatch] = {}
        self.embed: dict[str, EmbeddingBatch] = {}
        self.solo: dict[str, Task | None] = {queues.INTERACTIVE: None, queues.BATCH: None}
        # Requests taken as text whose model could not batch them (a vision model that is not twinned), while their
        # lane ran another: each runs when the lane frees, in order.
        self.waiting_solo: dict[str, deque[Task]] = {queues.INTERACTIVE: deque(), queues.BATCH: deque()}
        self.prompt_cache = PromptCache(max_size=64, max_bytes=settings.prompt_cache_mb * 2**20)
        self.prompt_disk = prompt_disk.open_tier(settings)  # its disk tier (None: off, or another worker's)
        # On a GPU what waits is counted on a thread of its own (workers/queue_watch.py): a look there is ~0.5 ms of a
        # ~10 ms step. Not on a CPU, where a look is ~0.5 % of a ~100 ms step: nothing to gain for 200 Redis round
        # trips a second per busy worker.
        self.on_gpu = models.platform.backend in ("cuda", "metal")
        self.admission = Admission(self, conn, list(self.queues.values()), burst, name=name, watch=self.on_gpu)
        self.stopping = self.cold = False
        self._next_expiry = 0.0
        self._spent, self._spent_since = Counter(), time.monotonic()  # DEBUG: where the loop's time goes
        self._lock = threading.Lock()
        self._running: set[Task] = set()  # every task from its start to its end
        models.in_use = self._models_in_use  # the model manager never unloads these (admin unload)
        models.adapters_in_use = self._adapters_in_use  # nor unmounts these

    def active(self) -> list[Task]:
        """The tasks in progress (the heartbeat thread reads them too)."""
        with self._lock:
            return list(self._running)

    def batches(self) -> list[TextBatch]:
        """The text batches, one per model and adapter."""
        return list(self.text.values())

    def embedders(self) -> list[EmbeddingBatch]:
        """The embedding batches, one per model."""
        return list(self.embed.values())

    def _batched_paths(self) -> set[str]:
        """The directories of the models the batches decode or encode with (never evicted to load another)."""
        return {str(b.resident.info.path) for b in (*self.text.values(), *self.embed.values())}

    def solo_in(self, lane: str) -> Task | None:
        """The solo task of a lane, if any."""
        return self.solo[lane]

    def held(self) -> int:
        """How many requests wait for a solo lane (taken as text, their model could not batch them)."""
        return sum(len(line) for line in self.waiting_solo.values())

    def running_by_owner(self) -> Counter[str]:
        """How many tasks in progress each key has (its fair share when jobs are taken: workers/admission.py)."""
        return Counter(rqjobs.owner_of(task.job) for task in self.active())

    def stop(self, cold: bool = False) -> None:
        """Ask the loop to stop: warm (finish text, hand back a transcription) or cold (end it all now)."""
        self.stopping = True
        self.cold = self.cold or cold

    def run(self) -> None:
        """Take and run jobs until stopped (or, in burst mode, until there is nothing left)."""
        try:
            while True:
                try:
                    if self.cold:
                        return self._end_all(WorkerShutdown("the worker shut down while running this job"))
                    if not self.step() and (self.stopping or self.burst):
                        return self._close_prompt_disk()
                except REDIS_DOWN as exc:
                    self._ride_out_redis(exc)
        finally:
            try:
                self.admission.forget()  # its peers stop leaving it a share
            except REDIS_DOWN:
                pass  # (its entry goes stale in seconds)

    def _close_prompt_disk(self) -> None:
        """At a warm stop (or the end of a burst), write the prompt cache's entries that are not on disk yet (a
        cold stop does not wait for that)."""
        if self.prompt_disk is not None:
            self.prompt_disk.flush(self.prompt_cache)
            if self.stopping:
                self.prompt_disk.close()
                self.prompt_disk = None

    def step(self) -> bool:
        """Take jobs that can start, then run one piece of work; False if there was nothing to do."""
        began = time.monotonic()
        timing = log.isEnabledFor(logging.DEBUG)  # the loop's DEBUG summary (_log_spent)
        busy = timing and bool(self._running)  # (with nothing running, admission waits for work: not the loop's)
        took = not self.stopping and self.admission.admit()
        now = time.monotonic()
        if busy:
            self._spent["admission"] += now - began
        if now >= self._next_expiry:  # models idle past their keep-alive go (a look a second is plenty)
            self._next_expiry = now + EXPIRY_EVERY_S
            self.models.expire(now)
        unit = self.admission.pick()
        if unit is None:
            return took
        if isinstance(unit, (TextBatch, EmbeddingBatch)):
            self._step_batch(unit)
        else:
            self._advance(unit)
        if timing:
            self._log_spent(began, busy)
        return True

    def _log_spent(self, began: float, busy: bool) -> None:
        """At DEBUG level, every LOG_SPENT_EVERY_S and when the last request ends: where the loop's time went while
        text decoded, per step."""
        now = time.monotonic()
        if busy:
            self._spent["loop"] += now - began
        idle = busy and not self._running  # the last request ended: a summary of the burst (bench_concurrency's --breakdown)
        if now - self._spent_since < LOG_SPENT_EVERY_S and not idle:
            return
        spent = self._spent + sum((batch.spent for batch in self.text.values()), Counter())
        for batch in self.text.values():
            batch.spent.clear()
        steps = spent.pop("steps", 0)
        if steps:
            rows = spent.pop("rows", 0)
            parts = ", ".join(f"{name} {1000 * seconds / steps:.2f}" for name, seconds in spent.most_common())
            log.debug("the loop over %.1f s%s: %d batch steps of %.1f sequences on average; ms per step: %s",
                      now - self._spent_since, " (until idle)" if idle else "", steps, rows / steps, parts)
        self._spent, self._spent_since = Counter(), now

    def _models_in_use(self) -> set[str]:
        """Directories of the models that running requests use (batches and solo tasks)."""
        solo = {str(t.request.model.path) for t in self.solo.values() if t is not None and t.request is not None
                and t.request.kind != "control"}
        return self._batched_paths() | solo

    def _adapters_in_use(self) -> set[tuple[str, str]]:
        """(model directory, adapter) of the adapters that running requests decode with."""
        solo = {(str(t.request.model.path), t.request.adapter.name) for t in self.solo.values()
                if t is not None and t.request is not None and t.request.kind == "text" and t.request.adapter}
        return {(str(b.resident.info.path), b.resident.adapter) for b in self.text.values() if b.resident.adapter} | solo

    # --- starting jobs ---------------------------------------------------------------------------

    def begin(self, job: Job, queue: Queue, execution=None) -> None:
        """Record the job started (unless `execution` says it is), parse its request and put it where it runs
        (or fail it)."""
        execution = execution or rqjobs.start(job, self.name)
        payload = rqjobs.payload(job)
        run = JobRun(self.conn, self.settings, rqjobs.logical_id(job), rq_job_id=job.id,
                     has_record=bool(payload.get("is_async", True)))
        task = Task(job, execution, run, queue.name, float(job.timeout or 3600),
                    waited_s=worker_metrics.queue_wait_s(job))
        with self._lock:
            self._running.add(task)
        try:
            task.request = contract.parse(payload)
            task.backend = self.backends[task.request.kind]
            model = task.request.model
            kinds = getattr(task.backend, "model_kinds", {task.backend.model_kind})
            if model.kind not in kinds:  # the web checks this too; a payload may not come from it
                raise InvalidRequest(f"model {model.id!r} is a {model.kind} model; this endpoint needs a "
                                     f"{' or '.join(sorted(kinds))} model", code="invalid_model", param="model")
            run.start(attempts=getattr(task.request, "attempts", 1))
            if getattr(task.request, "keep_alive", None) is not None:  # Ollama's: the latest request's sets it
                self.models.keep_alive(model.path, task.request.keep_alive)
            batch = self._batch_for(task.request) if task.request.kind in ("text", "multimodal") else None
            if task.request.kind == "embedding":
                self._embedder_for(task.request).add(task)
            elif batch is not None:
                batch.add(task)
            else:
                self._set_solo(queues.lane_of(queue.name), task)
        except REDIS_DOWN:
            raise
        except Exception as exc:  # a request that cannot run (unreadable, too long, no such model...)
            return self._end(task, exc)
        log.info("%s: started %s (%s)", queue.name, job.id, job.description)

    def begin_many(self, jobs: list[Job], queue: Queue) -> None:
        """Start jobs taken together: recorded started in one round trip, then each begun."""
        for job, execution in zip(jobs, rqjobs.start_many(jobs, self.name), strict=True):
            self.begin(job, queue, execution)

    def _batch_for(self, request: contract.TextRequest | contract.MultimodalRequest) -> TextBatch | None:
        """The batch of the request's model and adapter, made when its first request comes (None: it cannot
        batch). Requests with another adapter, or none, decode in batches of their own. A chat on a vision model
        joins its model's batch when that model's language part decodes as text does (vision_batch.py) and the
        chat has no audio in it."""
        if request.kind == "multimodal" and (request.model.kind != "vision" or request.audio):
            return None
        adapter = getattr(request, "adapter", None)
        key = batch_key(request.model.path, adapter.name if adapter else None)
        if key not in self.text:
            resident = self.models.get(request.model, pinned=self._batched_paths(), adapter=adapter)
            vision = vision_batch.for_resident(resident) if request.model.kind == "vision" else None
            if request.model.kind == "vision" and vision is None:  # its chats run alone
                return None
            if not batchable(vision.model if vision is not None else resident.model):
                return None
            with self._lock:
                self.text[key] = TextBatch(resident, self.settings, self.prompt_cache, self.max_batch, self.models,
                                           self.prompt_disk, vision)
        return self.text[key]

    def _embedder_for(self, request: contract.EmbeddingRequest) -> EmbeddingBatch:
        """The embedding batch of the request's model, made (the model loaded) when its first request comes."""
        key = str(request.model.path)
        if key not in self.embed:
            resident = self.models.get(request.model, pinned=self._batched_paths())
            with self._lock:
                self.embed[key] = EmbeddingBatch(resident, PASS_TOKENS_GPU if self.on_gpu else PASS_TOKENS_CPU,
                                                 self.conn)
        return self.embed[key]

    def _set_solo(self, lane: str, task: Task) -> None:
        with self._lock:
            if self.solo[lane] is None:
                self.solo[lane] = task
            else:  # a text request on a model that cannot batch, while another runs: it runs next
                self.waiting_solo[lane].append(task)

    # --- running pieces --------------------------------------------------------------------------

    def _step_batch(self, batch: TextBatch | EmbeddingBatch) -> None:
        """One step of a batch: end the requests that finished, were canceled or ran out of time."""
        started = time.monotonic()
        try:
            ended = batch.step()
        except REDIS_DOWN:
            raise
        except Exception as exc:  # the model failed for everyone in the batch
            ended = [(task, exc) for task in batch.tasks]
            for task, _ in ended:
                batch.remove(task)
        now = time.monotonic()
        self.admission.ran_text(now - started)
        for task in batch.tasks:
            if now - task.started > task.timeout_s:
                batch.remove(task)
                ended.append((task, JobTimeout(f"the job ran past its time limit of {task.timeout_s:g}s")))
        if ended:
            batch.flush()  # their deltas, handed to the publishing thread, go out before their ends
        self._end_many(ended)
        if log.isEnabledFor(logging.DEBUG):
            self._spent["ending"] += time.monotonic() - now
        try:
            batch.keep_left()  # the caches of the sequences that left, once their answers are out
        except REDIS_DOWN:
            raise
        except Exception:  # noqa: BLE001 (a cache not kept is a prompt processed again later; nobody waits on it)
            log.exception("the caches of finished sequences could not be kept")
            batch.leaving = []
        if not len(batch):
            self._drop_batch(batch)

    def _drop_batch(self, batch: TextBatch | EmbeddingBatch) -> None:
        self._spent.update(batch.spent)  # (its part of the loop's time, for the next DEBUG summary)
        with self._lock:
            (self.embed if isinstance(batch, EmbeddingBatch) else self.text).pop(batch.key, None)
        batch.close()

    def _advance(self, task: Task) -> None:
        """Run one piece of a solo task; end it when it is done, fails or runs out of time."""
        started = time.monotonic()
        try:
            if task.used_s > task.timeout_s:
                raise JobTimeout(f"the job ran past its time limit of {task.timeout_s:g}s")
            if self.stopping and resumable(task):
                return self._hand_back(task)
            if task.gen is None:
                task.gen = task.backend.run(task.request, task.run, self.models)
            item = next(task.gen)
        except StopIteration:
            return self._end(task, RuntimeError("the backend ended without an answer"))
        except REDIS_DOWN:
            raise
        except Exception as exc:  # a client-facing error (jobs.errors) or an unexpected one: the job ends
            return self._end(task, exc)
        finally:
            self.admission.ran_solo()
            task.used_s += time.monotonic() - started
        if isinstance(item, Outcome):
            self._end(task, item)

    # --- ending tasks ----------------------------------------------------------------------------

    def _end(self, task: Task, result: Outcome | BaseException) -> None:
        """End a task with its answer or an error, then close its run and free its place (the answer is out first)."""
        self._end_many([(task, result)])

    def _end_many(self, ended: list[tuple[Task, Outcome | BaseException]]) -> None:
        """End the tasks of one step: every client is told first, then each end is recorded (64 chats
        ending together would otherwise each wait for the RQ bookkeeping of those before them)."""
        told = []
        try:
            for item in tell_many(ended):
                told.append(item)
        finally:  # those told before Redis went away are recorded too (or the outage's handling ends them)
            if told:
                record_many(told)  # in two round trips, however many
            for task, _, _ in told:
                self.release(task)

    def _hand_back(self, task: Task) -> None:
        """Stop a resumable task between pieces: a continuation goes on from its checkpoint."""
        hand_back(task)
        self.release(task)

    def release(self, task: Task) -> None:
        """Close a task's run (its backend's cleanup) and free its place."""
        try:
            if task.gen is not None:
                task.gen.close()
        except Exception:  # closing never decides the job's outcome, which is already recorded
            log.exception("closing the run of %s failed", task.job.id)
        self.admission.place_freed()  # its place is free: what waits may join at the next step
        with self._lock:
            self._running.discard(task)
            for lane, current in self.solo.items():
                if task in self.waiting_solo[lane]:
                    self.waiting_solo[lane].remove(task)
                if current is task:
                    self.solo[lane] = self.waiting_solo[lane].popleft() if self.waiting_solo[lane] else None
        for batch in [*self.text.values(), *self.embed.values()]:
            if task in batch.tasks:
                batch.remove(task)
                if not len(batch):
                    self._drop_batch(batch)

    def _end_all(self, reason: JobError) -> None:
        """Cold stop: end every task in progress with `reason`."""
        for task in self.active():
            self._end(task, reason)

    def _ride_out_redis(self, exc: Exception) -> None:
        """Redis stayed away past the connection's retries: wait for it, then settle the tasks in progress."""
        self._wait_for_redis(exc)
        for task in self.active():
            try:
                if resumable(task):
                    self._hand_back(task)  # nothing is lost: it resumes from its last checkpoint
                else:
                    self._end(task, JobError("the queue (Redis) was unreachable while this job ran", status=503,
                                             code="queue_unavailable"))
            except REDIS_DOWN:
                return  # gone again: the next round of the loop waits again

    def _wait_for_redis(self, exc: Exception) -> None:
        """Wait until Redis answers again (or a cold stop comes)."""
        log.error("Redis unreachable (%s); waiting for it to come back", exc)
        delay = 0.5
        while not self.cold:
            try:
                self.conn.ping()
                break
            except REDIS_DOWN:
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        log.warning("Redis is back")
