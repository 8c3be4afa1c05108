"""Issue 22, finding 7: a reconfigure that leaves the weights as they are (`keep_alive_s`,
`slots` within capacity, `max_tokens`) applies to the serving engine: no reload, the model's
stored prefixes kept, and the slot check made against the capacity at the NEW max_tokens.
Anything that touches the weights (source, revision, dtype, device), a GPU max_tokens past the
longest prompt warm-up ran, or a local folder rewritten since the load, loads a new engine.
Fake engines (the production Engine over a fake scorer) and one tiny real model; bounded waits.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
from fakes import WAIT_S, FakeScorer, row
from runtime_fixtures import Factory, GatedEngine, Held, runtime, spec

from semif_serve.engine.engine import Engine
from semif_serve.errors import BadManagementRequest
from semif_serve.scoring import parse_row

TABLE = {"source": "test:a", "device": "cpu"}
BUDGET_TOKENS = 4 * 4096  # the fake capacity: 4 slots of 4096 tokens, 8 of 2048, ...


class TunableScorer(FakeScorer):
    def __init__(self, max_tokens=4096):
        super().__init__()
        self.max_tokens = max_tokens
        self.unchanged = True

    def weights_unchanged(self):
        return self.unchanged


class TunableEngine(GatedEngine):
    """A fake engine that can be retuned: capacity = BUDGET_TOKENS // max_tokens slots."""

    def __init__(self, factory, spec):
        super().__init__(factory, spec)
        self._scorer = self.scorer = TunableScorer(spec.max_tokens)
        self.capacity_for = lambda max_tokens: min(16, BUDGET_TOKENS // max_tokens)
        self.max_parallel_slots = self.capacity_for(spec.max_tokens)
        self.warmed_max_tokens = factory.warmed


class TunableFactory(Factory):
    def __init__(self, warmed=None):
        super().__init__()
        self.warmed = warmed

    def __call__(self, model_spec):
        self.events.append(("load", model_spec.id))
        engine = self.engines[model_spec.id] = TunableEngine(self, model_spec)
        return engine


def loaded(factory=None, **spec_fields):
    factory = factory or TunableFactory()
    rt = runtime(spec("a", load_on_startup=True, **spec_fields), factory=factory)
    return rt, factory, factory.engines["a"]


@pytest.mark.parametrize(
    "change",
    [{"keep_alive_s": 60}, {"slots": 3}, {"max_tokens": 2048}, {"max_tokens": 2048, "slots": 8}],
)
def test_a_change_that_keeps_the_weights_applies_without_a_reload(change, caplog):
    rt, factory, engine = loaded()
    with caplog.at_level(logging.INFO, logger="semif_serve.runtime.lifecycle"):
        status = rt.register("a", {**TABLE, **change})
    assert "model a reconfigured in place (its weights are unchanged)" in [
        record.getMessage() for record in caplog.records
    ]
    assert factory.events == [("load", "a")]  # no second load, and nothing closed
    assert rt.entry("a").engine is engine
    for key in ("keep_alive_s", "slots"):
        if key in change:
            assert status[key] == change[key]
    assert rt.entry("a").spec.max_tokens == change.get("max_tokens", 4096)
    assert engine.scorer.max_tokens == change.get("max_tokens", 4096)
    assert status["max_parallel_slots"] == BUDGET_TOKENS // change.get("max_tokens", 4096)
    assert status["state"] == "ready"


def test_a_retuned_engine_serves_its_new_slot_count_at_once():
    rt, _, engine = loaded()
    rt.register("a", {**TABLE, "slots": 3})
    holders = [Held(rt, "a") for _ in range(3)]
    try:
        assert all(holder.admitted.wait(WAIT_S) for holder in holders)
        calls = [threading.Thread(target=engine.score, args=(parse_row(row()),)) for _ in range(3)]
        engine.scorer.release.clear()
        for call in calls:
            call.start()
        assert _wait_for(lambda: engine.scorer.active == 3)  # the semaphore admits all three
    finally:
        engine.scorer.release.set()
        for call in calls:
            call.join(WAIT_S)
        for holder in holders:
            holder.finish()


def _wait_for(condition) -> bool:
    done = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return True
        done.wait(0.01)
    return False


def test_more_slots_than_fit_at_the_new_max_tokens_is_refused_and_nothing_changes():
    rt, factory, engine = loaded()
    with pytest.raises(BadManagementRequest) as refused:
        rt.register("a", {**TABLE, "max_tokens": 8192, "slots": 3})
    assert str(refused.value) == (
        "a.slots: 3 is more than the 2 this model supports; the current configuration keeps serving"
    )
    status = rt.entry("a").status()
    assert (status["slots"], status["max_parallel_slots"]) == (1, 4)
    assert engine.scorer.max_tokens == 4096 and factory.events == [("load", "a")]


@pytest.mark.parametrize(
    "change",
    [{"source": "test:a2"}, {"revision": "r2"}, {"dtype": "bfloat16"}],
)
def test_a_change_to_the_weights_loads_a_new_engine(change):
    rt, factory, engine = loaded()
    rt.register("a", {**TABLE, **change})
    assert factory.events.count(("load", "a")) == 2 and ("close", "a") in factory.events
    assert rt.entry("a").engine is not engine


def test_a_gpu_max_tokens_past_the_warmed_shapes_loads_a_new_engine():
    rt, factory, engine = loaded(TunableFactory(warmed=4096))
    rt.register("a", {**TABLE, "max_tokens": 2048})  # shorter: its shapes were built
    assert rt.entry("a").engine is engine
    rt.register("a", {**TABLE, "max_tokens": 8192, "slots": 1})
    assert rt.entry("a").engine is not engine


def test_a_rewritten_local_folder_loads_again_on_any_reconfigure():
    rt, factory, engine = loaded()
    engine.scorer.unchanged = False  # the folder's files changed since the load
    rt.register("a", {**TABLE, "keep_alive_s": 60})
    assert rt.entry("a").engine is not engine


def test_an_engine_without_a_capacity_rule_is_reloaded_as_before():
    factory = Factory()
    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    first = rt.entry("a").engine
    rt.register("a", {**TABLE, "keep_alive_s": 60})
    assert rt.entry("a").engine is not first


# -- the engine's side -----------------------------------------------------------------------


def test_capacity_at_needs_a_rule_and_a_scorer_with_max_tokens():
    engine = Engine(TunableScorer())
    assert engine.capacity_at(1024) is None  # no rule
    engine.capacity_for = lambda max_tokens: 7
    assert engine.capacity_at(1024) == 7
    assert Engine(FakeScorer()).capacity_at(1024) is None


def test_retune_refuses_what_does_not_fit_and_keeps_a_shared_lock():
    shared = threading.Lock()
    engine = Engine(TunableScorer(), lock=shared)
    engine.capacity_for = lambda max_tokens: BUDGET_TOKENS // max_tokens
    with pytest.raises(ValueError, match="cannot serve 5 slots of 4096 tokens"):
        engine.retune(4096, 5)
    engine.retune(2048, 5)
    assert engine._lock is shared  # the single-lock runtime's lock is everyone's
    assert engine.max_parallel_slots == 8 and engine._scorer.max_tokens == 2048


def test_capacity_at_asks_the_weights_only_of_a_scorer_that_can_tell_and_up_to_the_warmed_length():
    class Plain(FakeScorer):  # max_tokens, but no way to tell whether its weights changed
        max_tokens = 4096

    engine = Engine(Plain())
    engine.capacity_for = lambda max_tokens: 3
    assert engine.capacity_at(1024) == 3
    engine.warmed_max_tokens = 4096
    assert engine.capacity_at(4096) == 3  # exactly the warmed length: its shapes exist
    assert engine.capacity_at(4097) is None


def test_an_engine_that_cannot_say_its_capacity_is_reloaded_even_for_keep_alive():
    built = []

    def factory(model_spec):
        built.append(SimpleNamespace(close=lambda: None))
        return built[-1]

    rt = runtime(spec("a", load_on_startup=True), factory=factory)
    rt.register("a", {**TABLE, "keep_alive_s": 60})
    assert len(built) == 2 and rt.entry("a").engine is built[1]
