"""Issue 40: one owner per model. A model's dispatcher (a thread of its own while anything is
queued) alone lets requests and managers in; callers only queue and wait, each within its
deadline. A batch runs in a thread of its own, never a caller's, so every batched request,
its leader's included, is free the moment its caller leaves.

Fake engines; every wait is bounded by WAIT_S (events, never sleeps).
"""

from __future__ import annotations

import threading

import pytest
from fakes import WAIT_S, row
from runtime_fixtures import Background, Factory, Held, runtime, spec, wait_until, watch_waits
from test_scheduler import BatchScorer, Request, batching_runtime

from semif_serve.errors import ClientGone, ModelLoadFailed, ScoringFailed
from semif_serve.runtime import scheduler
from semif_serve.runtime.jobs import Job
from semif_serve.runtime.selection import Cost
from semif_serve.scoring import parse_row


def dispatcher_ended(entry) -> None:
    """Wait until the model's dispatcher has ended (an idle model keeps none)."""
    wait_until(lambda: entry._dispatcher is None)


def failing_start(monkeypatch, prefix: str) -> None:
    """Threads whose name starts with `prefix` cannot start, as when the process is out of them."""
    real_start = threading.Thread.start

    def start(thread):
        if thread.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)


def queued_behind_a_batch(rt, scorer, names):
    """A first request whose batch is held in the engine (until `scorer.release`), and one
    request per name queued behind it, in order; returns (first, queued)."""
    first = Request(rt, "first")
    assert scorer.entered.wait(WAIT_S)
    return first, [queued(rt, name) for name in names]


def queued(rt, name):
    """A batched request, once it has queued (each after the one before: in this order)."""
    ahead = len(rt.entry("a")._queue)
    request = Request(rt, name)
    wait_until(lambda: len(rt.entry("a")._queue) == ahead + 1)
    return request


# -- who decides -----------------------------------------------------------------------------------


def test_every_batch_runs_in_a_thread_of_its_own_never_a_callers():
    class Named(BatchScorer):
        def score_batch(self, items, left=None):
            threads.append(threading.current_thread().name)
            return super().score_batch(items, left)

    threads: list[str] = []
    scorer = Named(block=True)
    rt, _ = batching_runtime(scorer)
    first, queued = queued_behind_a_batch(rt, scorer, "bc")
    scorer.release.set()
    assert [r.outcome()["id"] for r in (first, *queued)] == ["first", "b", "c"]
    callers = {r.call.thread.name for r in (first, *queued)}
    assert threads == ["semif-batch-a", "semif-batch-a"] and not callers & set(threads)
    assert rt.entry("a").status()["queue"]["waits"] == 3  # each request's wait, timed once


def test_a_leader_whose_caller_leaves_while_its_batch_runs_is_answered_at_once():
    """The review's case: the batch leader ran its batch in its own request's thread, so a
    leader whose caller left was held until the batch ended (its followers were not)."""
    scorer = BatchScorer(block=True)
    rt, _ = batching_runtime(scorer)
    left = threading.Event()
    leader = Request(rt, "leader", gone=left.is_set)
    assert scorer.entered.wait(WAIT_S)  # its batch is in the engine, and stays there
    left.set()
    with pytest.raises(ClientGone):
        leader.outcome()
    assert not scorer.release.is_set() and rt.entry("a")._active == 1  # the batch still runs
    scorer.release.set()
    wait_until(lambda: rt.entry("a")._active == 0)
    assert scorer.batches == [["leader"]]


def test_a_batched_request_waits_in_the_queue_while_its_model_loads_and_those_behind_join_it():
    scorer = BatchScorer()
    rt, factory = batching_runtime(scorer)
    assert Held(rt, "a").finish().error is None
    Background(lambda: rt.unload("a")).result()
    factory.gate = threading.Event()
    head = Request(rt, "head")
    wait_until(lambda: rt.entry("a").state == "loading")  # started for it by the dispatcher
    behind = [queued(rt, name) for name in "bc"]  # nobody taken while it loads
    assert rt.entry("a")._active == 0
    factory.gate.set()
    assert [r.outcome()["id"] for r in (head, *behind)] == ["head", "b", "c"]
    assert scorer.batches == [["head", "b", "c"]]


def test_a_failed_load_is_the_error_of_the_batched_request_it_was_started_for():
    scorer = BatchScorer()
    rt, factory = batching_runtime(scorer)
    Background(lambda: rt.unload("a")).result()
    factory.gate, factory.fail = threading.Event(), ModelLoadFailed("the weights are broken")
    head = Request(rt, "head")
    wait_until(lambda: rt.entry("a").state == "loading")
    behind = queued(rt, "behind")
    factory.gate.set()
    with pytest.raises(ModelLoadFailed, match=r"loading model .a. failed \(ModelLoadFailed\)"):
        head.outcome()
    assert behind.outcome()["id"] == "behind"  # it tried a new load, which worked
    assert scorer.batches == [["behind"]]


# -- the dispatcher's own life ----------------------------------------------------------------------


def test_a_steady_stream_keeps_one_dispatcher(monkeypatch):
    monkeypatch.setattr(scheduler, "DISPATCHER_LINGER_S", WAIT_S)  # however slow the machine
    rt = runtime(spec("a"), factory=Factory())
    entry = rt.entry("a")
    assert Held(rt, "a").finish().error is None
    dispatcher = entry._dispatcher
    assert dispatcher is not None and dispatcher.name == "semif-queue-a"
    assert Held(rt, "a").finish().error is None
    assert entry._dispatcher is dispatcher  # within DISPATCHER_LINGER_S: the same thread


def letting_in(entry) -> list[threading.Thread]:
    """The threads that let each caller of `entry` in, in order (its dispatchers)."""
    threads, real = [], entry._let_in

    def let_in(head):
        threads.append(threading.current_thread())
        real(head)

    entry._let_in = let_in
    return threads


def test_an_idle_models_dispatcher_ends_and_the_next_request_starts_another():
    rt = runtime(spec("a", load_on_startup=True), factory=Factory())
    entry = rt.entry("a")
    dispatchers = letting_in(entry)
    assert Held(rt, "a").finish().error is None
    dispatcher_ended(entry)  # DISPATCHER_LINGER_S after the queue emptied
    dispatchers[0].join(WAIT_S)
    assert not dispatchers[0].is_alive() and dispatchers[0].name == "semif-queue-a"
    assert Held(rt, "a").finish().error is None
    assert dispatchers[1] is not dispatchers[0]


def test_a_dispatcher_that_cannot_start_queues_nothing_and_the_caller_is_told(monkeypatch):
    rt = runtime(spec("a", load_on_startup=True), factory=Factory())
    entry = rt.entry("a")
    dispatcher_ended(entry)
    failing_start(monkeypatch, "semif-queue-")
    refused = Held(rt, "a").finish()
    assert "can't start new thread" in str(refused.error)
    assert not entry._queue and entry._active == 0
    monkeypatch.undo()
    assert Held(rt, "a").finish().error is None


def test_a_dispatcher_lost_to_a_fork_is_replaced():
    """A forked worker inherits the parent's scheduler, not its threads: the dispatcher it
    names is not alive there, and the next caller starts one."""
    rt = runtime(spec("a", load_on_startup=True), factory=Factory())
    entry = rt.entry("a")
    dispatcher_ended(entry)
    entry._dispatcher = threading.Thread(target=lambda: None)  # never started: as after a fork
    assert Held(rt, "a").finish().error is None


def test_a_batch_whose_thread_cannot_start_ends_every_request_in_it(monkeypatch):
    scorer = BatchScorer(block=True)
    rt, _ = batching_runtime(scorer)
    first, queued = queued_behind_a_batch(rt, scorer, "bc")
    failing_start(monkeypatch, "semif-batch-")
    scorer.release.set()
    assert first.outcome()["id"] == "first"
    with pytest.raises(RuntimeError, match="can't start new thread"):
        queued[0].outcome()  # the leader's: the stop's own error
    with pytest.raises(ScoringFailed, match="the batch stopped before this request"):
        queued[1].outcome()
    wait_until(lambda: rt.entry("a")._active == 0)  # its slot given back
    assert scorer.batches == [["first"]]
    monkeypatch.undo()
    assert Request(rt, "d").outcome()["id"] == "d"


# -- what the dispatcher holds, and gives back -------------------------------------------------------


def test_a_batch_that_cannot_be_chosen_is_its_leaders_error_and_gives_back_its_slot():
    scorer = BatchScorer(block=True)
    rt, _ = batching_runtime(scorer)
    engine = rt.entry("a").engine
    first, (leader, alone) = queued_behind_a_batch(rt, scorer, ["leader", "alone"])

    def broken(rows, length):  # asked to size a batch of two (one alone needs no count)
        raise RuntimeError("no token count")

    engine.batch_tokens = broken
    scorer.release.set()
    assert first.outcome()["id"] == "first"
    with pytest.raises(RuntimeError, match="no token count"):
        leader.outcome()
    assert alone.outcome()["id"] == "alone"  # the slot was given back; it runs on its own
    assert scorer.batches == [["first"], ["alone"]]


class Interrupted(BaseException):
    """Stands for any failure, down to an interrupt."""


class LetInAsItLeaves:
    """The victim's wait on the model's condition fails (an interrupt, say) once it returns
    with `let_in()` true: the dispatcher has let the victim in, and it never holds what it was
    given. Other wakes of the victim's wait return as usual."""

    def __init__(self, entry, let_in):
        self.real_wait, self.let_in, self.raised = entry._cond.wait, let_in, threading.Event()
        entry._cond.wait = self.wait

    def wait(self, timeout=None):
        woken = self.real_wait(timeout)
        victim = threading.current_thread().name == "victim"
        if victim and not self.raised.is_set() and self.let_in():
            self.raised.set()
            raise Interrupted("interrupted as it was let in")
        return woken


def interrupted(call):
    """`call`, which the test interrupts, in the victim's thread: it ends quietly."""

    def run():
        with pytest.raises(Interrupted):
            call()

    victim = threading.Thread(target=run, name="victim")
    victim.start()
    return victim


def test_a_request_let_in_as_its_wait_fails_gives_back_its_slot():
    rt = runtime(spec("a", slots=1, load_on_startup=True), factory=Factory())
    entry = rt.entry("a")
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    hook = LetInAsItLeaves(entry, lambda: not entry._queue and entry._active == 1)
    victim = interrupted(lambda: rt.lease("a").__enter__())
    wait_until(lambda: len(entry._queue) == 1)
    holder.finish()  # the victim is let in (the holder's slot is its), and leaves at once
    victim.join(WAIT_S)
    assert hook.raised.is_set() and not victim.is_alive()
    assert not entry._queue and entry._active == 0
    assert Held(rt, "a").finish().error is None  # the slot was given back


def test_a_manager_let_in_as_its_wait_fails_gives_back_the_model():
    rt = runtime(spec("a", load_on_startup=True), factory=Factory())
    entry = rt.entry("a")
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    hook = LetInAsItLeaves(entry, lambda: entry._managed)
    victim = interrupted(lambda: rt.unload("a"))
    wait_until(lambda: len(entry._queue) == 1)
    holder.finish()
    victim.join(WAIT_S)
    assert hook.raised.is_set() and not victim.is_alive()
    assert not entry._managed and entry.state == "ready"  # it never ran; the model is free
    assert Held(rt, "a").finish().error is None


def test_a_batched_request_taken_as_its_wait_fails_leaves_its_batch_the_one_slot():
    scorer = BatchScorer(block=True)
    rt, _ = batching_runtime(scorer)
    entry = rt.entry("a")
    first, (leader,) = queued_behind_a_batch(rt, scorer, ["leader"])
    item = parse_row(row(id="victim"))
    job = Job(item=item, cost=Cost(1, 1), engine=entry.engine, prepare=lambda e: item)
    hook = LetInAsItLeaves(entry, lambda: all(waiter.job is not job for waiter in entry._queue))
    victim = interrupted(lambda: rt.score_batched("a", None, job))
    wait_until(lambda: len(entry._queue) == 2)
    scorer.release.set()  # the next batch takes the leader and the victim, which leaves
    assert first.outcome()["id"] == "first" and leader.outcome()["id"] == "leader"
    victim.join(WAIT_S)
    assert hook.raised.is_set() and not victim.is_alive()
    wait_until(lambda: entry._active == 0)  # the batch gave back its one slot, and no more
    assert entry._active == 0 and scorer.batches == [["first"], ["leader", "victim"]]
    assert Request(rt, "next").outcome()["id"] == "next"


def test_no_request_is_let_in_while_retirement_holds_the_model():
    rt = runtime(spec("a", load_on_startup=True), factory=Factory())
    entry = rt.entry("a")
    dispatcher_ended(entry)  # idle: retirement may take it
    holding, release = threading.Event(), threading.Event()

    def operation(held):
        holding.set()
        assert release.wait(WAIT_S)

    retiring = Background(lambda: entry.try_manage(operation))
    assert holding.wait(WAIT_S)
    declined = watch_waits(entry, lambda: len(entry._queue) == 1, "_work")
    request = Held(rt, "a")
    assert declined.wait(WAIT_S), "the dispatcher never waited with the request queued"
    assert not request.admitted.is_set()
    release.set()
    assert retiring.result() is True
    assert request.admitted.wait(WAIT_S)
    request.finish()


class HeldRecorder:
    """A management state whose record of an unload waits for the test: the manager that
    unloaded the model still holds it, the model already unloaded."""

    def __init__(self):
        self.recording, self.release = threading.Event(), threading.Event()

    def registered(self, model_id, table):
        pass

    def unloaded(self, model_ids):
        self.recording.set()
        assert self.release.wait(WAIT_S)


def test_a_batched_request_behind_an_unload_loads_the_model_only_once_the_unload_has_ended():
    scorer = BatchScorer()
    rt, factory = batching_runtime(scorer)
    engine = rt.entry("a").engine
    rt.management = recorder = HeldRecorder()
    unload = Background(lambda: rt.unload("a"))
    assert recorder.recording.wait(WAIT_S)
    entry = rt.entry("a")
    assert entry.state == "unloaded" and entry._managed
    declined = watch_waits(entry, lambda: len(entry._queue) == 1, "_work")
    item = parse_row(row(id="after"))
    job = Job(item=item, cost=Cost(1, 1), engine=engine, prepare=lambda e: item)
    after = Background(lambda: rt.score_batched("a", None, job))
    assert declined.wait(WAIT_S), "the dispatcher never waited with the request queued"
    assert entry.state == "unloaded"  # no load while the unload holds the model
    recorder.release.set()
    assert unload.result() == {"id": "a", "loaded": False}
    assert after.result().outcome["id"] == "after" and scorer.batches == [["after"]]
