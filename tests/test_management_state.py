"""Issue 30: management changes survive a worker that dies. The state file's pure pieces
(semif_serve/runtime/management_state.py), then real gunicorn servers over fake engines
(tests/serve_steered.py managed) whose worker is killed with SIGKILL and respawned by the master.

Before issue 30 the respawned worker answered /health 2.8 s later with every PUT undone
(keep_alive_s back to null, a model added by PUT a 404), and said nothing about why.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import serve_steered
from fakes import TOKEN, row
from live_server import LiveServer

from semif_serve import cli
from semif_serve.config import ConfigError
from semif_serve.runtime import management_state
from semif_serve.runtime.management_state import (
    LOCK_FILE,
    STATE_FILE,
    ManagementState,
    ReplayReport,
    StateError,
    configuration_key,
    lock_folder,
    own_folder,
    parse_state,
    render_state,
    replay_plan,
    with_register,
    with_unloads,
    write_atomically,
)
from semif_serve.server import WorkerEnd, worker_end

ADMIN = "a" * 40
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
KEY = "c" * 64
RESPAWN_TIMEOUT_S = 60  # the master forks a new worker at once; it boots in about a second

# --- the state's pure pieces -------------------------------------------------------------------


def test_a_put_records_its_table_loaded_and_moves_to_the_end():
    models = with_register({}, "a", {"source": "x"})
    models = with_register(models, "b", {"source": "y"})
    models = with_register(models, "a", {"source": "z", "keep_alive_s": 5})
    assert list(models) == ["b", "a"]
    assert models["a"] == {"table": {"source": "z", "keep_alive_s": 5}, "loaded": True}


def test_a_recorded_table_is_a_copy():
    table = {"source": "x", "nested": {"k": 1}}
    models = with_register({}, "a", table)
    table["nested"]["k"] = 2
    assert models["a"]["table"] == {"source": "x", "nested": {"k": 1}}


def test_an_unload_keeps_the_table_and_the_place():
    models = with_register(with_register({}, "a", {"source": "x"}), "b", {"source": "y"})
    models = with_unloads(models, ["a", "default"])
    assert list(models) == ["a", "b", "default"]
    assert models["a"] == {"table": {"source": "x"}, "loaded": False}
    assert models["default"] == {"table": None, "loaded": False}  # a configured model, unloaded
    assert with_register(models, "a", {"source": "x"})["a"]["loaded"] is True


def test_the_plan_registers_every_table_in_order_then_unloads():
    models = with_register({}, "a", {"source": "x"})
    models = with_unloads(with_register(models, "b", {"source": "y"}), ["a", "default"])
    registers, unloads = replay_plan(models)
    assert registers == [("a", {"source": "x"}), ("b", {"source": "y"})]
    assert unloads == ["a", "default"]


def test_a_state_renders_and_parses_back():
    models = with_unloads(with_register({}, "extra", {"source": "s", "keep_alive_s": 1.5}), ["d"])
    text = render_state(models, KEY)
    assert json.loads(text)["format"] == 1
    assert list(parse_state(text, KEY).items()) == list(models.items())


def state_text(models, format=1, configuration=KEY, **more) -> str:
    return json.dumps({"format": format, "configuration": configuration, "models": models, **more})


def test_an_entry_whose_id_is_not_a_model_id_is_refused_alone_and_logged(caplog):
    """Issue 43, finding 2: an unload of id "" (an empty path segment) was recorded, and a
    respawned worker replayed it onto the default model."""
    entries = [
        {"id": "", "table": None, "loaded": False},
        {"id": " ", "table": None, "loaded": False},
        ENTRY,
    ]
    with caplog.at_level("ERROR"):
        assert parse_state(state_text(entries), KEY) == {"a": {"table": None, "loaded": False}}
    assert [record.getMessage() for record in caplog.records] == [
        "management state: models[0]: '' is not a model id: ignored",
        "management state: models[1]: ' ' is not a model id: ignored",
    ]


ENTRY = {"id": "a", "table": None, "loaded": False}


NOT_A_STATE = "not a management state (keys format, configuration, models)"
ANOTHER = (
    "recorded over another startup configuration (SEMIF_MODEL, SEMIF_MODELS_FILE or a setting "
    "they depend on changed)"
)
ENTRY_SHAPE = "must be {id, table (object or null), loaded}"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (
            "{",
            "not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        ("[]", NOT_A_STATE),
        (state_text([], more=1), NOT_A_STATE),
        (state_text([], format=2), "format 2, not 1"),
        (state_text([], configuration="other"), ANOTHER),
        (state_text({}), "models: must be a list"),
        (state_text([1]), f"models[0]: {ENTRY_SHAPE}"),
        (state_text([{**ENTRY, "table": []}]), f"models[0]: {ENTRY_SHAPE}"),
        (state_text([{**ENTRY, "loaded": 1}]), f"models[0]: {ENTRY_SHAPE}"),
        (state_text([{**ENTRY, "id": 5}]), f"models[0]: {ENTRY_SHAPE}"),
        (state_text([{**ENTRY, "more": 1}]), f"models[0]: {ENTRY_SHAPE}"),
        (state_text([ENTRY, ENTRY]), "models[1]: 'a' appears twice"),
    ],
)
def test_a_state_that_is_not_one_is_refused_saying_why(text, why):
    with pytest.raises(StateError) as refused:
        parse_state(text, KEY)
    assert str(refused.value) == why


def test_a_constant_that_is_not_json_is_refused():
    text = state_text([{**ENTRY, "table": {"k": 12345}}]).replace("12345", "NaN")
    with pytest.raises(StateError, match=r"^not JSON: "):
        parse_state(text, KEY)


@pytest.mark.parametrize(
    ("report", "line"),
    [
        (ReplayReport(registered=["a"]), "registered a"),
        (ReplayReport(unloaded=["b"]), "unloaded b"),
        (ReplayReport(failed=["c (why)"]), "failed c (why)"),
        (ReplayReport(registered=["a"], failed=["c (why)"]), "registered a; failed c (why)"),
    ],
)
def test_a_replay_summary_names_only_what_happened(report, line):
    assert report.summary() == line


def test_the_configuration_key_changes_with_the_models_and_the_default():
    models = [{"id": "a", "source": "x"}, {"id": "b", "source": "y"}]
    key = configuration_key(models, "a")
    assert key == configuration_key([dict(m) for m in models], "a")
    assert key != configuration_key(models, "b")
    assert key != configuration_key([models[0]], "a")
    assert key != configuration_key([{"id": "a", "source": "z"}, models[1]], "a")


def test_an_atomic_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / STATE_FILE
    write_atomically(path, "old\n")
    write_atomically(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / STATE_FILE
    write_atomically(path, "old\n")

    def refuse(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(management_state.os, "replace", refuse)
    with pytest.raises(OSError, match="No space"):
        write_atomically(path, "new\n")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]


def test_a_change_is_written_and_one_that_changes_nothing_is_not(tmp_path, monkeypatch):
    path = tmp_path / STATE_FILE
    state = ManagementState(path, KEY)
    state.registered("a", {"source": "x"})
    assert parse_state(path.read_text(), KEY) == {"a": {"table": {"source": "x"}, "loaded": True}}
    writes = []
    monkeypatch.setattr(management_state, "write_atomically", lambda *a: writes.append(a))
    state.registered("a", {"source": "x"})  # as a replay does: same state, no write
    assert writes == []
    state.unloaded(["a"])
    assert len(writes) == 1


def test_a_state_that_cannot_be_saved_is_logged_and_kept_for_the_next_write(tmp_path, caplog):
    folder = tmp_path / "gone"
    state = ManagementState(folder / STATE_FILE, KEY)
    state.registered("a", {"source": "x"})  # the folder does not exist: the write fails
    assert "management state not saved to" in caplog.text
    assert "a new worker would not replay it" in caplog.text
    folder.mkdir()
    state.registered("b", {"source": "y"})
    assert list(parse_state((folder / STATE_FILE).read_text(), KEY)) == ["a", "b"]


@pytest.mark.parametrize("text", ["{", '{"format": 1, "configuration": "other", "models": []}'])
def test_a_state_file_that_cannot_be_replayed_is_logged_in_one_line(tmp_path, caplog, text):
    path = tmp_path / STATE_FILE
    path.write_text(text)
    state = ManagementState.open(path, KEY)
    assert state.models() == {}
    [record] = caplog.records
    assert record.getMessage().startswith(f"management state {path} not replayed (")
    assert "\n" not in record.getMessage()


def test_a_missing_state_file_is_an_empty_state(tmp_path, caplog):
    assert ManagementState.open(tmp_path / STATE_FILE, KEY).models() == {}
    assert caplog.records == []


def test_a_replay_that_fails_for_one_model_replays_the_others(tmp_path, caplog):
    state = ManagementState(tmp_path / STATE_FILE, KEY)
    for model_id in ("a", "broken", "c"):
        state.registered(model_id, {"source": model_id})
    state.unloaded(["c", "missing"])
    applied = []

    def register(model_id, table):
        if model_id == "broken":
            raise RuntimeError("its folder\nis gone")
        applied.append(("register", model_id, table["source"]))

    def unload(model_id):
        if model_id == "missing":
            raise LookupError("model 'missing' is not registered")
        applied.append(("unload", model_id))

    report = state.replay(register, unload, lambda: applied.append("heartbeat"))
    assert applied == [
        "heartbeat",
        ("register", "a", "a"),
        "heartbeat",  # broken: fails
        "heartbeat",
        ("register", "c", "c"),
        "heartbeat",
        ("unload", "c"),
        "heartbeat",  # missing: fails
    ]
    assert report.summary() == (
        "registered a, c; unloaded c; failed broken (its folder is gone), "
        "missing (model 'missing' is not registered)"
    )
    assert "replaying the management state of model broken failed: its folder is gone" in (
        caplog.text
    )


def test_an_empty_replay_says_nothing_was_recorded(tmp_path):
    report = ManagementState(tmp_path / STATE_FILE, KEY).replay(pytest.fail, pytest.fail)
    assert report.summary() == "nothing recorded"


def test_the_state_folder_is_created_private(tmp_path):
    folder = own_folder(tmp_path / "a" / "state")
    assert folder == tmp_path / "a" / "state"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert own_folder(folder) == folder  # an existing one is taken as it is


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda path: (path.mkdir(), path.chmod(0o777)), "is writable by others (mode 0777)"),
        (lambda path: path.write_text("x"), "cannot create"),
        (lambda path: (path.mkdir(), path.chmod(0o500)), "is not writable by this user"),
    ],
)
def test_a_state_folder_that_is_not_the_servers_own_is_refused_naming_the_variable(
    tmp_path, make, why
):
    path = tmp_path / "state"
    make(path)
    if why == "is not writable by this user" and os.access(path, os.W_OK):
        pytest.skip("running as root: every folder is writable")
    with pytest.raises(ConfigError, match=rf"^SEMIF_STATE_DIR: .*{re.escape(why)}"):
        own_folder(path)


def test_serve_with_a_bad_state_folder_exits_2_naming_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("SEMIF_API_TOKEN", TOKEN)
    monkeypatch.setenv("SEMIF_STATE_DIR", str(tmp_path / "file" / "state"))
    monkeypatch.setenv("SEMIF_MODEL", "builtin:smollm2-135m")  # a model and device that pass
    monkeypatch.setenv("SEMIF_DEVICE", "cpu")  # the checks made before the state folder's
    assert cli.main(["serve"]) == 2
    assert capsys.readouterr().err.startswith("semif-serve: error: SEMIF_STATE_DIR: cannot create")


@pytest.mark.parametrize(
    ("end", "abnormal", "described"),
    [
        (worker_end(7, os.CLD_KILLED, 9), True, "signal 9 SIGKILL"),
        (worker_end(7, os.CLD_DUMPED, 11), True, "signal 11 SIGSEGV"),
        (worker_end(7, os.CLD_EXITED, 1), True, "exit status 1"),
        (worker_end(7, os.CLD_EXITED, 0), False, "exit status 0"),
        (WorkerEnd(7, signal=250), True, "signal 250"),
    ],
)
def test_how_a_worker_ended(end, abnormal, described):
    assert (end.pid, end.abnormal, end.describe()) == (7, abnormal, described)


def test_the_master_sees_how_its_child_ended_without_reaping_it():
    """What _Arbiter relies on: waitid(WNOWAIT) reports the signal and leaves the child to
    gunicorn's own waitpid."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (ended := os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)) is None:
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.01)
    assert worker_end(child.pid, ended.si_code, ended.si_status).describe() == "signal 9 SIGKILL"
    assert os.waitpid(child.pid, 0)[1] == signal.SIGKILL  # still there to reap
    child.returncode = -9  # reaped here: Popen must not wait for it again


# --- through a real server ---------------------------------------------------------------------


def managed_server(tmp_path: Path, **env: str) -> LiveServer:
    control = tmp_path / "control"
    control.mkdir(exist_ok=True)
    extra = {
        "SEMIF_TEST_CONTROL": str(control),
        "SEMIF_ADMIN_TOKEN": ADMIN,
        "SEMIF_DEVICE": "cpu",
        **env,
    }
    log = tmp_path / f"server-{len(list(tmp_path.glob('server-*.log')))}.log"
    return LiveServer(serve_steered.command("managed"), extra, log)


def worker_pids(server: LiveServer) -> list[int]:
    return [int(pid) for pid in re.findall(r"Booting worker with pid: (\d+)", server.log_text())]


def models(server: LiveServer) -> dict[str, dict]:
    status, body, _ = server.request("GET", "/v1/models", headers=AUTH)
    assert status == 200, body
    return {model["id"]: model for model in body["models"]}


def put(server: LiveServer, model_id: str, table: dict) -> None:
    status, body, _ = server.request("PUT", f"/v1/models/{model_id}", table, ADMIN_AUTH)
    assert status == 200, body


def wait_for_the_worker_after(server: LiveServer, old: int) -> int:
    """Return the pid of the worker that replaced `old` once its /health answers 200: a worker
    that has booted may still be starting (503) while it replays the management state."""
    deadline = time.monotonic() + RESPAWN_TIMEOUT_S
    while True:
        assert server.process.poll() is None, f"the master exited:\n{server.log_text()}"
        assert time.monotonic() < deadline, f"no new worker answered:\n{server.log_text()}"
        new = worker_pids(server)[-1]
        if new != old:
            try:
                if server.request("GET", "/health", timeout=1)[0] == 200:
                    return new
            except OSError:
                pass
        time.sleep(0.05)


def kill_worker_and_wait_for_the_next(server: LiveServer) -> int:
    """SIGKILL the worker (not the master); return the new worker's pid once it answers."""
    [old] = worker_pids(server)[-1:]
    os.kill(old, signal.SIGKILL)
    return wait_for_the_worker_after(server, old)


def test_a_respawned_worker_serves_every_put_and_says_its_predecessor_was_killed(tmp_path):
    with managed_server(tmp_path) as server:
        put(server, "default", {"source": "fake", "keep_alive_s": 1234})
        put(server, "extra", {"source": "fake-extra"})
        [old] = worker_pids(server)
        new = kill_worker_and_wait_for_the_next(server)
        listed = models(server)
        assert listed["default"]["keep_alive_s"] == 1234
        assert (listed["extra"]["source"], listed["extra"]["loaded"]) == ("fake-extra", True)
        status, body, _ = server.request("POST", "/decide", row(model="extra"), AUTH)
        assert status == 200, body
        log = server.log_text()
    [line] = [line for line in log.splitlines() if "previous worker" in line]
    assert f"[{new}] [WARNING] semif_serve.server: previous worker (pid {old}) ended " in line
    assert line.endswith(
        "ended abnormally (signal 9 SIGKILL); replayed management state "
        f"({state_folder(line)}/{STATE_FILE}): registered default, extra"
    )
    # Unset SEMIF_STATE_DIR: a private folder for this run, removed when the server stopped.
    assert state_folder(line).name.startswith("semif-serve-state-")
    assert not state_folder(line).exists()


def state_folder(line: str) -> Path:
    return Path(re.search(r"replayed management state \((.+)/management\.json\)", line)[1])


def test_unloads_are_replayed_after_the_puts(tmp_path):
    with managed_server(tmp_path) as server:
        put(server, "extra", {"source": "fake-extra"})
        put(server, "other", {"source": "fake-other"})
        assert server.request("POST", "/v1/models/extra/unload", None, ADMIN_AUTH)[0] == 200
        status, body, _ = server.request(
            "POST", "/v1/models/unload", {"ids": ["other", "default", "nope"]}, ADMIN_AUTH
        )
        assert (status, body["not_found"]) == (200, ["nope"])
        kill_worker_and_wait_for_the_next(server)
        listed = models(server)
        log = server.log_text()
    assert {key: listed[key]["loaded"] for key in ("default", "extra", "other")} == {
        "default": False,
        "extra": False,
        "other": False,
    }
    assert (listed["extra"]["source"], listed["other"]["source"]) == ("fake-extra", "fake-other")
    assert "registered extra, other; unloaded extra, other, default" in log


def test_a_model_that_fails_to_replay_is_logged_and_the_others_are_served(tmp_path):
    with managed_server(tmp_path) as server:
        put(server, "flaky", {"source": "flaky"})
        put(server, "extra", {"source": "fake-extra"})
        (tmp_path / "control" / "fail-flaky").touch()
        kill_worker_and_wait_for_the_next(server)
        listed = models(server)
        assert server.request("POST", "/decide", row(model="extra"), AUTH)[0] == 200
        assert server.request("POST", "/decide", row(), AUTH)[0] == 200
        log = server.log_text()
    assert listed["extra"]["loaded"] is True
    assert "replaying the management state of model flaky failed: " in log
    assert "; replayed management state (" in log
    assert "registered extra; failed flaky (" in log


def test_a_failed_put_is_not_recorded(tmp_path):
    state = tmp_path / "state"
    with managed_server(tmp_path, SEMIF_STATE_DIR=str(state)) as server:
        status, _, _ = server.request("PUT", "/v1/models/bad", {"source": "x", "k": 1}, ADMIN_AUTH)
        assert status == 400
        (tmp_path / "control" / "fail-broken").touch()
        status, _, _ = server.request("PUT", "/v1/models/broken", {"source": "broken"}, ADMIN_AUTH)
        assert status == 503
        assert not (state / STATE_FILE).exists()
        put(server, "extra", {"source": "fake-extra"})
    assert list(json_models(state)) == ["extra"]


def json_models(state: Path) -> dict:
    document = json.loads((state / STATE_FILE).read_text())
    return {entry["id"]: entry for entry in document["models"]}


def test_a_state_folder_that_outlives_the_server_is_replayed_at_the_next_start(tmp_path):
    state = tmp_path / "state"
    with managed_server(tmp_path, SEMIF_STATE_DIR=str(state)) as server:
        put(server, "extra", {"source": "fake-extra", "keep_alive_s": 60})
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    with managed_server(tmp_path, SEMIF_STATE_DIR=str(state)) as server:
        assert models(server)["extra"]["keep_alive_s"] == 60
        log = server.log_text()
    assert f"[INFO] semif_serve.server: replayed management state ({state}/{STATE_FILE}): " in log
    assert "previous worker" not in log  # a clean start: no predecessor died
    # Other startup models: the state is not theirs, and is not replayed.
    with managed_server(tmp_path, SEMIF_STATE_DIR=str(state), SEMIF_MAX_TOKENS="100") as server:
        assert "extra" not in models(server)
        log = server.log_text()
    assert "not replayed (recorded over another startup configuration" in log


def test_a_corrupt_state_file_is_logged_and_the_configured_models_are_served(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / STATE_FILE).write_bytes(b"\xff" * 4096)
    with managed_server(tmp_path, SEMIF_STATE_DIR=str(state)) as server:
        assert list(models(server)) == ["default"]
        put(server, "extra", {"source": "fake-extra"})  # the next change replaces the file
        log = server.log_text()
    assert [line for line in log.splitlines() if "not replayed" in line] == [
        line for line in log.splitlines() if f"management state {state}/{STATE_FILE}" in line
    ]
    assert len([line for line in log.splitlines() if "not replayed" in line]) == 1
    assert list(json_models(state)) == ["extra"]


def test_a_worker_whose_predecessor_ended_cleanly_says_nothing_of_it(tmp_path):
    """SIGTERM to the worker alone: it drains and exits 0; the master starts another, which
    replays the state without calling its predecessor's end abnormal."""
    with managed_server(tmp_path) as server:
        put(server, "extra", {"source": "fake-extra"})
        [old] = worker_pids(server)
        os.kill(old, signal.SIGTERM)
        wait_for_the_worker_after(server, old)
        assert "registered extra" in server.log_text().split(f"pid: {old}", 1)[1]
        assert models(server)["extra"]["loaded"] is True
        log = server.log_text()
    assert "previous worker" not in log
    assert "[INFO] semif_serve.server: replayed management state (" in log


def test_a_state_folder_is_held_by_one_server_at_a_time(tmp_path):
    """Issue 40, defect 3: two servers on one SEMIF_STATE_DIR overwrote each other's file. The
    first holds the folder's lock; the second is refused naming the folder and the first's pid;
    once the first lets go, the folder can be taken again."""
    folder = own_folder(tmp_path / "state")
    first = lock_folder(folder)
    try:
        assert (folder / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        why = f"{folder} is in use by another semif-serve server (pid {os.getpid()})"
        with pytest.raises(ConfigError, match=rf"^SEMIF_STATE_DIR: {re.escape(why)}"):
            lock_folder(folder)
    finally:
        os.close(first)
    os.close(lock_folder(folder))


def test_serve_on_a_state_folder_another_server_holds_exits_2_naming_it(
    tmp_path, monkeypatch, capsys
):
    folder = own_folder(tmp_path / "state")
    held = lock_folder(folder)  # stands for the other server
    try:
        monkeypatch.setenv("SEMIF_API_TOKEN", TOKEN)
        monkeypatch.setenv("SEMIF_STATE_DIR", str(folder))
        monkeypatch.setenv("SEMIF_MODEL", "builtin:smollm2-135m")
        monkeypatch.setenv("SEMIF_DEVICE", "cpu")
        assert cli.main(["serve"]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"semif-serve: error: SEMIF_STATE_DIR: {folder} is in use by")
    finally:
        os.close(held)
