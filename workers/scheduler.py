"""The scheduler: the worker's main loop, the one thread that touches MLX.

It takes jobs from the queues (RQ's API, workers/rqjobs.py), parses each one's request once
(jobs.contract), and runs them:

- **Text** requests for one model decode together in that model's batch (workers/backends/
  textbatch.py): a request joins at the next step, leaves when it is done or canceled. One piece
  of work is one step of a batch, for everyone in it.
- **Solo** requests (transcriptions, and text on a model that cannot batch) run one per queue, in
  pieces (a backend's `run`, workers/backends/base.py): the interactive one before the batch one.

While text decodes, a transcription still gets a window after every SPEECH_TURN_S of it (so text
waits at most one window, and a long transcription keeps going); with no text, windows follow one
another. While anything runs, the queues are looked at every ADMIT_EVERY_S for work that can join:
text while the batches have room (MLXQ_MAX_BATCH), a transcription when its queue's solo slot is
free; a chat may overtake a transcription still waiting in the same queue. With nothing to do, the
scheduler waits on the queues.

A job's deadline (its RQ timeout) is checked between pieces; nothing interrupts a piece from
outside. A warm stop takes no new job, lets text finish and hands a resumable transcription back
to the queue at its next window; a cold stop ends everything with `worker_shutdown`. A Redis outage
longer than the connection's own retries is waited out, then what can resume is handed back.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from mlx_lm.models.cache import LRUPromptCache
from rq.job import Job

from jobs import contract, queues
from jobs.errors import InvalidRequest, JobError, JobTimeout, WorkerShutdown
from jobs.lifecycle import JobRun
from jobs.settings import Settings
from workers import rqjobs, worker_metrics
from workers.backends.base import Outcome
from workers.backends.textbatch import TextBatch, batchable
from workers.backends.textgen import reset_random_state
from workers.running import Task, fail, fail_all, finish, hand_back, resumable, ride_out_redis

log = logging.getLogger(__name__)

POLL_S = 1
"""Longest wait for a job while the worker has nothing to do (then it looks again)."""

ADMIT_EVERY_S = 0.02
"""While work runs, how often the queues are looked at for work that could join it."""

ADMIT_DEPTH = 16
"""How far into each queue a look reaches (a chat may overtake transcriptions waiting before it)."""

SPEECH_TURN_S = 1.0
"""While text decodes, a transcription gets its next window after this much decoding."""

TEXT_KINDS = frozenset({queues.CHAT_COMPLETION, queues.TEXT_COMPLETION})
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)


class Scheduler:
    """Runs the worker's jobs through the backends until stopped."""

    def __init__(self, conn: redis.Redis, settings: Settings, models, backends: dict, name: str,
                 burst: bool = False, max_batch: int = 8, queue_names=queues.WORKER_QUEUES, serves=None):
        self.conn, self.settings, self.models, self.backends = conn, settings, models, backends
        self.name, self.burst, self.max_batch = name, burst, max_batch
        self.serves = serves  # the model ids this worker is dedicated to (None: any model)
        self.queues = {queue: queues.get_queue(queue, conn) for queue in queue_names}
        self.text: dict[str, TextBatch] = {}
        self.solo: dict[str, Task | None] = {queues.INTERACTIVE: None, queues.BATCH: None}
        self.prompt_cache = LRUPromptCache(max_size=64, max_bytes=settings.prompt_cache_mb * 2**20)
        self.stopping = self.cold = False
        self._lock = threading.Lock()
        self._running: set[Task] = set()  # every task from its start to its end
        self._kinds: dict[str, str | None] = {}
        self._next_look = 0.0
        self._text_since_solo = 0.0  # seconds of batch steps since a solo task last had a piece
        self._turn = 0
        models.in_use = self._models_in_use  # the model manager never unloads these (admin unload)

    def active(self) -> list[Task]:
        """The tasks in progress (the heartbeat thread reads them too)."""
        with self._lock:
            return list(self._running)

    def stop(self, cold: bool = False) -> None:
        """Ask the loop to stop: warm (finish text, hand back a transcription) or cold (end it all now)."""
        self.stopping = True
        self.cold = self.cold or cold

    def run(self) -> None:
        """Take and run jobs until stopped (or, in burst mode, until there is nothing left)."""
        while True:
            try:
                if self.cold:
                    return self._end_all(WorkerShutdown("the worker shut down while running this job"))
                if not self.step() and (self.stopping or self.burst):
                    return
            except REDIS_DOWN as exc:
                ride_out_redis(self, exc)

    def step(self) -> bool:
        """Take jobs that can start, then run one piece of work; False if there was nothing to do."""
        took = self._admit()
        unit = self._pick()
        if unit is None:
            return took
        if isinstance(unit, TextBatch):
            self._step_batch(unit)
        else:
            self._advance(unit)
        return True

    def _models_in_use(self) -> set[str]:
        """Directories of the models that running requests use (batches and solo tasks)."""
        solo = {str(t.request.model.path) for t in self.solo.values() if t is not None and t.request is not None
                and t.request.kind != "control"}
        return set(self.text) | solo

    # --- taking jobs ---------------------------------------------------------------------------

    def _admit(self) -> bool:
        """Start what can start: anything when idle (waiting for it), else what fits beside the work."""
        if self.stopping:
            return False
        if not self.active():
            taken = rqjobs.take(list(self.queues.values()), self.conn, None if self.burst else POLL_S)
            if taken is not None:
                self._begin(*taken)
            return taken is not None
        if time.monotonic() < self._next_look:
            return False
        self._next_look = time.monotonic() + ADMIT_EVERY_S
        took = False
        for queue, ids in rqjobs.peek(list(self.queues.values()), self.conn, ADMIT_DEPTH):
            for job_id in ids:
                if self._has_room(self._kind(job_id, ids), queue.name):
                    job = rqjobs.claim(queue, job_id)
                    if job is not None:
                        self._begin(job, queue)
                        took = True
        return took

    def _kind(self, job_id: str, neighbours: list[str]) -> str | None:
        """A queued job's kind (its RQ function name), fetched once for it and the jobs around it."""
        if job_id not in self._kinds:
            if len(self._kinds) > 4096:
                self._kinds.clear()
            self._kinds.update(rqjobs.kinds([i for i in neighbours if i not in self._kinds], self.conn))
        return self._kinds.get(job_id)

    def _has_room(self, kind: str | None, queue: str) -> bool:
        lane = queues.lane_of(queue)  # a model's own queue shares its lane's slot
        if kind in TEXT_KINDS:  # while a request waits for memory, no other joins
            batches = self.text.values()
            return sum(len(b) for b in batches) < self.max_batch and not any(b.waiting for b in batches)
        return self.solo[lane] is None and (lane == queues.INTERACTIVE or self.solo[queues.INTERACTIVE] is None)

    def _begin(self, job: Job, queue) -> None:
        """Record the job started, parse its request and put it where it runs (or fail it)."""
        execution = rqjobs.start(job, self.name)
        payload = job.args[0] if job.args and isinstance(job.args[0], dict) else {}
        run = JobRun(self.conn, self.settings, str(payload.get("id") or job.id), rq_job_id=job.id,
                     has_record=bool(payload.get("is_async", True)))
        task = Task(job, execution, None, run, None, queue.name, float(job.timeout or 3600),
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
            batch = self._batch_for(task.request) if task.request.kind == "text" else None
            if batch is not None:
                batch.add(task)
            else:
                self._set_solo(queues.lane_of(queue.name), task)
        except REDIS_DOWN:
            raise
        except Exception as exc:  # a request that cannot run (unreadable, too long, no such model...)
            return fail(self, task, exc)
        log.info("%s: started %s (%s)", queue.name, job.id, job.description)

    def _batch_for(self, request) -> TextBatch | None:
        """The batch of the request's model, made when its first request comes (None: it cannot batch)."""
        key = str(request.model.path)
        if key not in self.text:
            resident = self.models.get(request.model, pinned=set(self.text))
            if not batchable(resident.model):
                return None
            with self._lock:
                self.text[key] = TextBatch(resident, self.settings, self.prompt_cache, self.max_batch, self.models)
        return self.text[key]

    def _set_solo(self, lane: str, task: Task) -> None:
        if self.solo[lane] is not None:  # a text request on a model that cannot batch, while another runs
            raise JobError("the worker is busy with another request that cannot share it; retry", status=503,
                           code="worker_busy")
        with self._lock:
            self.solo[lane] = task

    # --- running pieces --------------------------------------------------------------------------

    def _pick(self):
        """The next piece of work: a batch step, or a solo task's piece when it is due."""
        solo = self.solo[queues.INTERACTIVE] or self.solo[queues.BATCH]
        batches = [batch for batch in self.text.values() if len(batch)]
        if not batches:
            return solo
        self._turn += 1
        if solo is not None:
            text_solo = solo.request is not None and solo.request.kind in ("text", "multimodal")
            if (text_solo and self._turn % 2) or self._text_since_solo >= SPEECH_TURN_S:
                return solo
        return batches[self._turn % len(batches)]

    def _step_batch(self, batch: TextBatch) -> None:
        """One step of a batch: end the requests that finished, were canceled or ran out of time."""
        started = time.monotonic()
        try:
            ended = batch.step()
        except REDIS_DOWN:
            raise
        except Exception as exc:  # the model failed for everyone in the batch
            reset_random_state()
            ended = [(task, exc) for task in batch.tasks]
            for task, _ in ended:
                batch.remove(task)
        now = time.monotonic()
        self._text_since_solo += now - started
        for task in batch.tasks:
            if now - task.started > task.timeout_s:
                batch.remove(task)
                ended.append((task, JobTimeout(f"the job ran past its time limit of {task.timeout_s:g}s")))
        for task, result in ended:
            finish(self, task, result) if isinstance(result, Outcome) else fail(self, task, result)
        if not len(batch):
            self._drop_batch(batch)

    def _drop_batch(self, batch: TextBatch) -> None:
        with self._lock:
            self.text.pop(batch.key, None)
        batch.close()

    def _advance(self, task: Task) -> None:
        """Run one piece of a solo task; end it when it is done, fails or runs out of time."""
        started = time.monotonic()
        try:
            if task.used_s > task.timeout_s:
                raise JobTimeout(f"the job ran past its time limit of {task.timeout_s:g}s")
            if self.stopping and resumable(task) and task.gen is not None:
                return hand_back(self, task)
            if task.gen is None:
                task.gen = task.backend.run(task.request, task.run, self.models)
            item = next(task.gen)
        except StopIteration:
            return fail(self, task, RuntimeError("the backend ended without an answer"))
        except REDIS_DOWN:
            raise
        except Exception as exc:  # a client-facing error (jobs.errors) or an unexpected one: the job ends
            return fail(self, task, exc)
        finally:
            self._text_since_solo = 0.0  # text gets SPEECH_TURN_S of steps before the next piece
            task.used_s += time.monotonic() - started
        if isinstance(item, Outcome):
            finish(self, task, item)

    def release(self, task: Task) -> None:
        """Close a task's run (its backend's cleanup) and free its place."""
        try:
            if task.gen is not None:
                task.gen.close()
        except Exception:  # closing never decides the job's outcome, which is already recorded
            log.exception("closing the run of %s failed", task.job.id)
        with self._lock:
            self._running.discard(task)
            for lane, current in self.solo.items():
                if current is task:
                    self.solo[lane] = None
        for batch in list(self.text.values()):
            if task in batch.tasks:
                batch.remove(task)
                if not len(batch):
                    self._drop_batch(batch)

    def _end_all(self, reason: JobError) -> None:
        """Cold stop: end every task in progress with `reason`."""
        fail_all(self, self.active(), reason)
