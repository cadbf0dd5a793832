"""The scheduler's admission policy: which queued job joins the work in progress, from which queue and
when, and whose turn the next piece of work is.

- **Joining.** With nothing running, the worker waits on its queues (RQ's `dequeue_any`, interactive
  first). While work runs, the queues are looked at every ADMIT_EVERY_S (the first ADMIT_DEPTH jobs
  of each, FAIR_DEPTH of a batch queue) for work that can join: text while the batches hold fewer than
  MLXQ_MAX_BATCH requests and none waits for memory (interactive ones up to an eighth more while async
  ones fill them: `interactive_headroom`), a solo task (a transcription...) when its lane's slot is free
  and, for the batch lane, the interactive one is too; while no async text can join, every FULL_LOOK_S,
  and at once after a request ends. A chat may overtake a transcription still waiting in the same queue.
  With a `QueueWatch` (the worker's), a look that finds every queue empty is not made at all: a thread of its
  own counts what waits, and the scheduler's thread looks only when something does (workers/queue_watch.py).
- **Several workers.** Workers that take from the same queues write how many text requests each holds at
  every look, and a look takes at most an even share of what they all hold and what waits (`_share`).
- **Fair share.** Within a queue, jobs are taken round robin among the keys that submitted them, the key
  with the fewest tasks in progress per unit of its share first (`fair_order`; a key's `share`, jobs/limits.py,
  rides in its jobs' meta): one key's backlog cannot hold another's job back for more than one place.
- **Turns.** Text batches take turns step by step. While text decodes, a solo task still gets a
  piece after every SPEECH_TURN_S of it (so text waits at most one window, and a long transcription
  keeps going), and a text request on a model that cannot batch every other turn; with no text, a
  solo task's pieces follow one another, the interactive one's first.

The policy runs nothing itself: it reads the work in progress, and hands the jobs it takes to be
begun, through `Floor`, which the scheduler (workers/scheduler.py) implements; the scheduler tells
it what each piece cost (`ran_text`, `ran_solo`).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, deque
from typing import TYPE_CHECKING, Protocol

import redis
from rq import Queue
from rq.job import Job

from jobs import keys, queues
from workers import rqjobs
from workers.queue_watch import QueueWatch, load_entry

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
10 ms (~1 ms of a 10 ms step on a GPU host). The look comes at once when a request ends (`place_freed`)."""

INTERACTIVE_LOOK_S = 0.025
"""While no async text can join but interactive text still can (its headroom), how often the interactive queues
alone are looked at."""

ADMIT_DEPTH = 64
"""How far into each queue a look reaches (a chat may overtake transcriptions waiting before it): as far
as a GPU worker's default batch (64), so a burst of chats joins in one look, not four 10 ms apart."""

SPEECH_TURN_S = 1.0
"""While text decodes, a transcription gets its next window after this much decoding."""

TEXT_KINDS = frozenset({queues.CHAT_COMPLETION, queues.TEXT_COMPLETION, queues.VISION_CHAT})
"""The RQ function names of requests that join a text batch (when their model can batch)."""

FAIR_DEPTH = 512
"""How far into a batch queue a look reaches while text can join from it: another key's async job behind one
key's backlog of this many still gets the next place (a key's `queued` limit, jobs/limits.py, keeps backlogs
under it). Each job there is fetched once; later looks read only its id."""

LOAD_STALE_S = 3.0
"""A peer's load written longer ago than this is left out of the share (the peer died or stopped)."""

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

    def running_by_owner(self) -> Counter[str]:
        """How many tasks in progress each key has (`rqjobs.owner_of`)."""

    def begin(self, job: Job, queue: Queue) -> None:
        """Start a job taken off `queue` (or fail it, if it cannot run)."""

    def begin_many(self, jobs: list[Job], queue: Queue) -> None:
        """Start jobs taken together off `queue` (each as `begin`)."""


def interactive_headroom(max_batch: int) -> int:
    """How many interactive requests may join beyond max_batch while async ones fill the batches: an eighth."""
    return max(1, max_batch // 8)


def fair_order(candidates: list[tuple[str, str, float]], running: Counter[str]) -> list[str]:
    """Queued job ids (each with its owner and the owner's share, in queue order) in the order to take them: round
    robin among owners, weighted by their shares: the owner with the fewest tasks in progress (`running`) per unit
    of share first, ties to the one whose next job is older; an owner's own jobs in queue order. One key's backlog
    then takes one place in turn with every other key's (a key of share 2, two)."""
    lines: dict[str, deque[tuple[int, str]]] = {}
    shares: dict[str, float] = {}
    for position, (job_id, owner, share) in enumerate(candidates):
        lines.setdefault(owner, deque()).append((position, job_id))
        shares.setdefault(owner, share)
    if len(lines) < 2:
        return [job_id for job_id, _, _ in candidates]
    heap = [(running[owner] / shares[owner], line[0][0], owner, running[owner]) for owner, line in lines.items()]
    heapq.heapify(heap)
    order = []
    while heap:
        _, _, owner, count = heapq.heappop(heap)
        line = lines[owner]
        order.append(line.popleft()[1])
        if line:
            heapq.heappush(heap, ((count + 1) / shares[owner], line[0][0], owner, count + 1))
    return order


class Admission:
    """Takes jobs off the queues when they can join, and picks the next piece of work."""

    def __init__(self, floor: Floor, conn: redis.Redis, queue_list: list[Queue], burst: bool = False,
                 name: str | None = None, watch: bool = False):
        self.floor, self.conn, self.queues = floor, conn, queue_list
        self.name = name  # this worker's, under which it shares its load with its peers (None: it does not)
        self._loads_key = keys.worker_loads([q.name for q in queue_list])
        # `watch`: what waits is counted on a thread of its own (the worker's; the policy's tests look every time)
        self.watch = QueueWatch(conn, [q.key for q in queue_list], self._loads_key, name) if watch else None
        self.wait_s = None if burst else POLL_S  # burst mode never waits for a job
        self._described: dict[str, tuple[str | None, str, float]] = {}  # queued job id -> (kind, owner, share)
        self.headroom = interactive_headroom(floor.max_batch)
        self._next_look = self._next_quick_look = 0.0
        self._forced = False  # `look_now`: the next look is made whatever the watch counted
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
        now = time.monotonic()
        if self.watch is not None:
            self.watch.want()
            self.watch.load = self._text_load()
        due = now >= self._next_look
        if not due and not (now >= self._next_quick_look and self._text_room(queues.INTERACTIVE)):
            return False
        if self.watch is not None and not self._forced and self.watch.nothing_waits():
            return False  # (the look stays due: it comes at the first step after something is counted)
        self._forced = False
        return self._look(quick=not due)

    def _look(self, quick: bool = False) -> bool:
        """Take what can join the work in progress from the first jobs of each queue, fairly among keys (`quick`:
        of the interactive queues only, for the headroom interactive requests have beyond a batch full of async
        ones)."""
        # While no async text can join, the full look comes every FULL_LOOK_S (for a transcription); a quick one
        # every INTERACTIVE_LOOK_S in between, while interactive text can still join: a step of async requests is
        # taxed with one short round trip, and a synchronous chat waits a few ms to join, not 50 on average.
        now = time.monotonic()
        batch_room = self._text_room(queues.BATCH)
        self._next_quick_look = now + INTERACTIVE_LOOK_S
        if not quick:
            self._next_look = now + (ADMIT_EVERY_S if batch_room else FULL_LOOK_S)
        looked = [q for q in self.queues if not quick or queues.lane_of(q.name) == queues.INTERACTIVE]
        # Deep into the batch lane only when text from it can join: a key's job behind another's backlog.
        depths = [FAIR_DEPTH if batch_room and queues.lane_of(q.name) == queues.BATCH else ADMIT_DEPTH for q in looked]
        took = False
        running = self.floor.running_by_owner()
        peeked, peers = self._peek(looked, depths)
        described = {queue.name: [(job_id, *self._describe(job_id, ids)) for job_id in ids] for queue, ids in peeked}
        allowance = self._share(peers, sum(kind in TEXT_KINDS for found in described.values() for _, kind, _, _ in found))
        for queue, _ in peeked:
            together = []  # text and embeddings, taken together (a burst of chats: two round trips, not two each)
            lane = queues.lane_of(queue.name)
            texts, embeddings = min(self._text_room(lane), allowance), self._embedding_room()
            allowance -= texts
            for job_id in fair_order([(job_id, owner, weight) for job_id, _, owner, weight in described[queue.name]],
                                     running):
                kind, owner, _ = self._described[job_id]
                if kind in TEXT_KINDS:
                    if texts > 0:
                        together.append(job_id)
                        texts -= 1
                        running[owner] += 1
                elif kind == queues.EMBEDDING:
                    if embeddings > 0:
                        together.append(job_id)
                        embeddings -= 1
                        running[owner] += 1
                elif self._has_room(queue.name):
                    job = rqjobs.claim(queue, job_id)
                    if job is not None:
                        self.floor.begin(job, queue)
                        running[owner] += 1
                        took = True
            allowance += texts  # what this queue left of the allowance, for the next one
            claimed = rqjobs.claim_many(queue, together)
            if claimed:
                self.floor.begin_many(claimed, queue)
                took = True
        return took

    def _peek(self, looked: list[Queue], depths: list[int]) -> tuple[list[tuple[Queue, list[str]]], dict[str, int]]:
        """The first job ids of each queue looked at (as many as its depth), and the text requests each live worker
        that takes from the same queues holds (this one's written now), in one round trip."""
        with self.conn.pipeline(transaction=False) as pipe:
            if self.name is not None:
                pipe.hset(self._loads_key, self.name, load_entry(self._text_load()))
                pipe.expire(self._loads_key, 3600)
                pipe.hgetall(self._loads_key)
            for queue, depth in zip(looked, depths, strict=True):
                pipe.lrange(queue.key, 0, depth - 1)
            found = pipe.execute()
        peers = {}
        if self.name is not None:
            now = time.time()
            for name, value in found[2].items():
                count, _, at = (value.decode() if isinstance(value, bytes) else value).partition(":")
                if now - float(at) < LOAD_STALE_S:
                    peers[name.decode() if isinstance(name, bytes) else name] = int(count)
            found = found[3:]
        return [(queue, [i.decode() if isinstance(i, bytes) else i for i in ids])
                for queue, ids in zip(looked, found, strict=True)], peers

    def _share(self, peers: dict[str, int], waiting: int) -> int:
        """How many of the `waiting` text requests this worker may take now: all, alone; with peers on the same
        queues, up to an even share of what they all hold and what waits (a burst of chats spreads over the
        workers instead of filling the first one that looks; the others take the rest at their next look)."""
        if len(peers) < 2:
            return waiting
        fair = -(-(sum(peers.values()) + waiting) // len(peers))
        return max(0, fair - self._text_load())

    def _text_load(self) -> int:
        """The text requests this worker holds."""
        return sum(len(b) for b in self.floor.batches()) + self.floor.held()

    def forget(self) -> None:
        """Take this worker out of the loads its peers share by (it stops), and stop counting its queues."""
        if self.watch is not None:
            self.watch.stop()
        if self.name is not None:
            self.conn.hdel(self._loads_key, self.name)

    def look_now(self) -> None:
        """Look at the queues at the next `admit`, however recent the last look and whatever the watch counted."""
        self._next_look = 0.0
        self._forced = True

    def place_freed(self) -> None:
        """A request ended: the next look may come at the next `admit` (if the watch counts anything waiting)."""
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

    def _describe(self, job_id: str, neighbours: list[str]) -> tuple[str | None, str, float]:
        """A queued job's kind (its RQ function name), owner and the owner's share, fetched once for it and the jobs
        around it."""
        if job_id not in self._described:
            if len(self._described) > 8192:
                self._described.clear()
            self._described.update(rqjobs.describe([i for i in neighbours if i not in self._described], self.conn))
        return self._described.get(job_id, (None, "", 1.0))

    def _text_room(self, lane: str) -> int:
        """How many more text requests from `lane` may join the batches now (none while one waits for memory).

        Each lane may fill the batches (max_batch requests) by itself; with the batch lane's async requests
        filling them, interactive ones may still join, up to `headroom` more, so a synchronous call never
        waits for an async one to end (and then takes the place it frees first: its queue is looked at first)."""
        batches = self.floor.batches()
        if any(b.waiting for b in batches):
            return 0
        total = sum(len(b) for b in batches) + self.floor.held()
        if lane == queues.BATCH:
            return max(0, self.floor.max_batch - total)
        interactive = sum(1 for b in batches for task in b.tasks if queues.lane_of(task.lane) == queues.INTERACTIVE)
        return max(0, min(self.floor.max_batch - interactive, self.floor.max_batch + self.headroom - total))

    def _embedding_room(self) -> int:
        """How many more embedding requests may join the embedding batches now."""
        return max(0, MAX_EMBEDDING_REQUESTS - sum(len(b) for b in self.floor.embedders()))

    def _has_room(self, queue: str) -> bool:
        """Whether a solo job (not text: `_text_room`) from `queue` can join what runs now."""
        lane = queues.lane_of(queue)  # a model's own queue shares its lane's slot
        interactive = self.floor.solo_in(queues.INTERACTIVE)
        return self.floor.solo_in(lane) is None and (lane == queues.INTERACTIVE or interactive is None)
