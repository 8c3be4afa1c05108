"""A controllable engine factory and helpers for the runtime's ordering tests.

Every wait is bounded by WAIT_S. Gates are threading.Events the test opens; the factory records
what it built and tore down, in order.
"""

from __future__ import annotations

import threading
import time

from fakes import WAIT_S, FakeScorer, settings

from semif_serve.engine.engine import Engine
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.specs import ModelSpec


class GatedEngine(Engine):
    """An engine whose calls can be held at a gate, and whose close() is recorded."""

    def __init__(self, factory, spec):
        self.scorer = FakeScorer(block=True)
        self.scorer.release.set()
        super().__init__(self.scorer, concurrency=spec.slots, max_parallel_slots=factory.capacity)
        self.factory, self.spec = factory, spec
        self.resident_bytes = factory.sizes.get(spec.id)

    def close(self):
        self.factory.events.append(("close", self.spec.id))
        super().close()


class Factory:
    def __init__(self, capacity=16):
        self.capacity = capacity
        self.events: list[tuple[str, str]] = []
        self.load_gate: threading.Event | None = None  # set: loads wait for it
        self.load_started = threading.Event()
        self.fail_next_load: Exception | None = None
        self.failing: dict[str, Exception] = {}  # every load of these sources fails
        self.engines: dict[str, GatedEngine] = {}
        self.sizes: dict[str, int] = {}  # resident bytes per model id

    def __call__(self, spec: ModelSpec) -> GatedEngine:
        self.events.append(("load", spec.id))
        self.load_started.set()
        if self.load_gate is not None:
            assert self.load_gate.wait(WAIT_S), "test never opened the load gate"
        if self.fail_next_load is not None:
            error, self.fail_next_load = self.fail_next_load, None
            raise error
        if spec.source in self.failing:
            raise self.failing[spec.source]
        engine = self.engines[spec.id] = GatedEngine(self, spec)
        return engine


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def spec(model_id="a", slots=1, keep_alive_s=None, load_on_startup=False, source=None):
    return ModelSpec(
        id=model_id,
        source=source or f"test:{model_id}",
        revision=None,
        dtype="float32",
        device="cpu",
        max_tokens=4096,
        slots=slots,
        keep_alive_s=keep_alive_s,
        load_on_startup=load_on_startup,
    )


def runtime(*specs, factory=None, clock=None, source_check=None, **overrides):
    overrides.setdefault("parallel_slots", 4)
    config = settings(**overrides)
    specs = specs or (spec(),)
    built = Runtime(
        config,
        factory or Factory(),
        list(specs),
        specs[0].id,
        clock or time.monotonic,
        source_check=source_check,
    )
    # Bounded: a startup load that never ends fails the test instead of hanging it.
    Background(lambda: built.start(idle_interval_s=None)).result()
    return built


class Held:
    """A request holding a lease in its own thread until `finish()`."""

    def __init__(self, rt: Runtime, model_id: str | None = None, timeout_s=None, gone=None):
        self.admitted = threading.Event()
        self.done = threading.Event()
        self._finish = threading.Event()
        self.error: BaseException | None = None
        self.engine = None
        self.thread = threading.Thread(target=self._run, args=(rt, model_id, timeout_s, gone))
        self.thread.start()

    def _run(self, rt, model_id, timeout_s, gone):
        try:
            with rt.lease(model_id, timeout_s, gone) as engine:
                self.engine = engine
                self.admitted.set()
                assert self._finish.wait(WAIT_S), "test never finished the held request"
        except BaseException as error:  # reported to the test
            self.error = error
        finally:
            self.done.set()

    def finish(self):
        self._finish.set()
        assert self.done.wait(WAIT_S)
        self.thread.join(WAIT_S)
        return self


class Background:
    """Any call in its own thread; `result()` waits (bounded) and re-raises."""

    def __init__(self, call):
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call,))
        self.thread.start()

    def _run(self, call):
        try:
            self.value = call()
        except BaseException as error:
            self.error = error
        finally:
            self.done.set()

    def result(self):
        assert self.done.wait(WAIT_S), "background call did not finish"
        if self.error is not None:
            raise self.error
        return self.value


def wait_until(predicate, timeout=WAIT_S):
    """Bounded wait for a state the code under test publishes (queue length, state)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.002)


def watch_waits(entry, when=lambda: True, condition="_cond") -> threading.Event:
    """The returned event is set once a thread waits on a model's condition while `when()`
    holds: `_cond`, what its requests, managers and loads wait on, or `_work`, what its
    dispatcher waits on. `when` is asked under the condition's lock, so it sees the state the
    waiter has just judged not ready: a negative check ("it does not go ahead yet") becomes a
    positive event."""
    watched, waited = getattr(entry, condition), threading.Event()
    real_wait = watched.wait

    def wait(timeout=None):
        if when():
            waited.set()
        return real_wait(timeout)

    watched.wait = wait
    return waited


def bulk_unload_with_a_failed_close(rt, factory) -> None:
    """Load a and b, then unload both in bulk while b's engine fails to close: the bulk unload
    raises that failure (after handling both)."""
    Held(rt, "a").finish()
    Held(rt, "b").finish()

    def broken_close():
        raise RuntimeError("close failed")

    factory.engines["b"].close = broken_close
    try:
        rt.bulk_unload(["b", "a"])
    except RuntimeError as error:
        assert str(error) == "close failed"
    else:
        raise AssertionError("the bulk unload reported no failure")
