"""Issue 13, finding 7: a reconfigure never costs the serving model.

A source that cannot load is refused before anything changes; new weights load beside the old
ones when SEMIF_MEMORY_BUDGET_GIB and SEMIF_VRAM_CAP_GIB allow, and the switch happens only once
the new engine is built (warm-up included); otherwise the old engine goes first and comes back
when the new one fails. Every failed load is the model's last_load_error until a load succeeds.
Fake engines; every wait is bounded.
"""

import re
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from fakes import WAIT_S
from runtime_fixtures import Background, Clock, Factory, Held, runtime, spec, wait_until

from semif_serve.engine.boot import check_source
from semif_serve.errors import (
    BadManagementRequest,
    InsufficientMemory,
    ModelLoadFailed,
    ModelNotFound,
)

GIB = 1 << 30
NEW = {"source": "test:a2", "device": "cpu"}


def sized(factory, **sizes_gib):
    factory.sizes = {model_id: int(gib * GIB) for model_id, gib in sizes_gib.items()}
    return factory


def estimate(gib):
    return lambda spec: None if gib is None else int(gib * GIB)


def served_by(rt, model_id="a"):
    return Held(rt, model_id).finish().engine


# --- the check before anything changes ------------------------------------------------------------


@pytest.mark.parametrize("model_id", ["a", "new"])
def test_a_source_that_does_not_exist_is_refused_before_anything_changes(model_id):
    factory = Factory()
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=factory,
        source_check=lambda spec: check_source(rt._settings, spec),
    )
    before = rt.status()
    with pytest.raises(
        BadManagementRequest,
        match=f"^{model_id}\\.source: model folder '/nonexistent/x' does not exist$",
    ):
        rt.register(model_id, {"source": "/nonexistent/x", "device": "cpu"})
    assert rt.status() == before  # nothing registered, torn down or recorded
    assert factory.events == [("load", "a")]


# --- beside the old engine ------------------------------------------------------------------------


def test_new_weights_load_beside_the_old_and_the_switch_follows_the_warm_up():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    old = factory.engines["a"]
    factory.load_gate, factory.load_started = threading.Event(), threading.Event()
    register = Background(lambda: rt.register("a", NEW))
    assert factory.load_started.wait(WAIT_S)
    status = rt.entry("a").status()
    assert status["state"] == "reconfiguring" and status["source"] == "test:a"
    assert rt.entry("a").engine is old and ("close", "a") not in factory.events
    factory.load_gate.set()
    status = register.result()
    assert status["source"] == "test:a2" and status["max_parallel_slots"] == 16
    assert factory.events == [("load", "a"), ("load", "a"), ("close", "a")]
    assert served_by(rt).spec.source == "test:a2"


def test_a_failed_load_beside_keeps_the_old_engine_and_spec_and_reports_it():
    factory = Factory()
    factory.failing["test:a2"] = OSError("shard 2 is missing")
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    old = factory.engines["a"]
    with pytest.raises(ModelLoadFailed, match="^loading model 'a' failed: shard 2 is missing$"):
        rt.register("a", NEW)
    status = rt.entry("a").status()
    assert (status["state"], status["source"]) == ("ready", "test:a")
    error = status["last_load_error"]
    assert error["message"] == "loading model 'a' failed: shard 2 is missing"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", error["at"])
    assert served_by(rt) is old and ("close", "a") not in factory.events
    del factory.failing["test:a2"]
    rt.register("a", NEW)  # the next successful load clears the error
    assert rt.entry("a").status()["last_load_error"] is None


def test_a_new_engine_with_too_few_slots_is_dropped_and_the_old_one_serves():
    factory = Factory()
    rt = runtime(spec("a", slots=1, load_on_startup=True), factory=factory)
    old = factory.engines["a"]
    factory.capacity = 2
    with pytest.raises(BadManagementRequest, match="^a.slots: 3 is more than the 2 this model"):
        rt.register("a", {**NEW, "slots": 3})
    assert served_by(rt) is old
    assert factory.events == [("load", "a"), ("load", "a"), ("close", "a")]  # the new one closed
    assert factory.engines["a"] is not old


def test_a_new_engine_over_the_budget_that_busy_models_hold_is_refused_and_the_old_serves():
    factory = sized(Factory(), a=1, b=2)
    rt = runtime(
        spec("a", load_on_startup=True),
        spec("b", load_on_startup=True),
        factory=factory,
        memory_budget_gib=4,
        source_check=estimate(0.5),  # the estimate says beside; the built engine is bigger
    )
    old = factory.engines["a"]
    busy = Held(rt, "b")
    assert busy.admitted.wait(WAIT_S)
    factory.sizes["a"] = int(2.5 * GIB)
    with pytest.raises(InsufficientMemory, match="needs 2.50 GiB"):
        rt.register("a", NEW)
    busy.finish()
    assert served_by(rt) is old and rt.entry("a").spec.source == "test:a"


# --- when they do not fit beside: the old engine goes first ---------------------------------------


@pytest.mark.parametrize(
    ("budget_gib", "new_gib", "order"),
    [
        (None, None, "beside"),  # no limit: nothing bounds it
        (2, 0.5, "beside"),  # 1 + 0.5 <= 2
        (2, 1, "beside"),  # exactly the budget
        (2, 1.5, "instead"),  # 1 + 1.5 > 2
        (2, None, "instead"),  # a limit and no estimate
    ],
)
def test_the_memory_budget_decides_between_beside_and_instead(budget_gib, new_gib, order):
    factory = sized(Factory(), a=1)
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=factory,
        memory_budget_gib=budget_gib,
        source_check=estimate(new_gib),
    )
    rt.register("a", NEW)
    expected = {
        "beside": [("load", "a"), ("load", "a"), ("close", "a")],
        "instead": [("load", "a"), ("close", "a"), ("load", "a")],
    }
    assert factory.events == expected[order]
    assert served_by(rt).spec.source == "test:a2"


def test_every_loaded_model_counts_against_the_budget():
    factory = sized(Factory(), a=1, b=1)
    rt = runtime(
        spec("a", load_on_startup=True),
        spec("b", load_on_startup=True),
        factory=factory,
        memory_budget_gib=2.5,
        source_check=estimate(0.5),  # 1 + 1 + 0.5 <= 2.5
    )
    rt.register("a", NEW)
    assert factory.events[-2:] == [("load", "a"), ("close", "a")]
    factory.sizes["b"] = int(1.5 * GIB)
    rt.unload("b"), served_by(rt, "b")  # b now holds 1.5: 1 + 1.5 + 0.5 > 2.5
    rt.register("a", {**NEW, "source": "test:a4"})
    assert factory.events[-2:] == [("close", "a"), ("load", "a")]


def test_the_same_weights_are_estimated_by_the_old_engines_own_size():
    factory = sized(Factory(), a=1)
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=factory,
        memory_budget_gib=2,
        source_check=estimate(None),
    )
    rt.register("a", {"source": "test:a", "device": "cpu", "keep_alive_s": 60})  # 1 + 1 <= 2
    assert factory.events == [("load", "a"), ("load", "a"), ("close", "a")]
    factory.sizes["a"] = int(1.5 * GIB)
    rt.register("a", {"source": "test:a", "device": "cpu"})  # as built, 1 GiB: fits beside
    rt.register("a", {"source": "test:a", "device": "cpu", "keep_alive_s": 5})  # 1.5 + 1.5 > 2
    assert factory.events[-2:] == [("close", "a"), ("load", "a")]


def test_the_vram_cap_counts_only_gpu_models_and_only_for_a_gpu_model():
    factory = sized(Factory(), a=0.5, b=1.5)
    gpu = {**NEW, "device": "cuda"}
    rt = runtime(
        replace(spec("a", load_on_startup=True), device="cuda"),
        spec("b", load_on_startup=True),  # on the CPU: not in the VRAM cap
        factory=factory,
        vram_cap_gib=2,
        source_check=estimate(1),
    )
    rt.register("a", gpu)  # 0.5 + 1 <= 2 on the card; b's 1.5 GiB is not on it
    assert factory.events[-2:] == [("load", "a"), ("close", "a")]
    rt._source_check = estimate(1.75)
    rt.register("b", {"source": "test:b2", "device": "cpu"})  # the cap is not the CPU's
    assert factory.events[-2:] == [("load", "b"), ("close", "b")]
    rt.register("a", {**gpu, "source": "test:a3"})  # 0.5 + 1.75 > 2 on the card
    assert factory.events[-2:] == [("close", "a"), ("load", "a")]


def test_when_the_new_weights_fail_instead_of_the_old_the_old_configuration_comes_back():
    factory = sized(Factory(), a=1)
    factory.failing["test:a2"] = OSError("shard 2 is missing")
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=factory,
        memory_budget_gib=1.5,
        source_check=estimate(1),
    )
    with pytest.raises(ModelLoadFailed) as caught:
        rt.register("a", NEW)
    message = (
        "loading model 'a' failed: shard 2 is missing; "
        "the previous configuration was loaded again and serves"
    )
    assert str(caught.value) == message
    assert factory.events == [("load", "a"), ("close", "a"), ("load", "a"), ("load", "a")]
    status = rt.entry("a").status()
    assert (status["state"], status["source"]) == ("ready", "test:a")
    assert status["last_load_error"]["message"] == message
    assert served_by(rt).spec.source == "test:a"


def test_when_the_old_configuration_fails_too_the_model_is_unloaded_with_the_error():
    factory = sized(Factory(), a=1)
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=factory,
        memory_budget_gib=1.5,
        source_check=estimate(1),
    )
    factory.failing = {"test:a2": OSError("new broken"), "test:a": OSError("old gone")}
    with pytest.raises(ModelLoadFailed) as caught:
        rt.register("a", NEW)
    assert str(caught.value) == (
        "loading model 'a' failed: new broken; loading the previous configuration failed too "
        "(loading model 'a' failed: old gone); unloaded"
    )
    status = rt.entry("a").status()
    assert (status["state"], status["source"]) == ("unloaded", "test:a")
    assert status["last_load_error"]["message"] == str(caught.value)
    assert isinstance(Held(rt, "a").finish().error, ModelLoadFailed)  # each request: 503
    del factory.failing["test:a"]
    assert served_by(rt).spec.source == "test:a"


def test_a_refusal_instead_of_the_old_keeps_its_kind():
    factory = sized(Factory(), a=1)
    rt = runtime(
        spec("a", slots=1, load_on_startup=True),
        factory=factory,
        memory_budget_gib=1.5,
        source_check=estimate(1),
    )
    factory.capacity = 2
    with pytest.raises(
        BadManagementRequest, match="slots: 3 is more than the 2 .*again and serves"
    ):
        rt.register("a", {**NEW, "slots": 3})
    assert rt.entry("a").status()["state"] == "ready"


# --- unloaded and new models ----------------------------------------------------------------------


def test_an_unloaded_model_keeps_its_configuration_when_the_new_one_fails():
    factory = Factory()
    factory.failing["test:a2"] = OSError("broken")
    rt = runtime(spec("a"), factory=factory)
    with pytest.raises(ModelLoadFailed, match="broken"):
        rt.register("a", NEW)
    status = rt.entry("a").status()
    assert (status["state"], status["source"]) == ("unloaded", "test:a")
    assert served_by(rt).spec.source == "test:a"


def test_a_new_model_that_fails_to_load_is_not_registered():
    # Issue 40, defect 2: it stayed registered in the live worker (listed, loaded by the next
    # request) although the state file never had it, so a respawned worker answered 404.
    factory = Factory()
    factory.failing["test:b"] = OSError("broken")
    rt = runtime(spec("a"), factory=factory)
    with pytest.raises(ModelLoadFailed, match="broken"):
        rt.register("b", {"source": "test:b", "device": "cpu"})
    assert [status["id"] for status in rt.status()] == ["a"]
    assert isinstance(Held(rt, "b").finish().error, ModelNotFound)
    del factory.failing["test:b"]
    assert rt.register("b", {"source": "test:b", "device": "cpu"})["state"] == "ready"
    assert served_by(rt, "b").spec.source == "test:b"
    assert factory.events.count(("load", "b")) == 2  # the failed PUT's, the second PUT's


def new_model_loading(factory, rt, table):
    """A PUT of new model b, holding it while its first load waits at the gate."""
    factory.load_gate, factory.load_started = threading.Event(), threading.Event()
    register = Background(lambda: rt.register("b", table))
    assert factory.load_started.wait(WAIT_S)
    return register


def test_a_request_queued_for_a_new_model_whose_load_fails_is_told_it_is_not_registered():
    factory = Factory()
    factory.failing["test:b"] = OSError("broken")
    rt = runtime(spec("a"), factory=factory)
    register = new_model_loading(factory, rt, {"source": "test:b", "device": "cpu"})
    request = Held(rt, "b")  # found b registered, and queued behind its PUT
    wait_until(lambda: rt.entry("b").status()["queued_requests"] == 1)
    factory.load_gate.set()
    with pytest.raises(ModelLoadFailed, match="broken"):
        register.result()
    error = request.finish().error
    assert isinstance(error, ModelNotFound)
    assert str(error) == "model 'b' is not registered (its registration failed)"
    assert factory.events.count(("load", "b")) == 1  # the request never loaded it


def test_a_request_that_finds_a_new_model_listed_queues_behind_its_registration():
    """A new model is listed with its PUT's manager already first in its queue: a request that
    finds it listed never enters before the PUT (nor loads it lazily meanwhile)."""
    rt = runtime(spec("a"))
    register = rt._managed
    early = []

    def racing(entry, operation, waiter=None):  # the PUT has just listed the new model
        early.append(Held(rt, "c"))
        wait_until(lambda: entry.status()["queued_requests"] == 1 or early[0].admitted.is_set())
        assert not early[0].admitted.is_set(), "a request entered before the PUT's manager"
        return register(entry, operation, waiter)

    rt._managed = racing
    assert rt.register("c", {"source": "test:c", "device": "cpu"})["state"] == "ready"
    assert early[0].finish().error is None


def test_managers_queued_behind_a_failed_new_registration():
    # A second PUT registers the model anew; an unload is told it is not registered; a bulk
    # unload lists it as not found.
    factory = Factory()
    factory.fail_next_load = OSError("broken")
    rt = runtime(spec("a"), factory=factory)
    register = new_model_loading(factory, rt, {"source": "test:b", "device": "cpu"})
    entry = rt.entry("b")
    unload = Background(lambda: rt.unload("b"))
    bulk = Background(lambda: rt.bulk_unload(["b"]))
    again = Background(lambda: rt.register("b", {"source": "test:b", "device": "cpu"}))
    wait_until(lambda: len(entry._queue) == 3)
    factory.load_gate.set()
    with pytest.raises(ModelLoadFailed, match="broken"):
        register.result()
    with pytest.raises(ModelNotFound) as refused:
        unload.result()
    assert str(refused.value) == "model 'b' is not registered (its registration failed)"
    assert bulk.result() == {"unloaded": [], "not_found": ["b"]}
    assert again.result()["state"] == "ready"
    assert rt.entry("b") is not entry and rt.entry("b").status()["state"] == "ready"


def test_a_request_queued_behind_a_failed_reconfigure_runs_on_the_old_engine():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    old = factory.engines["a"]
    factory.failing["test:a2"] = OSError("broken")
    factory.load_gate, factory.load_started = threading.Event(), threading.Event()
    register = Background(lambda: rt.register("a", NEW))
    assert factory.load_started.wait(WAIT_S)
    later = Held(rt, "a")
    wait_until(lambda: rt.entry("a").status()["queued_requests"] == 1)
    factory.load_gate.set()
    with pytest.raises(ModelLoadFailed):
        register.result()
    assert later.finish().engine is old


# --- what the reconfigure reports ------------------------------------------------------------------


def test_the_metrics_hook_hears_each_transition(caplog):
    factory = sized(Factory(), a=1)
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=factory,
        memory_budget_gib=1.5,
        source_check=estimate(0.25),
    )
    heard = []
    rt.on_event = lambda model_id, event: heard.append((model_id, event))
    rt.register("a", NEW)  # beside
    rt._source_check = estimate(1)
    rt.register("a", {**NEW, "source": "test:a3"})  # instead
    factory.failing["test:a4"] = OSError("broken")
    with pytest.raises(ModelLoadFailed):
        rt.register("a", {**NEW, "source": "test:a4"})  # instead, failed, restored
    assert heard == [
        ("a", "load"),
        ("a", "unload"),
        ("a", "load"),
        ("a", "unload"),
        ("a", "load_failed"),
        ("a", "load"),
    ]
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "loading model a failed: broken"
    ]
    heard.clear()
    rt.unload("a")
    assert heard == [("a", "unload")]


@pytest.mark.parametrize("error", [InsufficientMemory("full"), BadManagementRequest("a.slots: no")])
def test_a_factory_refusal_keeps_its_kind_and_the_old_engine_serves(error):
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    old = factory.engines["a"]
    factory.failing["test:a2"] = error
    with pytest.raises(type(error), match=f"^{error}$"):
        rt.register("a", NEW)
    assert served_by(rt) is old
    assert rt.entry("a").status()["last_load_error"]["message"] == str(error)


def test_a_budget_refusal_says_what_the_busy_models_hold():
    factory = sized(Factory(), a=1, b=2)
    rt = runtime(
        spec("a", load_on_startup=True),
        spec("b", load_on_startup=True),
        factory=factory,
        memory_budget_gib=4,
        source_check=estimate(0.5),
    )
    busy = Held(rt, "b")
    assert busy.admitted.wait(WAIT_S)
    factory.sizes["a"] = int(2.5 * GIB)
    with pytest.raises(InsufficientMemory) as caught:
        rt.register("a", NEW)
    busy.finish()
    assert str(caught.value) == (
        "model 'a' needs 2.50 GiB; 2.00 of SEMIF_MEMORY_BUDGET_GIB=4 are held by busy models; "
        "retry later"
    )


def test_registering_an_unloaded_model_shows_it_loading_and_requests_wait_for_it():
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    factory.load_gate = threading.Event()
    register = Background(lambda: rt.register("a", NEW))
    assert factory.load_started.wait(WAIT_S)
    assert rt.entry("a").status()["state"] == "loading"
    later = Held(rt, "a")
    wait_until(lambda: rt.entry("a").status()["queued_requests"] == 1)
    factory.load_gate.set()
    assert register.result()["state"] == "ready"
    assert later.finish().engine.spec.source == "test:a2"


def test_a_gpu_model_without_a_vram_cap_or_budget_loads_beside():
    factory = Factory()
    gpu_spec = replace(spec("a", load_on_startup=True), device="cuda")
    rt = runtime(gpu_spec, factory=factory, source_check=estimate(None))
    rt.register("a", {**NEW, "device": "cuda"})
    assert factory.events == [("load", "a"), ("load", "a"), ("close", "a")]


@pytest.mark.parametrize("model_id", ["a", "new"])
def test_a_model_loaded_by_a_register_and_never_used_still_retires(model_id):
    clock = Clock()
    rt = runtime(spec("a"), spec("z", load_on_startup=True), clock=clock)
    heard = []
    rt.on_event = lambda model_id, event: heard.append((model_id, event))
    rt.register(model_id, {**NEW, "keep_alive_s": 60})
    assert rt.entry(model_id).status()["last_used"] == clock.now  # the load counts as a use
    clock.now += 59
    assert rt.retire_idle() == []
    clock.now += 1
    assert rt.retire_idle() == [model_id]  # after z, which has no keep_alive_s, was skipped
    assert heard[-1] == (model_id, "retire")


def test_the_slot_check_before_a_reconfigure_applies_to_the_same_weights_only():
    factory = Factory(capacity=2)
    rt = runtime(spec("a", slots=1, load_on_startup=True), factory=factory)
    rt.register("a", {"source": "test:a", "device": "cpu", "slots": 2})  # exactly the capacity
    with pytest.raises(BadManagementRequest) as caught:
        rt.register("a", {"source": "test:a", "device": "cpu", "slots": 3})
    assert str(caught.value) == (
        "a.slots: 3 is more than the 2 this model supports; the current configuration keeps serving"
    )
    factory.capacity = 4  # other weights: their own engine says what they support
    assert rt.register("a", {**NEW, "slots": 3})["slots"] == 3


@pytest.mark.parametrize(
    "change",
    [{"max_tokens": 1024}, {"dtype": "bfloat16"}, {"revision": "r2"}, {"device": "cuda"}],
)
def test_a_reconfigure_that_changes_what_capacity_depends_on_is_checked_by_the_new_engine(
    change,
):
    # Issue 22.7: lowering max_tokens to 1024 with 8 slots was refused against the old engine's 4.
    factory = Factory(capacity=4)
    rt = runtime(spec("a", slots=1, load_on_startup=True), factory=factory)
    factory.capacity = 8  # what the new configuration's engine supports
    table = {"source": "test:a", "device": "cpu", "slots": 8, **change}
    assert rt.register("a", table)["slots"] == 8
    factory.capacity = 2
    with pytest.raises(BadManagementRequest, match="8 is more than the 2 this model supports"):
        rt.register("a", {**table, "max_tokens": 512})  # refused by the new engine, after it


def test_a_full_residency_refusal_says_why():
    rt = runtime(spec("a"), spec("b"), max_loaded_models=1)
    busy = Held(rt, "a")
    assert busy.admitted.wait(WAIT_S)
    with pytest.raises(InsufficientMemory) as caught:
        rt.register("b", {"source": "test:b", "device": "cpu"})
    busy.finish()
    assert str(caught.value) == (
        "1 models are loaded (SEMIF_MAX_LOADED_MODELS) and none is idle; retry later"
    )


def test_an_engine_that_states_no_capacity_serves_any_slot_count():
    def factory(spec):
        return SimpleNamespace(close=lambda: None)

    rt = runtime(spec("a"), factory=factory)
    status = rt.register("a", {**NEW, "slots": 16})
    assert status["state"] == "ready" and status["max_parallel_slots"] is None


def test_the_last_load_error_is_stamped_in_utc_whatever_the_local_zone(monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a local stamp would be hours off
    time.tzset()
    try:
        factory = Factory()
        factory.failing["test:a2"] = OSError("broken")
        rt = runtime(spec("a"), factory=factory)
        with pytest.raises(ModelLoadFailed):
            rt.register("a", NEW)
        at = rt.entry("a").status()["last_load_error"]["at"]
    finally:
        monkeypatch.undo()
        time.tzset()
    stamped = datetime.strptime(at, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    assert abs((datetime.now(UTC) - stamped).total_seconds()) < 60
