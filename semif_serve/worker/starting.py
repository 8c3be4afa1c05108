"""What the worker serves while its app is built (the startup models load and warm up): every
request is answered at once instead of waiting in the listen backlog. `GET /health` (and
`HEAD`) is a 503 whose body says `loading`; every other route is a 503 `server_busy` with
`Retry-After`, which clients retry. Once the app is built every request goes to it.

The app is built on a thread of its own (which then stays, parked), so the worker's event
loop runs (and beats gunicorn's heartbeat) meanwhile. A build that fails is logged in one line
(a traceback only for an error nobody expected) and `failed` is set: the worker then stops with
gunicorn's boot-error status, and gunicorn's master stops too ("Worker failed to boot"):
nothing is served without its model.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any

from semif_serve.errors import ServerStarting
from semif_serve.http.errors import classify, envelope

log = logging.getLogger(__name__)
STARTING = ServerStarting("the server is starting: its models are loading; retry in a moment")


class StartingApp:
    """A WSGI callable: the starting replies until `build()` returns the app, then the app.

    `health`: the 503 /health body while starting; `on_ready(app)`: called once the app is
    built, before it serves; `expected`: the exceptions a failed start is logged with in one
    line; `logged`: those whose raiser logged them already (in one line), not logged again."""

    def __init__(
        self,
        build: Callable[[], Any],
        health: dict[str, Any],
        on_ready: Callable[[Any], None] = lambda app: None,
        expected: tuple[type[BaseException], ...] = (),
        logged: tuple[type[BaseException], ...] = (),
    ):
        self._build = build
        self._health = json.dumps(health).encode()
        self._on_ready = on_ready
        self._expected = expected
        self._logged = logged
        self.app: Any = None
        self.failed: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="semif-startup", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            app = self._build()
            self._on_ready(app)
        except self._logged as error:
            self.failed = error
        except self._expected as error:
            log.error("the server cannot start: %s", " ".join(str(error).split()))
            self.failed = error
        except BaseException as error:
            log.exception("the server cannot start")
            self.failed = error
        else:
            self.app = app
        finally:
            self.done.set()
        # The thread stays, parked: once a thread that ran torch's OpenMP work ends, libgomp's
        # team of it keeps spinning, and every later decision on a 2-core host took 5-10x as
        # long (4.6-7.4 s, not 0.4-1.1 s, for one SmolLM2 /decide; 2026-12-04).
        threading.Event().wait()

    # What the worker reads from its app (semif_serve/worker/): none while starting.
    @property
    def in_progress(self) -> Any:
        return getattr(self.app, "in_progress", None)

    @property
    def metrics(self) -> Any:
        return getattr(self.app, "metrics", None)

    def __call__(self, environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        app = self.app
        if app is not None:
            return app(environ, start_response)
        return self.starting_reply(environ, start_response)

    def starting_reply(self, environ: dict[str, Any], start_response: Callable) -> list[bytes]:
        # The envelope, status and Retry-After of every refusal come from http/errors.py.
        status, code, message, headers = classify(STARTING)
        if environ.get("PATH_INFO") == "/health":
            body = self._health
        else:
            body = envelope(code, message).encode()
        start_response(
            f"{status} {HTTPStatus(status).phrase}",
            [
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                *headers.items(),
            ],
        )
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]


def loading_health(default_id: str, semif_commit: str) -> dict[str, Any]:
    """/health's body while the startup models load: the default model's `loading` state."""
    return {
        "status": "loading",
        "reason": "starting",
        "semif_commit": semif_commit,
        "model": {"id": default_id, "state": "loading"},
    }


def ready_line(url: str, model: tuple[str, dict[str, Any]] | None) -> str:
    """`ready: model default (builtin:smollm2-135m, float32 on cpu) at http://...`; `model`:
    the default model's id and info (None: a test's own app)."""
    if model is None:
        return f"ready at {url}"
    model_id, info = model
    where = f"{info.get('source')}, {info.get('dtype')} on {info.get('device')}"
    return f"ready: model {model_id} ({where}) at {url}"
