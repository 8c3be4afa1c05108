"""Issue 13, finding 1: nothing that raises during admission may strand a waiter.

Each case injects one failure at one step a request (or a manager) goes through: the queue's
deadline clock, the condition's wait, the engine load, publication (the model's clock), the
metrics hook, the lease's body, the release. After it, the model's queue is empty, no slot is
held, no manager holds the model, the waiter queued behind the victim is admitted, and so is a
request after that. The injected error is a BaseException (an interrupt must not be swallowed
either). Fake engines; every wait is bounded.
"""

import gc
import logging
import threading
import time
import weakref
from collections import Counter
from types import SimpleNamespace

import pytest
from fakes import WAIT_S
from runtime_fixtures import Background, Factory, Held, runtime, spec, wait_until

from semif_serve.errors import BadManagementRequest, ModelLoadFailed
from semif_serve.runtime import waiting as entry_module
from semif_serve.runtime.scheduler import ModelScheduler

GIB = 1 << 30


class Injected(BaseException):
    """Stands for any failure, down to an interrupt."""


class Faults:
    """Hooks that count their calls on the victim's thread and raise `Injected` at the `nth`
    call of the hook named `name` (None: never, to see which steps a path reaches)."""

    def __init__(self, name=None, nth=0):
        self.name, self.nth = name, nth
        self.victim: int | None = None
        self.calls: Counter = Counter()

    def on_victims_path(self):
        """The victim's own thread, or the load it started (a request's load runs in a thread
        of its own, so that its waits keep their deadline)."""
        return threading.get_ident() == self.victim or threading.current_thread().name.startswith(
            "semif-load-"
        )

    def hook(self, name, real):
        def hooked(*args, **kwargs):
            if self.on_victims_path():
                count = self.calls[name]
                self.calls[name] += 1
                if (name, count) == (self.name, self.nth):
                    raise Injected(name)
            return real(*args, **kwargs)

        return hooked

    def queue_behind(self, rt, victim, model_id="a"):
        """A request queued behind the victim, once the victim waits or has failed already."""
        queue = rt.entry(model_id)._queue
        fails_first_wait = (self.name, self.nth) == ("wait", 0)
        wait_until(lambda: victim.done.is_set() or (self.calls["wait"] and not fails_first_wait))
        ahead = len(queue)
        behind = Held(rt, model_id)
        wait_until(lambda: len(queue) == ahead + 1)
        return behind

    def run(self, call):
        """`call` on the victim's thread; returns its Background."""

        def victim():
            self.victim = threading.get_ident()
            return call()

        return Background(victim)


def install(faults, rt, monkeypatch, model_id="a"):
    entry = rt.entry(model_id)
    clock = faults.hook("clock", time.monotonic)
    monkeypatch.setattr(entry_module, "time", SimpleNamespace(monotonic=clock))
    entry._cond.wait = faults.hook("wait", entry._cond.wait)
    entry._clock = faults.hook("model clock", entry._clock)
    rt._factory = faults.hook("load", rt._factory)
    rt.on_event = faults.hook("event", rt.on_event)


def gate_close(factory, model_id="a"):
    """The model's current engine closes only when the returned event is set."""
    engine, gate, closing = factory.engines[model_id], threading.Event(), threading.Event()
    real_close = engine.close

    def close():
        closing.set()
        assert gate.wait(WAIT_S), "test never opened the close gate"
        real_close()

    engine.close = close
    return gate, closing


def assert_clean(rt, factory, model_id="a"):
    """Nothing queued, held or managed; every engine built is closed but the serving one."""
    entry = rt.entry(model_id)
    status = entry.status()
    assert len(entry._queue) == 0 and status["queued_requests"] == 0
    assert status["active_slots"] == 0 and not entry._managed
    assert status["state"] in ("ready", "unloaded")
    built = factory.events.count(("load", model_id))
    closed = factory.events.count(("close", model_id))
    assert built - closed == (1 if status["state"] == "ready" else 0), factory.events
    assert Held(rt, model_id).finish().error is None  # and the model serves the next request


# --- requests ------------------------------------------------------------------------------------

REQUEST_STEPS = [
    ("clock", 0),  # the queue deadline
    ("clock", 1),  # the time left, before the first wait
    ("wait", 0),  # the condition's wait
    ("load", 0),  # the victim is the first admitted request of an unloaded model: it loads
    ("model clock", 0),  # publication
    ("event", 0),  # the metrics hook after publication
    ("body", 0),  # the lease's body
    ("model clock", 1),  # the release
]


def request_behind_an_unload(faults, monkeypatch):
    """The victim queues behind an unload held inside its teardown, and a second request queues
    behind the victim; then the unload ends. Returns (runtime, factory, victim, behind)."""
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory, queue_timeout_s=WAIT_S)
    gate, closing = gate_close(factory)
    unload = Background(lambda: rt.unload("a"))
    assert closing.wait(WAIT_S)
    install(faults, rt, monkeypatch)

    def lease():
        with rt.lease("a", WAIT_S):
            faults.hook("body", lambda: None)()

    victim = faults.run(lease)
    behind = faults.queue_behind(rt, victim)
    gate.set()
    assert unload.result() == {"id": "a", "loaded": False}
    return rt, factory, victim, behind


@pytest.mark.parametrize(("name", "nth"), REQUEST_STEPS)
def test_a_request_failing_at_any_step_leaves_nothing_behind(name, nth, monkeypatch):
    faults = Faults(name, nth)
    rt, factory, victim, behind = request_behind_an_unload(faults, monkeypatch)
    if (name, nth) == ("event", 0):
        # The metrics hook runs in the load's own thread, after the model was published: the
        # load's failure, not the victim's, which is served by the published model.
        victim.result()
    else:
        with pytest.raises(Injected, match=f"^{name}$"):
            victim.result()
    assert behind.admitted.wait(WAIT_S), "the request behind the victim was never woken"
    assert behind.finish().error is None
    assert_clean(rt, factory)


def test_every_request_step_is_on_the_path(monkeypatch):
    faults = Faults()
    rt, factory, victim, behind = request_behind_an_unload(faults, monkeypatch)
    victim.result()
    behind.finish()
    assert all(faults.calls[name] > nth for name, nth in REQUEST_STEPS), faults.calls
    assert_clean(rt, factory)


# --- managers ------------------------------------------------------------------------------------

MANAGER_STEPS = [
    ("clock", 0),
    ("clock", 1),
    ("wait", 0),
    ("load", 0),
    ("model clock", 0),
    ("event", 0),
]
MODES = {  # the reconfigure's two ways: beside the old engine, or instead of it
    "beside": {},
    "instead": {"memory_budget_gib": 1.0},  # 0.6 + 0.6 GiB do not fit in 1
}


def reconfigure_behind_a_request(faults, monkeypatch, mode):
    """The victim (a reconfigure) queues behind a running request, and a request queues behind
    the victim; then the running request ends. Returns (runtime, factory, victim, behind)."""
    factory = Factory()
    factory.sizes = {"a": int(0.6 * GIB)}
    rt = runtime(
        spec("a", load_on_startup=True), factory=factory, queue_timeout_s=WAIT_S, **MODES[mode]
    )
    running = Held(rt, "a")
    assert running.admitted.wait(WAIT_S)
    install(faults, rt, monkeypatch)
    rt._source_check = lambda spec: int(0.6 * GIB)
    victim = faults.run(lambda: rt.register("a", {"source": "test:a2", "device": "cpu"}))
    behind = faults.queue_behind(rt, victim)
    running.finish()
    return rt, factory, victim, behind


@pytest.mark.parametrize(
    ("mode", "name", "nth"),
    [(mode, *step) for mode in MODES for step in MANAGER_STEPS] + [("instead", "event", 1)],
)
def test_a_reconfigure_failing_at_any_step_leaves_nothing_behind(mode, name, nth, monkeypatch):
    faults = Faults(name, nth)
    rt, factory, victim, behind = reconfigure_behind_a_request(faults, monkeypatch, mode)
    with pytest.raises(Injected, match=f"^{name}$"):
        victim.result()
    assert behind.admitted.wait(WAIT_S), "the request behind the victim was never woken"
    assert behind.finish().error is None
    assert_clean(rt, factory)


@pytest.mark.parametrize("mode", MODES)
def test_every_reconfigure_step_is_on_the_path(mode, monkeypatch):
    faults = Faults()
    rt, factory, victim, behind = reconfigure_behind_a_request(faults, monkeypatch, mode)
    assert victim.result()["source"] == "test:a2"
    assert behind.finish().engine.spec.source == "test:a2"
    events = 2 if mode == "instead" else 1  # instead: the old engine's unload, then the load
    assert all(faults.calls[name] > nth for name, nth in MANAGER_STEPS), faults.calls
    assert faults.calls["event"] == events
    assert_clean(rt, factory)


# --- the finding itself, and the other exits -----------------------------------------------------


@pytest.mark.parametrize(
    "timeout_s",
    [10**400, 1e10, 1e300, float("inf"), float("nan")],
    ids=["10**400", "1e10", "1e300", "inf", "nan"],
)
def test_a_huge_timeout_waits_like_a_long_one_and_leaves_no_waiter(timeout_s):
    """A 400-digit timeout used to raise OverflowError after the waiter was queued, and every
    later request waited forever."""
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)  # no SEMIF_QUEUE_TIMEOUT_S: the request's own wins
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    waiting = Held(rt, "a", timeout_s=timeout_s)
    wait_until(lambda: len(rt.entry("a")._queue) == 1)
    holder.finish()
    assert waiting.finish().error is None
    assert_clean(rt, factory)


def test_a_bulk_unload_whose_thread_cannot_start_withdraws_its_barriers(monkeypatch):
    factory = Factory()
    rt = runtime(spec("a"), spec("b"), factory=factory)
    holders = [Held(rt, "a"), Held(rt, "b")]
    for holder in holders:
        assert holder.admitted.wait(WAIT_S)
    real_start, started = threading.Thread.start, []

    def start(thread):  # the bulk's second unload thread cannot start
        if getattr(thread._target, "__name__", None) == "unload":  # bulk_unload's own threads
            if started:
                raise RuntimeError("can't start new thread")
            started.append(thread)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    bulk = Background(lambda: rt.bulk_unload(["a", "b"]))
    wait_until(lambda: len(rt.entry("a")._queue) == 1 and len(rt.entry("b")._queue) == 0)
    for holder in holders:
        holder.finish()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        bulk.result()
    assert [s["state"] for s in rt.status()] == ["unloaded", "ready"]  # a's unload did run
    for model_id in ("a", "b"):
        assert_clean(rt, factory, model_id)


def test_a_failed_close_leaves_the_model_unloaded_and_the_next_request_loads_it():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)

    def broken_close():
        raise RuntimeError("close failed")

    factory.engines["a"].close = broken_close
    with pytest.raises(RuntimeError, match="^close failed$"):
        rt.unload("a")
    assert rt.entry("a").status()["state"] == "unloaded"  # not stuck "unloading"
    assert Held(rt, "a").finish().error is None


class Weights:
    """Stands for the model a failed build made (weakly referable)."""


class FailingBuild(Factory):
    """A build that makes its model, then fails (a warm-up that ran out of memory): the model
    is a local of the failing frame, which the raised exception's traceback holds."""

    def __call__(self, spec):
        self.events.append(("load", spec.id))
        weights = Weights()
        self.built = weakref.ref(weights)
        raise RuntimeError("warm-up failed")


def test_a_failed_lazy_load_keeps_no_reference_to_the_model_it_built():
    """Issue 40, defect 4: the failure handed to the waiting requests is a copy without the
    traceback, so the model the failed build made is freed at once, not at the next failure."""
    factory = FailingBuild()
    rt = runtime(spec("a"), factory=factory)
    failed = Held(rt, "a").finish().error
    assert "loading model 'a' failed (RuntimeError)" in str(failed)
    failed = None  # the test's own reference to what it was handed
    gc.collect()
    assert factory.built() is None
    assert "warm-up failed" in rt.entry("a").status()["last_load_error"]["message"]


class RetiredBetweenReads(ModelScheduler):
    """A scheduler whose engine is retired right after its first read."""

    @property
    def engine(self):
        engine, self._engine = self.__dict__.get("_engine"), None
        return engine

    @engine.setter
    def engine(self, value):
        self._engine = value


def test_health_reads_the_default_model_once_while_a_retire_may_run():
    """Issue 40, defect 7: `/health` read the default model's engine twice without the lock, so
    a retire in between answered the load balancer's probe with a 500."""
    rt = runtime(spec("a"), factory=Factory())
    Held(rt, "a").finish()
    loaded = rt.entry("a").engine.model_info()
    racing = RetiredBetweenReads(rt.entry("a").spec, rt._clock, rt._batching)
    racing.engine = rt.entry("a").engine
    rt._entries["a"] = racing
    assert rt.default_model_info() == loaded
    assert rt.default_model_info() == racing.spec.identity()  # now unloaded: as configured


def test_a_lazy_reload_that_no_longer_fits_its_slots_is_a_load_failure_not_a_400(caplog):
    """Issue 40, defect 5: a model registered with slots=4, evicted, then reloaded by a request
    on a device that takes 2 today answered that request with the management 400 "slots: 4 is
    more than the 2 this model supports". Now the request gets the model's load failure (503),
    saying why; the registration stays, and loads again once the device takes it."""
    factory = Factory(capacity=16)
    rt = runtime(spec("a", slots=4), factory=factory)
    Held(rt, "a").finish()
    rt.unload("a")
    factory.capacity = 2
    with caplog.at_level(logging.WARNING, logger="semif_serve.runtime.lifecycle"):
        failed = Held(rt, "a").finish().error
    assert [record.getMessage() for record in caplog.records] == [
        "model a cannot be loaded as registered: a.slots: 4 is more than the 2 this model supports"
    ]
    assert isinstance(failed, ModelLoadFailed) and not isinstance(failed, BadManagementRequest)
    assert "cannot be loaded as registered" in str(failed)
    assert "a.slots: 4 is more than the 2 this model supports" in str(failed)
    assert rt.entry("a").spec.slots == 4
    factory.capacity = 16
    assert Held(rt, "a").finish().error is None
