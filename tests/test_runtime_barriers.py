"""The runtime's admission edges: queue-timeout arithmetic, managers holding a model alone while
they load or evict, manager timeouts and bulk-unload failures. Fake engines; bounded waits."""

import threading
from types import SimpleNamespace

import pytest
from fakes import WAIT_S
from runtime_fixtures import (
    Background,
    Clock,
    Factory,
    Held,
    bulk_unload_with_a_failed_close,
    runtime,
    spec,
    wait_until,
)

from semif_serve.errors import InsufficientMemory, QueueTimedOut
from semif_serve.runtime import waiting as entry_module


def queued(rt, model_id="a"):
    return len(rt.entry(model_id)._queue)


@pytest.fixture
def frozen_clock(monkeypatch):
    """The queue's deadline clock, moved only by the test (the condition still wakes in real
    time, so a waiter re-checks its deadline at least every `timeout` seconds)."""
    clock = Clock()
    monkeypatch.setattr(entry_module, "time", SimpleNamespace(monotonic=clock))
    return clock


def test_a_waiter_inside_its_timeout_keeps_its_place(frozen_clock):
    rt = runtime(spec("a"), queue_timeout_s=0.5)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    waiting = Held(rt, "a")
    wait_until(lambda: queued(rt) == 1)
    holder.finish()
    assert waiting.finish().error is None


def test_a_waiter_leaves_exactly_at_its_deadline(frozen_clock):
    rt = runtime(spec("a"), queue_timeout_s=0.5)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    late = Held(rt, "a")
    wait_until(lambda: queued(rt) == 1)
    frozen_clock.now += 0.5
    assert late.done.wait(WAIT_S), "the waiter outlived its deadline"
    assert isinstance(late.error, QueueTimedOut)
    holder.finish()


def test_a_manager_past_the_queue_timeout_gets_server_busy_and_leaves_the_queue():
    rt = runtime(spec("a"), queue_timeout_s=0.05)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    unload = Background(lambda: rt.unload("a"))
    with pytest.raises(QueueTimedOut) as caught:
        unload.result()
    assert str(caught.value) == "waited 0.05 s for model 'a'"
    assert queued(rt) == 0 and rt.entry("a").status()["state"] == "ready"
    holder.finish()


def test_a_request_behind_a_reconfigure_waits_while_the_manager_loads():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    factory.load_gate = threading.Event()
    factory.load_started.clear()
    register = Background(lambda: rt.register("a", {"source": "test:a2", "device": "cpu"}))
    assert factory.load_started.wait(WAIT_S)  # the manager holds the model, loading
    later = Held(rt, "a")
    wait_until(lambda: queued(rt) == 1)
    assert rt.entry("a").status()["active_slots"] == 0
    factory.load_gate.set()
    assert register.result()["state"] == "ready"
    assert later.admitted.wait(WAIT_S)
    assert later.finish().engine.spec.source == "test:a2"


def test_an_evicted_model_is_held_alone_until_the_eviction_ends_then_serves_again():
    rt = runtime(spec("a"), spec("b"), max_loaded_models=1)
    Held(rt, "a").finish()
    evicting, gate = threading.Event(), threading.Event()

    def on_event(model_id, event):
        if event == "evict":
            evicting.set()
            assert gate.wait(WAIT_S)

    rt.on_event = on_event
    loader = Held(rt, "b")  # evicts idle a, and is held inside the eviction
    assert evicting.wait(WAIT_S)
    again = Held(rt, "a")
    wait_until(lambda: queued(rt, "a") == 1)  # a is unloaded, but not free yet
    assert rt.entry("a").status()["active_slots"] == 0
    gate.set()
    assert loader.admitted.wait(WAIT_S)
    # a is free again: its request is admitted, and finds b busy, so a cannot load.
    assert isinstance(again.finish().error, InsufficientMemory)
    loader.finish()
    assert Held(rt, "a").finish().error is None  # b is idle now and makes room


def test_bulk_unload_reports_a_failed_unload_after_handling_every_model():
    factory = Factory()
    rt = runtime(spec("a"), spec("b"), factory=factory)
    bulk_unload_with_a_failed_close(rt, factory)
    assert rt.entry("a").status()["state"] == "unloaded"


def test_the_wait_for_a_load_counts_from_when_the_request_queued(frozen_clock):
    """A request that waited for a slot, then for a load, has its timeout counted from when it
    queued: the wait for the load gets only what is left (issue 22.8)."""
    factory = Factory()
    factory.load_gate = threading.Event()
    rt = runtime(spec("a", slots=2), factory=factory)
    loader = Held(rt, "a")  # loads, held at the gate
    assert factory.load_started.wait(WAIT_S)
    left = threading.Event()
    spare = Held(rt, "a", gone=left.is_set)  # the second slot, waiting for the load
    wait_until(lambda: rt.entry("a")._active == 2)
    late = Held(rt, "a", timeout_s=0.5)  # queued at 1000.0 for a slot
    wait_until(lambda: queued(rt) == 1)
    frozen_clock.now += 0.3
    left.set()  # the spare slot frees at 1000.3: late is admitted and waits for the load
    assert spare.done.wait(WAIT_S)
    wait_until(lambda: queued(rt) == 0)
    frozen_clock.now += 0.25  # 1000.55: past 1000.0 + 0.5, though only 0.25 after admission
    assert late.done.wait(WAIT_S)
    assert isinstance(late.error, QueueTimedOut)
    assert str(late.error) == "waited 0.5 s for model 'a' (it was loading)"
    factory.load_gate.set()
    loader.finish()
