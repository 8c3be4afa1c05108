"""Issue 40, defects 1 and 3: the management state records each model's changes while the
model's manager still holds it, so the file takes them in the order they were served; a bulk
unload records every model it unloaded (a failed close included); a replay records nothing.

Before: `server.RecordedRuntime` wrote the file after the manager had let go of the model, so
two PUTs on one model could be written in the other order (served B, file A, and a respawned
worker replayed A); a bulk unload with one failed close recorded none of its unloads; a replay
re-recorded each model loaded before its replayed unload ran (a worker killed in between lost
the unload). The runtime, fake engines (`runtime_fixtures`), no sleeps.
"""

from __future__ import annotations

import json
import threading

import pytest
from fakes import WAIT_S
from runtime_fixtures import (
    Background,
    Factory,
    bulk_unload_with_a_failed_close,
    runtime,
    spec,
    wait_until,
)

from semif_serve.errors import ModelLoadFailed
from semif_serve.runtime import management_state
from semif_serve.runtime.management_state import ManagementState, with_register, with_unloads
from semif_serve.server import replay_management

KEY = "c" * 64


class Recorder:
    """Stands where a `ManagementState` does: each record with whether its model was held by
    its manager at that moment."""

    def __init__(self):
        self.runtime = None
        self.records: list[tuple[str, str, bool]] = []

    def registered(self, model_id, table):
        self.records.append(("registered", model_id, self._held(model_id)))

    def unloaded(self, model_ids):
        self.records.extend(("unloaded", model_id, self._held(model_id)) for model_id in model_ids)

    def _held(self, model_id) -> bool:
        return self.runtime.entry(model_id)._managed


def recorded(*specs, factory=None):
    rt = runtime(*specs, factory=factory or Factory())
    rt.management = recorder = Recorder()
    recorder.runtime = rt
    return rt, recorder


def test_each_change_is_recorded_while_its_manager_still_holds_the_model():
    rt, recorder = recorded(spec("a"), spec("b"))
    rt.register("a", {"source": "test:a", "keep_alive_s": 5})
    rt.register("c", {"source": "test:c"})  # a new model
    rt.unload("a")
    rt.bulk_unload(["b", "c"])
    assert sorted(recorder.records) == [
        ("registered", "a", True),
        ("registered", "c", True),
        ("unloaded", "a", True),
        ("unloaded", "b", True),
        ("unloaded", "c", True),
    ]


def test_a_failed_change_is_not_recorded():
    factory = Factory()
    factory.failing["test:broken"] = RuntimeError("no weights")
    rt, recorder = recorded(spec("a"), factory=factory)
    with pytest.raises(ModelLoadFailed, match="no weights"):
        rt.register("b", {"source": "test:broken"})
    assert recorder.records == []


def test_two_puts_on_one_model_are_written_in_the_order_they_were_served(tmp_path):
    factory = Factory()
    rt = runtime(spec("a"), factory=factory)
    rt.management = state = ManagementState(tmp_path / "management.json", KEY)
    factory.load_gate = threading.Event()
    first = Background(lambda: rt.register("a", {"source": "test:a", "keep_alive_s": 5}))
    assert factory.load_started.wait(WAIT_S)  # the first PUT holds the model, loading
    second = Background(lambda: rt.register("a", {"source": "test:a", "keep_alive_s": 7}))
    wait_until(lambda: len(rt.entry("a")._queue) == 1)  # the second PUT queued behind it
    factory.load_gate.set()
    first.result()
    second.result()
    assert rt.entry("a").spec.keep_alive_s == 7  # served: the second
    document = json.loads(state.path.read_text())
    assert [entry["table"]["keep_alive_s"] for entry in document["models"]] == [7]


def test_a_bulk_unload_records_every_model_it_unloaded_a_failed_close_included():
    factory = Factory()
    rt, recorder = recorded(spec("a"), spec("b"), factory=factory)
    bulk_unload_with_a_failed_close(rt, factory)
    assert {rt.entry(i).status()["state"] for i in "ab"} == {"unloaded"}
    assert sorted(recorder.records) == [("unloaded", "a", True), ("unloaded", "b", True)]


def test_a_replay_applies_the_state_and_records_nothing(tmp_path, monkeypatch):
    models = with_register({}, "a", {"source": "test:a", "keep_alive_s": 9})
    models = with_unloads(with_register(models, "b", {"source": "test:b"}), ["b"])
    state = Counted(tmp_path / "management.json", KEY, models)
    writes = []
    monkeypatch.setattr(management_state, "write_atomically", lambda *args: writes.append(args))
    rt = runtime(spec("a"), factory=Factory())
    rt.management = state
    replay_management(rt, None)
    assert rt.entry("a").spec.keep_alive_s == 9
    assert rt.entry("a").status()["state"] == "ready"
    assert rt.entry("b").status()["state"] == "unloaded"  # registered by the replay, then unloaded
    assert state.changes == [] and writes == [] and state.models() == models
    rt.unload("a")  # a change after the replay is recorded
    assert state.changes == [("unloaded", ["a"])] and len(writes) == 1


class Counted(ManagementState):
    """A management state that lists the changes it is told of."""

    def __init__(self, *args):
        super().__init__(*args)
        self.changes = []

    def registered(self, model_id, table):
        self.changes.append(("registered", model_id))
        super().registered(model_id, table)

    def unloaded(self, model_ids):
        self.changes.append(("unloaded", list(model_ids)))
        super().unloaded(model_ids)
