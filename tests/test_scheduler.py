"""Issue 30: one scheduler per model owns every wait, and every wait ends at the request's deadline.

Each defect of the review has its case here, over fake engines and the real runtime:
1. a batch's wait for company ends before the earliest deadline of the requests it holds, and the
   leader's own deadline bounds it too;
2. when models share the device (no SEMIF_PARALLEL_SLOTS), the device is a fair queue the request
   waits in within its deadline, and a caller who leaves while waiting there is never scored;
6. a leader takes its own job as it enters: a leader that fails leaves no job queued for nobody;
12. a request that finds its model unloaded waits for the load within its deadline (the load goes
   on for the requests after it).
Also: the device queue on its own (FIFO, re-entrant, deadlines), and the one out-of-memory policy
(a batch is split before any stored prefix is dropped). Every wait is bounded by WAIT_S.
"""

from __future__ import annotations

import threading

import pytest
import torch
from fakes import AUTH, WAIT_S, FakeScorer, fake_runtime, row, settings
from falcon import testing
from runtime_fixtures import Background, Factory, Held, runtime, spec, wait_until, watch_waits

from semif_serve.engine.engine import Engine
from semif_serve.errors import ClientGone, ModelLoadFailed, OutOfMemory, QueueTimedOut
from semif_serve.http import create_app
from semif_serve.runtime.device import DeviceQueue
from semif_serve.runtime.jobs import Job
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.selection import Cost
from semif_serve.runtime.service import DecisionService
from semif_serve.runtime.waiting import NEVER, Deadline, QueueTimeout, WaiterGone, deadline_after
from semif_serve.scoring import parse_row
from semif_serve.scoring.inputs import Batched

BATCHING = {"max_batch_rows": 4, "max_batch_tokens": 1000}


class BatchScorer(FakeScorer):
    """Records each batch's ids; holds each call at `release` (set by default)."""

    def __init__(self, block=False):
        super().__init__(block=block)
        self.batches: list[list[str]] = []

    def score_batch(self, items, left=None):
        self.batches.append([item.id for item in items])
        self._enter()
        return [Batched(self.result(item), len(items), 1) for item in items]


class Engines:
    """A factory of engines over one scorer; `fail` (an exception) fails the next load."""

    def __init__(self, scorer):
        self.scorer, self.fail, self.gate = scorer, None, None

    def __call__(self, model_spec):
        if self.gate is not None:  # set: loads wait for it
            assert self.gate.wait(WAIT_S), "test never opened the load gate"
        if self.fail is not None:
            error, self.fail = self.fail, None
            raise error
        return Engine(self.scorer, concurrency=model_spec.slots)


class Request:
    """One batched request in its own thread: its job, submitted as the service submits it."""

    def __init__(self, rt, name, timeout_s=None, gone=None, model="a"):
        item = parse_row(row(id=name))
        self.job = Job(
            item=item,
            cost=Cost(1, 1),
            engine=rt.entry(model).engine,
            prepare=lambda engine: item,
            gone=gone,
        )
        self.call = Background(lambda: rt.score_batched(model, timeout_s, self.job))

    def outcome(self):
        """The job's outcome; a request that failed raises its error here."""
        value = self.call.result()
        if isinstance(value, BaseException):
            raise value
        return value.outcome


def batching_runtime(scorer, **overrides):
    factory = Engines(scorer)
    rt = runtime(spec("a", load_on_startup=True), factory=factory, **{**BATCHING, **overrides})
    return rt, factory


def leading(rt):
    """Wait until a leader holds the model's slot."""
    wait_until(lambda: rt.entry("a")._active == 1)


# -- 1. a batch's wait keeps every deadline --------------------------------------------------------


def test_a_batch_stops_waiting_for_company_before_a_companions_deadline():
    """The review's case: SEMIF_BATCH_WAIT_MS long, a request with a short timeout_s joins an
    idle model's leader. It used to get 503 server_busy while the leader waited out its wait."""
    scorer = BatchScorer()
    rt, _ = batching_runtime(scorer, batch_wait_ms=int(WAIT_S * 1000 * 0.8))
    lone = Request(rt, "lone")
    leading(rt)
    hurried = Request(rt, "hurried", timeout_s=1.0)
    assert hurried.outcome()["id"] == "hurried"  # scored in time, not a 503
    assert lone.outcome()["id"] == "lone"
    assert scorer.batches == [["lone", "hurried"]]


def test_through_http_a_companion_with_a_short_timeout_gets_its_answer_not_a_503():
    """The same case through the service and its batched branch (503 server_busy on main)."""
    scorer = BatchScorer()
    config = settings(max_batch_rows=4, batch_wait_ms=int(WAIT_S * 1000 * 0.8))
    rt = fake_runtime(scorer, config)
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    lone = Background(lambda: api.simulate_post("/decide", json=row(id="lone"), headers=AUTH))
    wait_until(lambda: rt.entry(None)._active == 1)
    hurried = api.simulate_post("/decide", json=row(id="hurried", timeout_s=1.0), headers=AUTH)
    assert hurried.status_code == 200, hurried.json
    assert hurried.json["batch"]["rows"] == 2
    assert lone.result().status_code == 200
    assert scorer.batches == [["lone", "hurried"]]


def test_a_leaders_own_deadline_bounds_its_wait_for_company():
    scorer = BatchScorer()
    rt, _ = batching_runtime(scorer, batch_wait_ms=int(WAIT_S * 1000 * 0.8))
    assert Request(rt, "lone", timeout_s=0.5).outcome()["id"] == "lone"  # alone, in time
    assert scorer.batches == [["lone"]]


def test_a_request_taken_after_its_deadline_is_dropped_unscored():
    scorer = BatchScorer(block=True)
    rt, _ = batching_runtime(scorer)
    first = Request(rt, "first")
    assert scorer.entered.wait(WAIT_S)
    late = Request(rt, "late", timeout_s=0.05)
    with pytest.raises(QueueTimedOut, match="^waited 0.05 s for model 'a'$"):
        late.outcome()
    scorer.release.set()
    assert first.outcome()["id"] == "first"
    assert scorer.batches == [["first"]]


# -- 2. the device, when models share it ------------------------------------------------------------


def shared_device_runtime(scorers, **overrides):
    """Models a and b, each over its own scorer, sharing one device (no SEMIF_PARALLEL_SLOTS)."""
    config = settings(**overrides)
    rt = Runtime(
        config,
        lambda model_spec: Engine(scorers[model_spec.id]),
        [spec("a", load_on_startup=True), spec("b", load_on_startup=True)],
        "a",
        device=DeviceQueue(),
    )
    Background(lambda: rt.start(idle_interval_s=None)).result()
    return rt


def scored(rt, model_id, timeout_s=None, gone=None):
    with rt.lease(model_id, timeout_s, gone) as engine:
        return engine.score(parse_row(row(id=f"for-{model_id}")))


def test_a_request_behind_another_models_call_keeps_its_timeout():
    """The review's case: model a's request with timeout_s 0.2, behind a long call on model b,
    was scored once b finished instead of a 503 at 0.2 s."""
    scorers = {"a": FakeScorer(), "b": FakeScorer(block=True)}
    rt = shared_device_runtime(scorers)
    on_b = Background(lambda: scored(rt, "b"))
    assert scorers["b"].entered.wait(WAIT_S)
    with pytest.raises(QueueTimedOut, match=r"^waited 0.2 s for the device"):
        scored(rt, "a", timeout_s=0.2)
    scorers["b"].release.set()
    assert on_b.result()["id"] == "for-b"
    assert scorers["a"].calls == []  # never scored
    assert rt.entry("a").status()["active_slots"] == 0
    assert scored(rt, "a")["id"] == "for-a"  # and the device serves the next request


def test_a_caller_who_leaves_while_waiting_for_the_device_is_never_scored():
    scorers = {"a": FakeScorer(), "b": FakeScorer(block=True)}
    rt = shared_device_runtime(scorers)
    on_b = Background(lambda: scored(rt, "b"))
    assert scorers["b"].entered.wait(WAIT_S)
    left = threading.Event()
    waiting = Background(lambda: scored(rt, "a", gone=left.is_set))
    wait_until(lambda: rt._device.waiting == 1)
    left.set()
    with pytest.raises(ClientGone):
        waiting.result()
    scorers["b"].release.set()
    on_b.result()
    assert scorers["a"].calls == []


def shared_device_batching(scorers, **overrides):
    return shared_device_runtime(scorers, **{**BATCHING, **overrides})


def test_a_batch_waiting_for_the_device_drops_a_request_at_its_deadline_and_keeps_the_rest():
    scorers = {"a": BatchScorer(), "b": FakeScorer(block=True)}
    rt = shared_device_batching(scorers, batch_wait_ms=300)
    on_b = Background(lambda: scored(rt, "b"))
    assert scorers["b"].entered.wait(WAIT_S)
    patient = Request(rt, "patient")  # leads, and waits 0.3 s for company
    leading(rt)
    hurried = Request(rt, "hurried", timeout_s=1.0)  # joins it, then both wait for the device
    with pytest.raises(QueueTimedOut, match=r"^waited 1 s before its batch ran$"):
        hurried.outcome()  # while b still holds the device
    assert rt._device.waiting == 1 and not patient.call.done.is_set()
    scorers["b"].release.set()
    on_b.result()
    assert patient.outcome()["id"] == "patient"
    assert scorers["a"].batches == [["patient"]]


def test_a_request_whose_deadline_passed_as_its_batch_got_the_device_is_not_scored():
    scorers = {"a": BatchScorer(), "b": FakeScorer(block=True)}
    rt = shared_device_batching(scorers)
    on_b = Background(lambda: scored(rt, "b"))
    assert scorers["b"].entered.wait(WAIT_S)
    late = Request(rt, "late", timeout_s=0.3)
    wait_until(lambda: rt._device.waiting == 1)
    wait_until(lambda: late.job.deadline.passed)
    scorers["b"].release.set()  # the device is free before the batch's next look (every 0.25 s)
    with pytest.raises(QueueTimedOut, match=r"^waited 0.3 s before its batch ran$"):
        late.outcome()
    on_b.result()
    assert scorers["a"].batches == []


def test_a_batched_request_that_never_waits_runs_however_short_its_timeout():
    scorer = BatchScorer()
    rt, _ = batching_runtime(scorer)
    assert Request(rt, "quick", timeout_s=1e-9).outcome()["id"] == "quick"
    assert scorer.batches == [["quick"]]


def test_a_leader_waiting_for_a_load_leaves_when_its_caller_does():
    scorer = BatchScorer()
    rt, factory = batching_runtime(scorer)
    engine = rt.entry("a").engine
    Background(lambda: rt.unload("a")).result()
    factory.gate, left = threading.Event(), threading.Event()
    item = parse_row(row(id="leaving"))
    job = Job(item=item, cost=Cost(1, 1), engine=engine, prepare=lambda e: item, gone=left.is_set)
    leaving = Background(lambda: rt.score_batched("a", None, job))
    wait_until(lambda: rt.entry("a").state == "loading")
    left.set()
    with pytest.raises(ClientGone):
        leaving.result()
    factory.gate.set()
    wait_until(lambda: rt.entry("a").state == "ready")
    assert scorer.batches == []


def test_while_a_leader_chooses_its_batch_nobody_else_enters_even_with_a_free_slot():
    scorer = BatchScorer()
    factory = Engines(scorer)
    rt = runtime(
        spec("a", slots=2, load_on_startup=True),
        factory=factory,
        max_batch_rows=2,
        max_batch_tokens=1000,
        batch_wait_ms=60_000,  # longer than any bound here: only a full batch ends the wait
    )
    lone = Request(rt, "lone")
    leading(rt)
    company = Request(rt, "company")  # fills the batch: taken by the leader, not a second one
    assert lone.outcome()["id"] == "lone" and company.outcome()["id"] == "company"
    assert scorer.batches == [["lone", "company"]]


def test_the_production_runtime_shares_a_device_queue_only_without_parallel_slots():
    from semif_serve.server import build_runtime

    shared = build_runtime(settings(), lambda model_spec: Engine(FakeScorer()))
    assert isinstance(shared._device, DeviceQueue)
    parallel = build_runtime(settings(parallel_slots=2), lambda model_spec: Engine(FakeScorer()))
    assert parallel._device is None


# -- 6. no job outlives its request -----------------------------------------------------------------


def test_a_leader_that_fails_before_it_runs_leaves_no_job_behind():
    """The review's case: a leader failing before its own job was taken left the job queued, and
    a later leader scored it for nobody. Here the doomed request leads after an unload and its
    load fails."""
    scorer = BatchScorer(block=True)
    rt, factory = batching_runtime(scorer)
    first = Request(rt, "first")
    assert scorer.entered.wait(WAIT_S)
    unload = Background(lambda: rt.unload("a"))
    wait_until(lambda: any(not waiter.is_request for waiter in rt.entry("a")._queue))
    doomed = Request(rt, "doomed")
    wait_until(lambda: len(rt.entry("a")._queue) == 2)
    factory.fail = RuntimeError("no memory for it")
    scorer.release.set()
    assert first.outcome()["id"] == "first"
    unload.result()
    with pytest.raises(ModelLoadFailed, match=r"loading model 'a' failed \(RuntimeError\)"):
        doomed.outcome()
    assert not rt.entry("a")._queue and rt.entry("a")._active == 0
    later = Request(rt, "later")
    assert later.outcome()["id"] == "later"
    assert scorer.batches == [["first"], ["later"]]  # "doomed" was never scored


# -- 12. a load is waited for within the deadline ---------------------------------------------------


def test_a_request_that_finds_its_model_unloaded_keeps_its_timeout():
    """The review's case: 200 after 1.53 s with timeout_s 0.5. Now a 503 at its deadline, while
    the load goes on and serves the request after it."""
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    factory.load_gate = threading.Event()
    early = Held(rt, "a", timeout_s=0.2)
    assert early.done.wait(WAIT_S)
    assert isinstance(early.error, QueueTimedOut)
    assert str(early.error) == "waited 0.2 s for model 'a' (it was loading)"
    assert factory.load_started.is_set() and rt.entry("a").state == "loading"
    patient = Held(rt, "a")
    factory.load_gate.set()
    assert patient.admitted.wait(WAIT_S) and patient.finish().error is None
    assert factory.events == [("load", "a")]  # one load served both


def test_a_manager_waits_for_a_load_whose_requester_left():
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    factory.load_gate = threading.Event()
    early = Held(rt, "a", timeout_s=0.1)
    assert early.done.wait(WAIT_S) and isinstance(early.error, QueueTimedOut)
    waits = watch_waits(rt.entry("a"))  # nobody waits on the model now; the load runs alone
    unload = Background(lambda: rt.unload("a"))
    assert waits.wait(WAIT_S), "the unload never waited for the load"
    assert not unload.done.is_set() and rt.entry("a").state == "loading"
    factory.load_gate.set()
    assert unload.result() == {"id": "a", "loaded": False}
    assert factory.events == [("load", "a"), ("close", "a")]


# -- the device queue on its own --------------------------------------------------------------------


def test_the_device_is_taken_in_arrival_order_and_again_by_its_holder():
    device, order = DeviceQueue(), []
    assert device.take() is False  # free: no wait
    assert device.take() is False  # the holder again (the engine's own lock inside its turn)
    waiters = []
    for name in "abc":

        def turn(name=name):
            assert device.take() is True  # it had to wait
            order.append(name)
            device.give()

        waiters.append(Background(turn))
        queued = len(waiters)
        wait_until(lambda: device.waiting == queued)  # noqa: B023 - asked before the loop goes on
    device.give()
    assert device.waiting == 3  # still held once
    device.give()
    for waiter in waiters:
        waiter.result()
    assert order == ["a", "b", "c"]


def test_a_device_waiter_leaves_at_its_deadline_or_when_its_caller_goes():
    device = DeviceQueue()
    device.take()
    with pytest.raises(QueueTimeout, match="^waited 0.05 s for the device"):
        Background(lambda: device.take(deadline_after(0.05))).result()
    with pytest.raises(WaiterGone):
        Background(lambda: device.take(gone=lambda: True)).result()
    assert device.waiting == 0
    with pytest.raises(RuntimeError, match="^the device turn is not this thread's$"):
        Background(device.give).result()
    device.give()
    with device:
        assert device.waiting == 0


# -- 3. one out-of-memory policy: split first, then the model's own prefixes ------------------------


class TightScorer(FakeScorer):
    """Runs out of memory (torch's own error type) on more than `fits` items, or on an item in
    `too_big` while its cache is on; `relieve` records the shortfalls it was asked to free."""

    def __init__(self, fits, too_big=()):
        super().__init__()
        self.fits, self.too_big = fits, set(too_big)
        self.calls_made: list[tuple[list[str], bool]] = []
        self.relieved: list[str] = []

    def score_batch(self, items, cached=True, left=None):
        ids = [item.id for item in items]
        self.calls_made.append((ids, cached))
        if len(items) > self.fits or (cached and self.too_big & set(ids)):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [Batched(self.result(item), len(items), 1) for item in items]

    def relieve(self, message):
        self.relieved.append(message)
        return True


def rows(*names):
    return [parse_row(row(id=name)) for name in names]


def test_a_batch_that_does_not_fit_is_split_before_any_stored_prefix_is_dropped():
    """The review's case: the fallback dropped stored prefixes and re-ran the whole batch without
    the cache before the batcher split it; each half fitted."""
    scorer = TightScorer(fits=2)
    outcomes = Engine(scorer, torch_module=torch).score_batch(rows("a", "b", "c", "d"))
    assert [outcome.outcome["id"] for outcome in outcomes] == ["a", "b", "c", "d"]
    assert scorer.relieved == []  # nobody's cache paid for it
    assert scorer.calls_made == [
        (["a", "b", "c", "d"], True),
        (["a", "b"], True),
        (["c", "d"], True),
    ]


def test_only_a_single_request_that_does_not_fit_drops_its_models_prefixes():
    scorer = TightScorer(fits=2, too_big={"c"})
    outcomes = Engine(scorer, torch_module=torch).score_batch(rows("a", "b", "c"))
    assert [outcome.outcome["id"] for outcome in outcomes] == ["a", "b", "c"]
    assert scorer.calls_made == [
        (["a", "b", "c"], True),
        (["a"], True),
        (["b", "c"], True),
        (["b"], True),
        (["c"], True),
        (["c"], False),  # after `relieve`: once more without the cache
    ]
    assert scorer.relieved == ["CUDA out of memory. Tried to allocate 2.00 GiB"]


def test_the_first_half_of_a_split_batch_may_relieve_its_single_request_too():
    scorer = TightScorer(fits=1, too_big={"a"})
    outcomes = Engine(scorer, torch_module=torch).score_batch(rows("a", "b"))
    assert [outcome.outcome["id"] for outcome in outcomes] == ["a", "b"]
    assert scorer.calls_made[-2:] == [(["a"], False), (["b"], True)]


def test_a_request_that_fits_nowhere_is_its_own_503_and_the_rest_are_scored():
    scorer = TightScorer(fits=0 + 1, too_big={"b"})
    scorer.relieve = lambda message: False  # its model's prefixes cannot cover it
    outcomes = Engine(scorer, torch_module=torch).score_batch(rows("a", "b"))
    assert outcomes[0].outcome["id"] == "a"
    assert isinstance(outcomes[1], OutOfMemory)


def test_a_load_whose_thread_cannot_start_leaves_the_model_unloaded(monkeypatch):
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    real_start = threading.Thread.start

    def start(thread):
        if thread.name.startswith("semif-load-"):
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    failed = Held(rt, "a")
    assert failed.done.wait(WAIT_S) and "can't start new thread" in str(failed.error)
    assert rt.entry("a").state == "unloaded" and rt.entry("a")._active == 0
    monkeypatch.setattr(threading.Thread, "start", real_start)
    assert Held(rt, "a").finish().error is None  # the next request loads it
    assert Background(lambda: rt.unload("a")).result() == {"id": "a", "loaded": False}


class Encoding(FakeScorer):
    """Its encoding names it: scoring another engine's encoding is a bug this catches."""

    def prepare(self, row):
        return (id(self), row)

    def score(self, item):
        encoder, row = item
        assert encoder == id(self), "scored an input another engine encoded"
        return super().score(row)


def test_a_leased_request_queued_behind_a_reconfigure_is_encoded_again_by_the_new_model():
    rt = runtime(
        spec("a", load_on_startup=True), factory=lambda model_spec: Engine(Encoding(block=True))
    )
    config = settings(parallel_slots=4)
    service = DecisionService(rt, config)
    first = rt.entry("a").engine._scorer
    holding = Background(lambda: service.decide(row(id="holding", model="a")))
    assert first.entered.wait(WAIT_S)
    reconfigure = Background(lambda: rt.register("a", {"source": "test:a2", "device": "cpu"}))
    wait_until(lambda: any(not waiter.is_request for waiter in rt.entry("a")._queue))
    behind = Background(lambda: service.decide(row(id="behind", model="a")))  # encoded by `first`
    wait_until(lambda: len(rt.entry("a")._queue) == 2)
    first.release.set()
    holding.result()
    reconfigure.result()
    second = rt.entry("a").engine._scorer
    assert second is not first
    second.release.set()
    assert behind.result().body["id"] == "behind"
    assert [call[0] for call in second.calls] == ["score"]


def test_a_deadline_counts_from_the_given_now():
    assert deadline_after(5, now=100.0) == Deadline(105.0, 5)
    assert deadline_after(0, now=100.0) is NEVER
