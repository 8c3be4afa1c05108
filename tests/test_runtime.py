"""The model runtime's lifecycle and orderings (behaviour contract T1..T16), with fake engines."""

import threading

import pytest
from fakes import WAIT_S
from runtime_fixtures import Background, Clock, Factory, Held, runtime, spec, wait_until

from semif_serve.errors import (
    BadManagementRequest,
    ClientGone,
    InsufficientMemory,
    ModelLoadFailed,
    ModelNotFound,
    QueueTimedOut,
)


def queued(rt, model_id="a"):
    return len(rt.entry(model_id)._queue)


# --- T1: cold load and the happy path -------------------------------------------------------------


def test_the_first_request_loads_an_unloaded_model_and_later_ones_reuse_it():
    factory = Factory()
    rt = runtime(spec("a", slots=2), factory=factory)
    assert rt.entry("a").status()["state"] == "unloaded"
    first = Held(rt, "a")
    assert first.admitted.wait(WAIT_S)
    assert rt.entry("a").status()["state"] == "ready"
    first.finish()
    Held(rt, "a").finish()
    assert factory.events == [("load", "a")]


def test_requests_admitted_during_a_load_wait_for_it_and_share_it():
    factory = Factory()
    factory.load_gate = threading.Event()
    rt = runtime(spec("a", slots=2), factory=factory)
    first, second = Held(rt, "a"), None
    assert factory.load_started.wait(WAIT_S)
    second = Held(rt, "a")
    wait_until(lambda: rt.entry("a").status()["active_slots"] == 2)
    assert rt.entry("a").status()["state"] == "loading"
    assert not first.admitted.is_set() and not second.admitted.is_set()
    factory.load_gate.set()
    assert first.admitted.wait(WAIT_S) and second.admitted.wait(WAIT_S)
    assert first.engine is second.engine
    first.finish(), second.finish()
    assert factory.events == [("load", "a")]


def test_a_failed_first_load_leaves_the_model_unloaded_and_the_next_request_retries():
    factory = Factory()
    factory.fail_next_load = OSError("weights missing")
    rt = runtime(spec("a"), factory=factory)
    failed = Held(rt, "a").finish()
    assert isinstance(failed.error, ModelLoadFailed)
    # The caller is told the model and the kind of failure; the status and the log say all.
    assert str(failed.error) == (
        "loading model 'a' failed (OSError); its last_load_error in GET /v1/models and the "
        "server's log say why"
    )
    status = rt.entry("a").status()
    assert status | {"last_used": None, "last_load_error": None} == status | {
        "state": "unloaded",
        "loaded": False,
        "active_slots": 0,
        "last_used": None,
        "last_load_error": None,
    }
    assert status["last_load_error"]["message"] == "loading model 'a' failed: weights missing"
    retry = Held(rt, "a")
    assert retry.admitted.wait(WAIT_S)
    retry.finish()
    assert rt.entry("a").status()["last_load_error"] is None  # a load succeeded since
    assert factory.events == [("load", "a"), ("load", "a")]


# --- T3: FIFO, slots and the queue timeout ---------------------------------------------------------


def test_spare_slots_admit_and_a_full_model_queues_in_arrival_order():
    rt = runtime(spec("a", slots=2))
    held = [Held(rt, "a"), Held(rt, "a")]
    for request in held:
        assert request.admitted.wait(WAIT_S)
    waiting = []
    for count in range(1, 4):
        waiting.append(Held(rt, "a"))
        wait_until(lambda expected=count: queued(rt) == expected)
    assert rt.entry("a").status()["queued_requests"] == 3
    assert not any(request.admitted.is_set() for request in waiting)
    held[0].finish()
    assert waiting[0].admitted.wait(WAIT_S)
    assert not waiting[1].admitted.is_set() and not waiting[2].admitted.is_set()
    held[1].finish()
    assert waiting[1].admitted.wait(WAIT_S)
    assert not waiting[2].admitted.is_set()
    for request in waiting:
        request.finish()
    assert waiting[2].error is None


def test_a_queued_request_past_its_timeout_gets_server_busy_and_leaves_the_queue():
    rt = runtime(spec("a"), queue_timeout_s=0.05)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    late = Held(rt, "a").finish()  # the timeout ends it; the holder still runs
    assert isinstance(late.error, QueueTimedOut)
    assert str(late.error) == "waited 0.05 s for model 'a'"
    assert queued(rt) == 0
    holder.finish()


def test_a_queued_request_whose_caller_left_leaves_the_queue_and_the_next_is_admitted():
    rt = runtime(spec("a"))
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    asked, left = threading.Event(), threading.Event()

    def gone() -> bool:
        asked.set()
        return left.is_set()

    waiting = Held(rt, "a", gone=gone)
    behind = Held(rt, "a")
    wait_until(lambda: queued(rt) == 2)
    assert asked.wait(WAIT_S)  # asked while it waits, not only at its turn
    left.set()
    assert waiting.done.wait(WAIT_S)  # gone while the holder still holds the model
    assert isinstance(waiting.error, ClientGone)
    assert str(waiting.error) == (
        "the client closed its connection: the caller left while waiting for model 'a'"
    )
    assert queued(rt) == 1 and not behind.admitted.is_set()
    holder.finish()
    assert behind.admitted.wait(WAIT_S)
    behind.finish()


def test_a_queued_request_whose_caller_stays_is_admitted_in_its_turn():
    rt = runtime(spec("a"))
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    asked = threading.Event()

    def gone() -> bool:
        asked.set()
        return False

    staying = Held(rt, "a", gone=gone)
    assert asked.wait(WAIT_S)
    asked.clear()
    assert asked.wait(WAIT_S)  # asked again: the wait polls
    assert queued(rt) == 1
    holder.finish()
    assert staying.admitted.wait(WAIT_S)
    assert staying.error is None
    staying.finish()


def test_a_caller_that_stays_still_gets_its_queue_timeout():
    rt = runtime(spec("a"), queue_timeout_s=0.05)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    late = Held(rt, "a", gone=lambda: False).finish()
    assert isinstance(late.error, QueueTimedOut)
    assert queued(rt) == 0
    holder.finish()


def test_polling_for_a_gone_caller_never_sleeps_past_the_queue_timeout():
    rt = runtime(spec("a"), queue_timeout_s=0.05)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    condition, waits = rt.entry("a")._cond, []
    real_wait = condition.wait

    def recording_wait(timeout=None):
        waits.append(timeout)
        return real_wait(timeout)

    condition.wait = recording_wait
    late = Held(rt, "a", gone=lambda: False).finish()
    assert isinstance(late.error, QueueTimedOut)
    assert waits and all(timeout is not None and timeout <= 0.05 for timeout in waits)
    holder.finish()


def test_a_request_may_only_lower_the_queue_timeout():
    rt = runtime(spec("a"), queue_timeout_s=30)
    assert rt.queue_timeout(0.5) == 0.5
    assert rt.queue_timeout(100) == 30
    assert rt.queue_timeout(None) == 30
    assert runtime(spec("a"), queue_timeout_s=0).queue_timeout(None) is None  # 0: unbounded
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    assert isinstance(Held(rt, "a", timeout_s=0.05).finish().error, QueueTimedOut)
    holder.finish()


def test_an_unknown_model_is_not_found():
    with pytest.raises(ModelNotFound, match="'nope'"):
        with runtime(spec("a")).lease("nope"):
            pass


# --- T2 / T14: managers are barriers ---------------------------------------------------------------


def test_a_manager_waits_for_earlier_requests_and_later_requests_cannot_barge_past_it():
    factory = Factory()
    rt = runtime(spec("a", slots=4), factory=factory)
    earlier = Held(rt, "a")
    assert earlier.admitted.wait(WAIT_S)
    unload = Background(lambda: rt.unload("a"))
    wait_until(lambda: queued(rt) == 1)
    later = Held(rt, "a")  # three slots are free, but the manager is ahead
    wait_until(lambda: queued(rt) == 2)
    assert not unload.done.is_set() and not later.admitted.is_set()
    assert rt.entry("a").status()["queued_requests"] == 1  # the manager is not a request
    earlier.finish()
    assert unload.result() == {"id": "a", "loaded": False}
    assert later.admitted.wait(WAIT_S)  # then reloads
    later.finish()
    assert factory.events == [("load", "a"), ("close", "a"), ("load", "a")]


def test_unload_is_idempotent():
    rt = runtime(spec("a"))
    assert rt.unload("a") == {"id": "a", "loaded": False}
    assert rt.unload("a") == {"id": "a", "loaded": False}
    with pytest.raises(ModelNotFound):
        rt.unload("b")


# --- T4 / T9 / T12 / T16: registration and reconfiguration ----------------------------------------


def test_registering_a_new_model_publishes_it_and_loads_it():
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    status = rt.register("b", {"source": "test:b", "device": "cpu", "slots": 2, "keep_alive_s": 30})
    assert status["state"] == "ready" and status["slots"] == 2 and status["keep_alive_s"] == 30
    assert [s["id"] for s in rt.status()] == ["a", "b"]


def test_an_unsupported_slot_count_keeps_the_working_configuration():
    factory = Factory(capacity=2)
    rt = runtime(spec("a", slots=1), factory=factory)
    rt.register("a", {"source": "test:a", "device": "cpu", "slots": 2})
    engine = rt.entry("a").engine
    with pytest.raises(BadManagementRequest, match="slots: 3 is more than the 2"):
        rt.register("a", {"source": "test:a", "device": "cpu", "slots": 3})
    assert rt.entry("a").engine is engine and rt.entry("a").spec.slots == 2
    Held(rt, "a").finish()  # and it still serves


def test_a_bad_spec_is_refused_before_anything_changes():
    rt = runtime(spec("a"))
    for table, message in [
        ({"device": "cpu"}, "source: required"),
        ({"source": "x", "slots": 17}, "slots: must be an integer 1..16"),
        ({"source": "x", "colour": "red"}, "unknown keys"),
    ]:
        with pytest.raises(BadManagementRequest, match=message):
            rt.register("a", table)
    with pytest.raises(BadManagementRequest, match="model id"):
        rt.register("unload", {"source": "x"})


def test_a_failed_reconfigure_leaves_the_old_engine_and_configuration_serving():
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    old_engine = Held(rt, "a").finish().engine
    factory.fail_next_load = RuntimeError("new weights broken")
    with pytest.raises(ModelLoadFailed, match="new weights broken"):
        rt.register("a", {"source": "test:a2", "device": "cpu"})
    status = rt.entry("a").status()
    assert status["state"] == "ready" and status["source"] == "test:a"
    assert "new weights broken" in status["last_load_error"]["message"]
    assert Held(rt, "a").finish().engine is old_engine  # never torn down
    assert factory.events == [("load", "a"), ("load", "a")]


# --- T5 / T11: bulk unload --------------------------------------------------------------------------


def test_bulk_unload_frees_idle_models_first_and_reports_unknown_ids():
    factory = Factory()
    rt = runtime(spec("a"), spec("b"), factory=factory)
    Held(rt, "b").finish()
    busy = Held(rt, "a")
    assert busy.admitted.wait(WAIT_S)
    bulk = Background(lambda: rt.bulk_unload(["a", "b", "zz", "a"]))
    wait_until(lambda: ("close", "b") in factory.events)  # idle b goes without waiting for a
    assert not bulk.done.is_set()
    busy.finish()
    assert bulk.result() == {"unloaded": ["a", "b"], "not_found": ["zz"]}
    assert [s["state"] for s in rt.status()] == ["unloaded", "unloaded"]


def test_overlapping_bulk_unloads_in_reverse_order_do_not_deadlock():
    rt = runtime(spec("a"), spec("b"))
    holders = [Held(rt, "a"), Held(rt, "b")]
    for holder in holders:
        assert holder.admitted.wait(WAIT_S)
    first = Background(lambda: rt.bulk_unload(["a", "b"]))
    second = Background(lambda: rt.bulk_unload(["b", "a"]))
    wait_until(lambda: queued(rt, "a") == 2 and queued(rt, "b") == 2)
    for holder in holders:
        holder.finish()
    assert first.result()["unloaded"] == ["a", "b"]
    assert second.result()["unloaded"] == ["b", "a"]


# --- T6: residency and idle retirement -------------------------------------------------------------


def test_loading_past_the_limit_evicts_the_least_recently_used_idle_model():
    factory, clock = Factory(), Clock()
    rt = runtime(spec("a"), spec("b"), spec("c"), factory=factory, clock=clock, max_loaded_models=2)
    Held(rt, "a").finish()
    clock.now += 1
    Held(rt, "b").finish()
    clock.now += 1
    Held(rt, "a").finish()  # a is now the most recently used
    clock.now += 1
    Held(rt, "c").finish()
    assert ("close", "b") in factory.events and ("close", "a") not in factory.events
    assert {s["id"]: s["loaded"] for s in rt.status()} == {"a": True, "b": False, "c": True}


def test_busy_models_are_never_evicted_and_the_load_gets_insufficient_memory():
    rt = runtime(spec("a"), spec("b"), max_loaded_models=1)
    busy = Held(rt, "a")
    assert busy.admitted.wait(WAIT_S)
    refused = Held(rt, "b").finish()
    assert isinstance(refused.error, InsufficientMemory)
    assert rt.entry("b").status()["state"] == "unloaded"
    busy.finish()
    Held(rt, "b").finish()  # a is idle now, so it can go


def test_idle_models_retire_after_keep_alive_and_status_resets_no_timer():
    factory, clock = Factory(), Clock()
    rt = runtime(spec("a", keep_alive_s=60), spec("b"), factory=factory, clock=clock)
    Held(rt, "a").finish()
    Held(rt, "b").finish()
    clock.now += 59
    rt.status()  # observing is not using
    assert rt.retire_idle() == []
    clock.now += 1
    assert rt.retire_idle() == ["a"]  # b has no keep_alive_s: it stays
    assert {s["id"]: s["loaded"] for s in rt.status()} == {"a": False, "b": True}


def test_a_busy_model_is_not_retired_even_past_keep_alive():
    clock = Clock()
    rt = runtime(spec("a", keep_alive_s=1), clock=clock)
    Held(rt, "a").finish()
    busy = Held(rt, "a")
    assert busy.admitted.wait(WAIT_S)
    clock.now += 10
    assert rt.retire_idle() == []
    busy.finish()


# --- T7 / T8: status and shutdown ------------------------------------------------------------------


def test_status_reports_every_field_and_reserves_nothing():
    rt = runtime(spec("a", slots=2))
    [before] = rt.status()
    assert before == {
        "id": "a",
        "state": "unloaded",
        "loaded": False,
        "slots": 2,
        "active_slots": 0,
        "queued_requests": 0,
        "max_parallel_slots": None,
        "source": "test:a",
        "revision": None,
        "keep_alive_s": None,
        "last_used": None,
        "last_load_error": None,
        "prefix_cache": None,
        "queue": {
            "estimated_wait_s": None,  # nothing measured yet
            "waits": 0,
            "waited_s": 0.0,
            "estimated_waits": 0,
            "estimated_s": 0.0,
            "estimated_waited_s": 0.0,
            "abandoned_queued": 0,
            "abandoned_scoring": 0,
        },
        "batching": {"max_rows": 1, "max_tokens": 16384, "wait_ms": 0},
    }
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    [during] = rt.status()
    assert during["active_slots"] == 1 and during["max_parallel_slots"] == 16 and during["loaded"]
    assert during["revision"] == "0" * 40  # the loaded engine's own (issue 24: one revision)
    holder.finish()


def test_close_stops_retirement_and_unloads_every_model():
    factory = Factory()
    rt = runtime(spec("a"), spec("b"), factory=factory)
    rt.start(idle_interval_s=0.01)  # a retirement thread to join
    Held(rt, "a").finish()
    rt.close()
    assert not rt._idle_thread.is_alive()
    assert ("close", "a") in factory.events
    assert [s["state"] for s in rt.status()] == ["unloaded", "unloaded"]


def test_startup_loads_load_on_startup_models_and_fails_closed():
    factory = Factory()
    runtime(spec("a", load_on_startup=True), spec("b"), factory=factory)
    assert factory.events == [("load", "a")]
    factory = Factory()
    factory.fail_next_load = OSError("no weights")
    with pytest.raises(ModelLoadFailed, match="no weights"):
        runtime(spec("a", load_on_startup=True), factory=factory)


# --- more orderings: loads, two models, manager order ----------------------------------------------


def test_an_unload_arriving_during_a_first_load_waits_for_it_then_unloads():
    factory = Factory()
    factory.load_gate = threading.Event()
    rt = runtime(spec("a"), factory=factory)
    loader = Held(rt, "a")
    assert factory.load_started.wait(WAIT_S)
    unload = Background(lambda: rt.unload("a"))
    wait_until(lambda: queued(rt) == 1)
    assert rt.entry("a").status()["state"] == "loading"  # never a partial pool
    factory.load_gate.set()
    assert loader.admitted.wait(WAIT_S)
    assert not unload.done.is_set()
    loader.finish()
    assert unload.result() == {"id": "a", "loaded": False}
    assert factory.events == [("load", "a"), ("close", "a")]


def test_a_warm_model_serves_while_another_model_loads():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), spec("b"), factory=factory)
    factory.load_gate, factory.load_started = threading.Event(), threading.Event()  # a's was set
    cold = Held(rt, "b")
    assert factory.load_started.wait(WAIT_S)
    Held(rt, "a").finish()  # does not wait for b's load
    assert rt.entry("b").status()["state"] == "loading"
    factory.load_gate.set()
    cold.finish()
    assert cold.error is None


def test_managers_on_one_model_run_in_arrival_order():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    unload = Background(lambda: rt.unload("a"))
    wait_until(lambda: queued(rt) == 1)
    register = Background(lambda: rt.register("a", {"source": "test:a2", "device": "cpu"}))
    wait_until(lambda: queued(rt) == 2)
    holder.finish()
    assert unload.result() == {"id": "a", "loaded": False}
    assert register.result()["state"] == "ready"
    assert factory.events == [("load", "a"), ("close", "a"), ("load", "a")]
    assert rt.entry("a").spec.source == "test:a2"


def test_a_request_queued_behind_a_reconfigure_binds_the_new_configuration():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    holder = Held(rt, "a")
    assert holder.admitted.wait(WAIT_S)
    old_engine = holder.engine
    register = Background(lambda: rt.register("a", {"source": "test:new", "device": "cpu"}))
    wait_until(lambda: queued(rt) == 1)
    later = Held(rt, "a")
    wait_until(lambda: queued(rt) == 2)
    holder.finish()
    register.result()
    assert later.admitted.wait(WAIT_S)
    assert later.engine is not old_engine and later.engine.spec.source == "test:new"
    later.finish()


def test_the_memory_budget_evicts_idle_models_until_a_new_one_fits():
    factory, clock = Factory(), Clock()
    factory.sizes = {"a": 3 << 30, "b": 3 << 30, "c": 5 << 30}
    rt = runtime(spec("a"), spec("b"), spec("c"), factory=factory, clock=clock, memory_budget_gib=8)
    Held(rt, "a").finish()
    clock.now += 1
    Held(rt, "b").finish()  # 6 GiB used
    clock.now += 1
    Held(rt, "c").finish()  # needs 5: a (least recently used) goes, 3 + 5 fit
    assert {s["id"]: s["loaded"] for s in rt.status()} == {"a": False, "b": True, "c": True}
    assert ("close", "a") in factory.events


def test_the_memory_budget_refuses_a_model_when_busy_ones_hold_it():
    factory = Factory()
    factory.sizes = {"a": 6 << 30, "b": 3 << 30}
    rt = runtime(spec("a"), spec("b"), factory=factory, memory_budget_gib=8)
    busy = Held(rt, "a")
    assert busy.admitted.wait(WAIT_S)
    refused = Held(rt, "b").finish()
    assert isinstance(refused.error, InsufficientMemory) and "needs 3.00 GiB" in str(refused.error)
    assert rt.entry("b").status()["state"] == "unloaded" and ("close", "b") in factory.events
    busy.finish()


# --- issue 22.8: waiting for another request's load is bounded, and its failure is shared ---


def test_a_request_waiting_for_a_load_gets_server_busy_at_its_own_timeout():
    factory = Factory()
    factory.load_gate = threading.Event()
    rt = runtime(spec("a", slots=2), factory=factory)
    loader = Held(rt, "a")  # admitted first: it loads
    assert factory.load_started.wait(WAIT_S)
    waiter = Held(rt, "a", timeout_s=0.05).finish()  # admitted to the spare slot, then waits
    assert isinstance(waiter.error, QueueTimedOut)
    assert str(waiter.error) == "waited 0.05 s for model 'a' (it was loading)"
    assert rt.entry("a")._active == 1  # its slot was released; the load goes on
    factory.load_gate.set()
    assert loader.admitted.wait(WAIT_S)
    loader.finish()
    assert factory.events == [("load", "a")]


def test_a_request_waiting_for_a_load_leaves_when_its_caller_does():
    factory = Factory()
    factory.load_gate = threading.Event()
    rt = runtime(spec("a", slots=2), factory=factory)
    loader = Held(rt, "a")  # admitted first: it loads
    assert factory.load_started.wait(WAIT_S)
    left = threading.Event()
    waiter = Held(rt, "a", gone=left.is_set)  # admitted to the spare slot, waits for the load
    wait_until(lambda: rt.entry("a")._active == 2)
    left.set()
    assert waiter.done.wait(WAIT_S)
    assert isinstance(waiter.error, ClientGone)
    assert "left while waiting for model 'a'" in str(waiter.error)
    assert rt.entry("a")._active == 1  # its slot was released; the load goes on
    factory.load_gate.set()
    assert loader.admitted.wait(WAIT_S)
    loader.finish()
    waiter.finish()


def test_one_failed_load_answers_every_request_that_waited_for_it():
    factory = Factory()
    factory.load_gate = threading.Event()
    factory.fail_next_load = ModelLoadFailed("the weights are broken")
    rt = runtime(spec("a", slots=4), factory=factory)
    loader = Held(rt, "a")
    assert factory.load_started.wait(WAIT_S)
    waiters = [Held(rt, "a") for _ in range(3)]
    wait_until(lambda: rt.entry("a")._active == 4)  # all admitted, three waiting on the load
    factory.load_gate.set()
    for held in [loader, *waiters]:
        assert held.done.wait(WAIT_S)
        assert isinstance(held.error, ModelLoadFailed)
        assert str(held.error).startswith("loading model 'a' failed (")
    assert factory.events == [("load", "a")]  # one load, not one per waiter
    assert rt.entry("a")._active == 0 and rt.entry("a").state == "unloaded"
    factory.load_gate.clear()
    factory.load_started.clear()
    condition, waiting = rt.entry("a")._cond, threading.Event()
    real_wait = condition.wait

    def noted_wait(timeout=None):
        waiting.set()  # only a request waiting for the load waits on the condition here
        return real_wait(timeout)

    condition.wait = noted_wait
    retry = Held(rt, "a")  # a later request tries a new load, which works
    assert factory.load_started.wait(WAIT_S)
    beside = Held(rt, "a")  # and one waiting for it gets the engine, not the old failure
    assert waiting.wait(WAIT_S)
    factory.load_gate.set()
    for held in (retry, beside):
        assert held.admitted.wait(WAIT_S), held.error
        held.finish()
        assert held.error is None
    assert factory.events == [("load", "a"), ("load", "a")]
