"""The scheduler's admission policy (workers/admission.py): whose turn the next piece is, and which queued
job joins what runs. Its view of the work in progress is a stand-in `Floor` (the policy is pure logic
over it); the queues are real RQ queues on the test Redis."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

from jobs import queues
from workers import admission, queue_watch
from workers.admission import Admission


@dataclass
class Batch:
    """A text batch as the policy sees it: its size, whether a request in it waits for memory, and the lane
    its requests came from."""

    members: int = 0
    waiting: bool = False
    lane: str = queues.INTERACTIVE

    def __len__(self) -> int:
        return self.members

    @property
    def tasks(self) -> list:
        return [SimpleNamespace(lane=self.lane)] * self.members


@dataclass
class Floor:
    """The work in progress, as the scheduler shows it to the policy; `begin` notes what was taken."""

    max_batch: int = 4
    text: list = field(default_factory=list)
    embed: list = field(default_factory=list)
    solo: dict = field(default_factory=lambda: {queues.INTERACTIVE: None, queues.BATCH: None})
    begun: list = field(default_factory=list)
    waiting_solo: int = 0

    owners: Counter = field(default_factory=Counter)

    def held(self) -> int:
        return self.waiting_solo

    def running_by_owner(self) -> Counter:
        return Counter(self.owners)

    def active(self) -> list:
        return [*(t for t in self.solo.values() if t is not None),
                *([object()] if any(self.text) or any(self.embed) else [])]

    def batches(self) -> list:
        return self.text

    def embedders(self) -> list:
        return self.embed

    def solo_in(self, lane: str):
        return self.solo[lane]

    def begin(self, job, queue) -> None:
        self.begun.append((job.id, queue.name))

    def begin_many(self, jobs, queue) -> None:
        for job in jobs:
            self.begin(job, queue)


def _task(kind: str) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(kind=kind))


def _policy(floor: Floor, conn=None) -> Admission:
    names = queues.WORKER_QUEUES
    return Admission(floor, conn, [queues.get_queue(n, conn) for n in names] if conn else [], burst=True)


def test_with_no_text_the_interactive_solo_task_goes_first():
    interactive, batch = _task("speech"), _task("speech")
    floor = Floor(solo={queues.INTERACTIVE: interactive, queues.BATCH: batch})
    assert _policy(floor).pick() is interactive
    floor.solo[queues.INTERACTIVE] = None
    assert _policy(floor).pick() is batch
    floor.solo[queues.BATCH] = None
    assert _policy(floor).pick() is None


def test_a_transcription_gets_a_piece_after_speech_turn_s_of_text():
    transcription, text = _task("speech"), Batch(members=2)
    policy = _policy(Floor(text=[text], solo={queues.INTERACTIVE: None, queues.BATCH: transcription}))
    assert policy.pick() is text
    policy.ran_text(admission.SPEECH_TURN_S / 2)
    assert policy.pick() is text
    policy.ran_text(admission.SPEECH_TURN_S / 2)
    assert policy.pick() is transcription
    policy.ran_solo()
    assert policy.pick() is text


def test_text_that_cannot_batch_takes_every_other_turn_and_batches_take_turns():
    solo_text, first, second = _task("text"), Batch(members=1), Batch(members=1)
    policy = _policy(Floor(text=[first, Batch(), second], solo={queues.INTERACTIVE: solo_text, queues.BATCH: None}))
    picks = [policy.pick() for _ in range(6)]
    assert picks[0::2] == [solo_text] * 3
    assert {id(p) for p in picks[1::2]} == {id(first), id(second)}  # an empty batch is never stepped


def _enqueue(conn, settings, queue: str, kind: str, job_id: str) -> None:
    queues.enqueue(conn, settings, queue, kind, {"id": job_id}, job_id)


def test_a_chat_overtakes_a_waiting_transcription_and_joins_while_the_batches_have_room(redis_conn, settings):
    floor = Floor(max_batch=2, text=[Batch(members=1)], solo={queues.INTERACTIVE: None,
                                                             queues.BATCH: _task("speech")})
    for job_id, kind in (("speech-2", queues.TRANSCRIPTION), ("chat-1", queues.CHAT_COMPLETION),
                         ("chat-2", queues.CHAT_COMPLETION)):
        _enqueue(redis_conn, settings, queues.BATCH, kind, job_id)
    policy = _policy(floor, redis_conn)
    floor_text = floor.text[0]
    floor.begin = lambda job, queue: (floor.begun.append(job.id), setattr(floor_text, "members", 2))
    assert policy.admit()
    assert floor.begun == ["chat-1"]  # the batch lane's slot is taken; then the batches were full
    assert queues.get_queue(queues.BATCH, redis_conn).job_ids == ["speech-2", "chat-2"]


def test_nothing_joins_while_a_request_waits_for_memory_and_interactive_blocks_the_batch_lane(redis_conn,
                                                                                          settings):
    floor = Floor(text=[Batch(members=1, waiting=True)], solo={queues.INTERACTIVE: _task("speech"),
                                                             queues.BATCH: None})
    _enqueue(redis_conn, settings, queues.INTERACTIVE, queues.CHAT_COMPLETION, "chat-1")
    _enqueue(redis_conn, settings, queues.BATCH, queues.TRANSCRIPTION, "speech-1")
    policy = _policy(floor, redis_conn)
    assert not policy.admit() and floor.begun == []
    floor.text[0].waiting, floor.solo[queues.INTERACTIVE] = False, None
    floor.solo[queues.BATCH] = _task("speech")  # still busy: now the batch lane is the one taken
    policy.look_now()  # (a look within ADMIT_EVERY_S of the last one would wait)
    assert policy.admit() and floor.begun == [("chat-1", queues.INTERACTIVE)]


def test_while_no_text_can_join_the_queues_are_looked_at_less_often_until_a_place_frees(redis_conn, settings,
                                                                                          monkeypatch):
    floor = Floor(max_batch=1, text=[Batch(members=1)])  # the batches are full
    policy = _policy(floor, redis_conn)
    looks = []
    monkeypatch.setattr(Admission, "_peek", lambda *a: looks.append(1) or ([], {}))
    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    policy.admit()
    clock[0] += 2 * admission.ADMIT_EVERY_S
    policy.admit()
    assert len(looks) == 1  # no look 10 ms later: nothing could join
    clock[0] += admission.FULL_LOOK_S
    policy.admit()
    assert len(looks) == 2  # but one every FULL_LOOK_S, for a transcription
    floor.max_batch = 2  # a place freed (a request ended): the scheduler asks for a look at once
    policy.place_freed()
    policy.admit()
    clock[0] += 2 * admission.ADMIT_EVERY_S
    policy.admit()
    assert len(looks) == 4  # and with room, every ADMIT_EVERY_S again


def test_embedding_requests_join_while_the_text_batches_are_full_within_their_own_room(redis_conn, settings,
                                                                                        monkeypatch):
    monkeypatch.setattr(admission, "MAX_EMBEDDING_REQUESTS", 3)
    floor = Floor(max_batch=1, text=[Batch(members=1)], embed=[Batch(members=1)])  # text full; one embedding in
    for job_id, kind in (("chat-1", queues.CHAT_COMPLETION), ("embd-1", queues.EMBEDDING),
                         ("embd-2", queues.EMBEDDING), ("embd-3", queues.EMBEDDING)):
        _enqueue(redis_conn, settings, queues.INTERACTIVE, kind, job_id)
    policy = _policy(floor, redis_conn)
    assert policy.admit()
    assert [job_id for job_id, _ in floor.begun] == ["embd-1", "embd-2"]  # room for 3, one already in
    assert queues.get_queue(queues.INTERACTIVE, redis_conn).job_ids == ["chat-1", "embd-3"]


def test_embedding_batches_take_turns_with_text_batches():
    text, embed = Batch(members=2), Batch(members=1)
    policy = _policy(Floor(text=[text], embed=[embed]))
    assert {id(policy.pick()) for _ in range(4)} == {id(text), id(embed)}
    assert _policy(Floor(text=[Batch(members=0)], embed=[embed])).pick() is embed  # an empty batch never gets a turn


def test_fair_order_takes_keys_in_turn_the_one_with_least_in_progress_first():
    queued = [(job_id, job_id[0].upper(), 1.0) for job_id in ("a1", "a2", "a3", "b1", "a4", "c1", "b2")]
    assert admission.fair_order(queued, Counter()) == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
    # A has two in progress already: B and C go first, until they have as many.
    assert admission.fair_order(queued, Counter({"A": 2})) == ["b1", "c1", "b2", "a1", "a2", "a3", "a4"]
    assert admission.fair_order([("x", "A", 1.0), ("y", "A", 1.0)], Counter({"B": 5})) == ["x", "y"]  # one key


def test_a_keys_share_weighs_its_turns():
    queued = [*((f"a{n}", "A", 2.0) for n in range(6)), *((f"b{n}", "B", 1.0) for n in range(6))]
    taken = admission.fair_order(queued, Counter())[:6]
    assert [job_id[0] for job_id in taken].count("a") == 4  # share 2 against 1: two places in three


def _owned(conn, settings, queue: str, job_id: str, owner: str, share: float | None = None) -> None:
    meta = {"owner": owner, **({"share": share} if share else {})}
    queues.enqueue(conn, settings, queue, queues.CHAT_COMPLETION, {"id": job_id}, job_id, meta=meta)


def test_another_keys_async_chat_takes_the_next_place_before_one_keys_backlog(redis_conn, settings):
    floor = Floor(max_batch=4, text=[Batch(members=2, lane=queues.BATCH)], owners=Counter({"A": 2}))
    for n in range(6):
        _owned(redis_conn, settings, queues.BATCH, f"a{n}", "A")
    _owned(redis_conn, settings, queues.BATCH, "b0", "B")
    policy = _policy(floor, redis_conn)
    assert policy.admit()
    assert [job_id for job_id, _ in floor.begun] == ["b0", "a0"]  # two places: B's job first, then A's next
    assert queues.get_queue(queues.BATCH, redis_conn).job_ids == ["a1", "a2", "a3", "a4", "a5"]


def test_the_share_in_a_jobs_meta_weighs_its_keys_turns(redis_conn, settings):
    floor = Floor(max_batch=4, text=[Batch(members=1, lane=queues.BATCH)])  # three places
    for n in range(3):
        _owned(redis_conn, settings, queues.BATCH, f"a{n}", "A")
    for n in range(3):
        _owned(redis_conn, settings, queues.BATCH, f"b{n}", "B", share=2.0)
    assert _policy(floor, redis_conn).admit()
    assert [job_id for job_id, _ in floor.begun] == ["a0", "b0", "b1"]  # B, twice A's share: two of three places


def test_async_requests_filling_the_batch_leave_interactive_ones_an_eighth_more():
    assert admission.interactive_headroom(64) == 8 and admission.interactive_headroom(4) == 1
    floor = Floor(max_batch=16, text=[Batch(members=16, lane=queues.BATCH)])
    policy = _policy(floor)
    assert policy._text_room(queues.BATCH) == 0 and policy._text_room(queues.INTERACTIVE) == 2
    floor.text = [Batch(members=16, lane=queues.INTERACTIVE)]  # interactive ones alone hold max_batch, no more
    assert policy._text_room(queues.INTERACTIVE) == 0 and policy._text_room(queues.BATCH) == 0
    floor.text = [Batch(members=4, lane=queues.INTERACTIVE), Batch(members=10, lane=queues.BATCH)]
    assert policy._text_room(queues.INTERACTIVE) == 4 and policy._text_room(queues.BATCH) == 2


def test_an_interactive_chat_joins_a_batch_full_of_async_ones(redis_conn, settings):
    floor = Floor(max_batch=4, text=[Batch(members=4, lane=queues.BATCH)], owners=Counter({"A": 4}))
    _owned(redis_conn, settings, queues.BATCH, "a9", "A")
    _owned(redis_conn, settings, queues.INTERACTIVE, "b0", "B")
    policy = _policy(floor, redis_conn)
    assert policy.admit()
    assert floor.begun == [("b0", queues.INTERACTIVE)]
    assert queues.get_queue(queues.BATCH, redis_conn).job_ids == ["a9"]


def test_a_burst_is_shared_out_evenly_among_the_workers_on_the_same_queues(redis_conn, settings):
    for n in range(6):
        _owned(redis_conn, settings, queues.INTERACTIVE, f"c{n}", "A")
    peer = Admission(Floor(max_batch=8), redis_conn, [queues.get_queue(queues.INTERACTIVE, redis_conn)], True,
                     name="peer")
    assert peer._peek([], [])[1] == {"peer": 0}  # the peer looked (holding nothing) and wrote its load
    floor = Floor(max_batch=8, text=[Batch(members=1)])
    mine = Admission(floor, redis_conn, [queues.get_queue(queues.INTERACTIVE, redis_conn)], True, name="me")
    assert mine.admit()
    assert [job_id for job_id, _ in floor.begun] == ["c0", "c1", "c2"]  # (1 held + 6 waiting + 0) / 2 workers: 4
    other = Floor(max_batch=8, text=[Batch(members=0)])
    alone = Admission(other, redis_conn, [queues.get_queue(queues.BATCH, redis_conn)], True, name="solo")
    assert alone._share({"solo": 0}, 6) == 6  # no peer on its queues: it takes what it can
    mine.forget()
    assert mine._peek([], [])[1] == {"peer": 0, "me": 1}  # (and its next look writes it back)


def test_with_a_watch_a_look_is_made_only_when_something_waits(redis_conn, settings, monkeypatch):
    floor = Floor(max_batch=4, text=[Batch(members=1)])  # room to join
    names = [queues.INTERACTIVE, queues.BATCH]
    policy = Admission(floor, redis_conn, [queues.get_queue(n, redis_conn) for n in names], True, name="me",
                       watch=True)
    policy.watch.stop()  # (its thread ends at once: the counts below are the test's own, in order)
    looks = []
    peek = Admission._peek
    monkeypatch.setattr(Admission, "_peek", lambda self, *a: looks.append(1) or peek(self, *a))
    assert policy.watch.count() == 0
    policy.place_freed()
    assert not policy.admit() and looks == []  # due, but every queue was empty: no round trip on this thread
    assert redis_conn.hget(policy._loads_key, "me").decode().startswith("0:")  # the watch wrote the load
    _enqueue(redis_conn, settings, queues.INTERACTIVE, queues.CHAT_COMPLETION, "chat-1")
    assert policy.watch.count() == 1
    assert policy.admit() and looks == [1] and floor.begun == [("chat-1", queues.INTERACTIVE)]
    assert policy.watch.count() == 0
    policy.watch._counted_at -= queue_watch.STALE_S  # a count too old says nothing: the look is made
    policy.place_freed()
    policy.admit()
    assert looks == [1, 1]
    assert policy.watch.count() == 0
    policy.look_now()  # asked for, a look is made whatever the count
    policy.admit()
    assert looks == [1, 1, 1]


def test_the_watch_counts_on_its_own_thread_while_wanted_and_stops(redis_conn, settings):
    watch = queue_watch.QueueWatch(redis_conn, [queues.get_queue(queues.INTERACTIVE, redis_conn).key],
                                   every_s=0.001)
    _enqueue(redis_conn, settings, queues.INTERACTIVE, queues.CHAT_COMPLETION, "chat-1")
    watch.want()
    assert watch.counted.wait(5)
    assert watch._waiting == 1 and not watch.nothing_waits()
    queues.get_queue(queues.INTERACTIVE, redis_conn).remove("chat-1")
    for _ in range(2):  # (the first count may have begun before the removal; the second began after it)
        watch.counted.clear()
        assert watch.counted.wait(5)
    assert watch.nothing_waits()
    watch.stop()
    watch._thread.join(5)
    assert not watch._thread.is_alive()
