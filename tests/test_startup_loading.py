"""Issue 32: while the startup models load, the worker answers at once (/health a 503 with the
`loading` state, every other route a 503 `server_busy` with Retry-After), then logs one `ready`
line with the model and the URL; a start that fails says why in one line, with no traceback.

Before issue 32 the worker accepted nothing until its model was loaded and warmed up: a /health
sent during start-up waited ~9 s in the listen backlog, a curl pasted at once just hung.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

import pytest
import serve_steered
from fakes import AUTH, WAIT_S, row
from live_server import STOP_TIMEOUT_S, fake_server, stop

from semif_serve.worker.starting import StartingApp, loading_health, ready_line

HEALTH = loading_health("default", "abc123")


def call(app, method="GET", path="/health"):
    replies = []
    chunks = app(
        {"REQUEST_METHOD": method, "PATH_INFO": path}, lambda *reply: replies.append(reply)
    )
    ((status, headers),) = replies
    return status, dict(headers), b"".join(chunks)


def started(app: StartingApp) -> StartingApp:
    assert app.done.wait(WAIT_S), "the build never ended"
    return app


def test_while_building_health_is_a_503_naming_the_loading_state_and_posts_are_busy():
    release = threading.Event()

    def real(environ, start_response):
        start_response("200 OK", [])
        return [b"real"]

    app = StartingApp(lambda: release.wait(WAIT_S) and real, HEALTH)
    status, headers, body = call(app)
    assert status == "503 Service Unavailable"
    assert json.loads(body) == {
        "status": "loading",
        "reason": "starting",
        "semif_commit": "abc123",
        "model": {"id": "default", "state": "loading"},
    }
    assert headers["Retry-After"] == "1" and headers["retry-after-ms"] == "1000"
    assert headers["Content-Length"] == str(len(body))
    status, headers, body = call(app, "POST", "/decide")
    assert status.startswith("503") and headers["Retry-After"] == "1"
    assert json.loads(body)["error"]["code"] == "server_busy"
    assert call(app, "HEAD")[2] == b""  # a HEAD gets the GET's headers, no body
    assert app.in_progress is None and app.metrics is None
    release.set()
    assert call(started(app))[2] == b"real"


def test_once_built_the_ready_hook_runs_before_the_app_serves():
    seen = []

    class Built:
        in_progress, metrics = "in-progress", "metrics"

        def __call__(self, environ, start_response):
            start_response("200 OK", [])
            return [b"ok"]

    app = started(StartingApp(Built, HEALTH, on_ready=lambda built: seen.append(built)))
    assert [type(built) for built in seen] == [Built] and app.failed is None
    assert call(app)[2] == b"ok"
    assert (app.in_progress, app.metrics) == ("in-progress", "metrics")


class Expected(Exception):
    pass


class Logged(Exception):
    pass


@pytest.mark.parametrize(
    ("error", "lines", "traceback"),
    [
        (
            Expected("the model\n cannot load"),
            ["the server cannot start: the model cannot load"],
            False,
        ),
        (Logged("said already"), [], False),
        (KeyError("a bug"), ["the server cannot start"], True),
    ],
)
def test_a_failed_build_is_logged_once_in_one_line_and_marks_the_start_failed(
    caplog, error, lines, traceback
):
    def build():
        raise error

    app = started(StartingApp(build, HEALTH, expected=(Expected,), logged=(Logged,)))
    assert app.failed is error and app.app is None
    records = [record for record in caplog.records if record.name == "semif_serve.worker.starting"]
    assert [record.getMessage() for record in records] == lines
    assert any(record.exc_info for record in records) is traceback


def test_the_ready_line_names_the_model_its_dtype_device_and_the_url():
    info = {"source": "builtin:smollm2-135m", "dtype": "float32", "device": "cpu"}
    assert ready_line("http://127.0.0.1:8471", ("default", info)) == (
        "ready: model default (builtin:smollm2-135m, float32 on cpu) at http://127.0.0.1:8471"
    )
    assert ready_line("http://127.0.0.1:8471", None) == "ready at http://127.0.0.1:8471"


def test_the_ready_address_is_the_one_listened_on_with_the_kernels_port_for_port_0():
    from semif_serve.server import bound_address

    assert bound_address(("127.0.0.1", 40123)) == "127.0.0.1:40123"
    assert bound_address(("::1", 40123, 0, 0)) == "[::1]:40123"
    assert bound_address("/run/semif.sock") is None  # unix sockets: SEMIF_BIND is shown
    assert bound_address(b"\x00semif") is None


# --- through gunicorn ------------------------------------------------------------------------


def test_health_answers_at_once_while_the_app_loads_then_one_ready_line(tmp_path):
    with fake_server(tmp_path, ready_status=503, SEMIF_TEST_START="gated") as server:
        began = time.monotonic()
        status, body, headers = server.request("GET", "/health", timeout=1)
        assert time.monotonic() - began < 1
        assert status == 503 and body["status"] == "loading", body
        assert body["model"] == {"id": "default", "state": "loading"}
        status, body, headers = server.request("POST", "/decide", row(), AUTH, timeout=1)
        assert status == 503 and body["error"]["code"] == "server_busy"
        assert headers["Retry-After"] == "1"
        assert "ready" not in server.log_text()
        (tmp_path / "control" / "start").touch()
        deadline = time.monotonic() + WAIT_S
        while server.request("GET", "/health", timeout=1)[0] != 200:
            assert time.monotonic() < deadline, server.log_text()
            time.sleep(0.02)
        assert server.request("POST", "/decide", row(), AUTH)[0] == 200
        ready = [line for line in server.log_text().splitlines() if " ready" in line]
        assert len(ready) == 1 and ready[0].endswith(f"ready at http://127.0.0.1:{server.port}")


def test_a_start_that_fails_is_one_line_and_gunicorn_stops_with_its_boot_error(tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    env = {
        **os.environ,
        "SEMIF_API_TOKEN": "t" * 40,
        "SEMIF_BIND": "127.0.0.1:0",
        "SEMIF_TEST_CONTROL": str(control),
        "SEMIF_TEST_START": "fails",
    }
    process = subprocess.Popen(
        serve_steered.command("fake"), env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        _, log = process.communicate(timeout=3 * WAIT_S)
    finally:
        stop(process, STOP_TIMEOUT_S)
    assert process.returncode == 3, log
    said = [line for line in log.splitlines() if "on purpose" in line]
    assert len(said) == 1 and said[0].endswith(
        "the server cannot start: model 'default' (fake): the warm-up decision failed on purpose"
    ), log
    assert "Traceback" not in log and "Worker failed to boot" in log
