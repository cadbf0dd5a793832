"""The scheduler's admission policy: which queued job joins the work in progress, from which queue and
when, and whose turn the next piece of work is.

- **Joining.** With nothing running, the worker waits on its queues (RQ's `dequeue_any`, interactive
  first). While work runs, the queues are looked at every ADMIT_EVERY_S (the first ADMIT_DEPTH jobs
  of each) for work that can join: text while the batches hold fewer than MLXQ_MAX_BATCH requests
  and none waits for memory, a solo task (a transcription...) when its lane's slot is free and, for
  the batch lane, the interactive one is too; while no text can join, every FULL_LOOK_S, and at once
  after a request ends. A chat may overtake a transcription still waiting in the same queue.
- **Turns.** Text batches take turns step by step. While text decodes, a solo task still gets a
  piece after every SPEECH_TURN_S of it (so text waits at most one window, and a long transcription
  keeps going), and a text request on a model that cannot batch every other turn; with no text, a
  solo task's pieces follow one another, the interactive one's first.

The policy runs nothing itself: it reads the work in progress, and hands the jobs it takes to be
begun, through `Floor`, which the scheduler (workers/scheduler.py) implements; the scheduler tells
it what each piece cost (`ran_text`, `ran_solo`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import redis
from rq import Queue
from rq.job import Job

from jobs import queues
from workers import rqjobs

if TYPE_CHECKING:  # only named in annotations (the batch modules load MLX)
    from workers.backends.embeddings import EmbeddingBatch
    from workers.backends.textbatch import TextBatch
    from workers.running import Task

POLL_S = 1
"""Longest wait for a job while the worker has nothing to do (then it looks again)."""

ADMIT_EVERY_S = 0.01
"""While work runs, how often the queues are looked at for work that could join it."""

FULL_LOOK_S = 0.1
"""How often while no text request can join (the batches full, or one waiting for memory): a transcription
waits that much longer to start, and a decode step at 64 streams no longer waits for a Redis round trip every
10 ms (~1 ms of a 10 ms step on a GPU host). The look comes at once when a request ends (`look_now`)."""

ADMIT_DEPTH = 64
"""How far into each queue a look reaches (a chat may overtake transcriptions waiting before it): as far
as a GPU worker's default batch (64), so a burst of chats joins in one look, not four 10 ms apart."""

SPEECH_TURN_S = 1.0
"""While text decodes, a transcription gets its next window after this much decoding."""

TEXT_KINDS = frozenset({queues.CHAT_COMPLETION, queues.TEXT_COMPLETION, queues.VISION_CHAT})
"""The RQ function names of requests that join a text batch (when their model can batch)."""

MAX_EMBEDDING_REQUESTS = 256
"""How many embedding requests the embedding batches may hold together (their inputs wait there, not in the
queue, so that many small requests share passes)."""


class Floor(Protocol):
    """The work in progress, as the admission policy sees it and hands it new jobs."""

    max_batch: int
    """How many text requests the batches may hold together."""

    def active(self) -> list[Task]:
        """Every task in progress."""

    def batches(self) -> list[TextBatch]:
        """The text batches (one per model), with or without members."""

    def embedders(self) -> list[EmbeddingBatch]:
        """The embedding batches (one per model), with or without members."""

    def solo_in(self, lane: str) -> Task | None:
        """The solo task of a lane (`interactive` or `batch`), if any."""

    def held(self) -> int:
        """How many requests taken as text wait for a solo lane (their model could not batch them)."""

    def begin(self, job: Job, queue: Queue) -> None:
        """Start a job taken off `queue` (or fail it, if it cannot run)."""

    def begin_many(self, jobs: list[Job], queue: Queue) -> None:
        """Start jobs taken together off `queue` (each as `begin`)."""


class Admission:
    """Takes jobs off the queues when they can join, and picks the next piece of work."""

    def __init__(self, floor: Floor, conn: redis.Redis, queue_list: list[Queue], burst: bool = False):
        self.floor, self.conn, self.queues = floor, conn, queue_list
        self.wait_s = None if burst else POLL_S  # burst mode never waits for a job
        self._kinds: dict[str, str | None] = {}
        self._next_look = 0.0
        self._text_since_solo = 0.0  # seconds of batch steps since a solo task last had a piece
        self._turn = 0
        self._batch_turn = 0

    def admit(self) -> bool:
        """Start what can start: anything when idle (waiting for it), else what fits beside the work."""
        if not self.floor.active():
            taken = rqjobs.take(self.queues, self.conn, self.wait_s)
            if taken is None:
                return False
            self.floor.begin(*taken)
            # What came with it joins it at once: several queued embedding requests (each done in one step) would
            # otherwise be taken one at a time, a step each.
            self._next_look = 0.0
            self._look()
            return True
        if time.monotonic() < self._next_look:
            return False
        return self._look()

    def _look(self) -> bool:
        """Take what can join the work in progress from the first ADMIT_DEPTH jobs of each queue."""
        self._next_look = time.monotonic() + (ADMIT_EVERY_S if self._text_room() else FULL_LOOK_S)
        took = False
        for queue, ids in rqjobs.peek(self.queues, self.conn, ADMIT_DEPTH):
            together = []  # text and embeddings, taken together (a burst of chats: two round trips, not two each)
            texts, embeddings = self._text_room(), self._embedding_room()
            for job_id in ids:
                kind = self._kind(job_id, ids)
                if kind in TEXT_KINDS:
                    if texts > 0:
                        together.append(job_id)
                        texts -= 1
                elif kind == queues.EMBEDDING:
                    if embeddings > 0:
                        together.append(job_id)
                        embeddings -= 1
                elif self._has_room(queue.name):
                    job = rqjobs.claim(queue, job_id)
                    if job is not None:
                        self.floor.begin(job, queue)
                        took = True
            claimed = rqjobs.claim_many(queue, together)
            if claimed:
                self.floor.begin_many(claimed, queue)
                took = True
        return took

    def look_now(self) -> None:
        """Look at the queues at the next `admit`, however recent the last look."""
        self._next_look = 0.0

    def pick(self) -> TextBatch | EmbeddingBatch | Task | None:
        """The next piece of work: a batch to step, or a solo task whose piece is due (None: nothing runs)."""
        solo = self.floor.solo_in(queues.INTERACTIVE) or self.floor.solo_in(queues.BATCH)
        batches = [batch for batch in (*self.floor.batches(), *self.floor.embedders()) if len(batch)]
        if not batches:
            return solo
        self._turn += 1
        if solo is not None:
            text_solo = solo.request is not None and solo.request.kind in ("text", "multimodal")
            if (text_solo and self._turn % 2) or self._text_since_solo >= SPEECH_TURN_S:
                return solo
        # Batches take turns on a count of their own: on the shared one, a solo text task's every other
        # turn would leave every other batch out.
        self._batch_turn += 1
        return batches[self._batch_turn % len(batches)]

    def ran_text(self, seconds: float) -> None:
        """A batch step took `seconds` (they count towards a solo task's next turn)."""
        self._text_since_solo += seconds

    def ran_solo(self) -> None:
        """A solo task had a piece: text gets SPEECH_TURN_S of steps before its next one."""
        self._text_since_solo = 0.0

    def _kind(self, job_id: str, neighbours: list[str]) -> str | None:
        """A queued job's kind (its RQ function name), fetched once for it and the jobs around it."""
        if job_id not in self._kinds:
            if len(self._kinds) > 4096:
                self._kinds.clear()
            self._kinds.update(rqjobs.kinds([i for i in neighbours if i not in self._kinds], self.conn))
        return self._kinds.get(job_id)

    def _text_room(self) -> int:
        """How many more text requests may join the batches now (none while one waits for memory)."""
        batches = self.floor.batches()
        if any(b.waiting for b in batches):
            return 0
        return max(0, self.floor.max_batch - sum(len(b) for b in batches) - self.floor.held())

    def _embedding_room(self) -> int:
        """How many more embedding requests may join the embedding batches now."""
        return max(0, MAX_EMBEDDING_REQUESTS - sum(len(b) for b in self.floor.embedders()))

    def _has_room(self, queue: str) -> bool:
        """Whether a solo job (not text: `_text_room`) from `queue` can join what runs now."""
        lane = queues.lane_of(queue)  # a model's own queue shares its lane's slot
        interactive = self.floor.solo_in(queues.INTERACTIVE)
        return self.floor.solo_in(lane) is None and (lane == queues.INTERACTIVE or interactive is None)
