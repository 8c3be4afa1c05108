"""Run the app under gunicorn: ONE worker process (it owns the model) with gthread threads.

The master listens on SEMIF_BIND itself, once (a busy port is one ConfigError naming it).
The model loads in the worker, not the master, so CUDA is never initialised before a fork, and
a load or warm-up failure makes gunicorn stop with "Worker failed to boot" (fail closed). It
loads on a thread while the worker answers (semif_serve/worker/starting.py: /health is a 503
`loading` meanwhile); once it is ready the worker logs one `ready` line with the model and URL.
Threads: one per admitted request (SEMIF_MAX_QUEUE) plus spares, so /health and 429 replies are
answered while admitted requests wait for the engine; request heads are read without a thread
(semif_serve/worker/). gthread's heartbeat comes from the worker's main loop, so a long scorer
call never trips gunicorn's timeout. SIGTERM stops accepting at once and lets in-flight requests
finish within SEMIF_GRACEFUL_TIMEOUT_S; when some were cut off, `run` exits with EXIT_CUT_OFF.

Management changes (PUT, unload) that succeed are written to the management state
(semif_serve/runtime/management_state.py) in SEMIF_STATE_DIR, or in a private folder for this run; a
worker replays it once its startup models have loaded, so one that gunicorn respawns serves what
the operator last set. The master notes how each worker ended (`_Arbiter`), and a worker whose
predecessor died (a signal, or a non-zero exit status) says so in one line with the replay.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from semif_serve.config import ConfigError, Settings, check_alias_targets
from semif_serve.engine import native_memory
from semif_serve.errors import ModelLoadFailed, StartupError
from semif_serve.runtime.admission import MANAGEMENT_IN_FLIGHT
from semif_serve.runtime.management_state import (
    STATE_FILE,
    ManagementState,
    configuration_key,
    lock_folder,
    own_folder,
)
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.service import SEMIF_COMMIT
from semif_serve.worker.listener import listen
from semif_serve.worker.starting import StartingApp, loading_health, ready_line
from semif_serve.worker.worker import EXIT_CUT_OFF, GUNICORN_ERROR_CODES, ServingLimits

__all__ = ["EXIT_CUT_OFF", "GUNICORN_ERROR_CODES", "gunicorn_options", "run"]

log = logging.getLogger(__name__)
# /health, the GETs and the 429 replies, while every admitted scoring request and management
# call holds a thread (each pool is refused past its limit, so these four stay free).
SPARE_THREADS = 4
WORKER_HEARTBEAT_TIMEOUT_S = 120
# The worker cuts off what is left at SEMIF_GRACEFUL_TIMEOUT_S and reports it; the master's own
# deadline (then SIGKILL, which would report nothing) comes this much later.
MASTER_GRACE_MARGIN_S = 5


def gunicorn_options(settings: Settings, cut_off: Any = None) -> dict[str, Any]:
    """gunicorn's settings; `cut_off` (a shared RawValue) receives the worker's cut-off count."""
    limits = ServingLimits(
        header_timeout_s=settings.header_timeout_s,
        body_timeout_s=settings.body_timeout_s,
        write_timeout_s=settings.write_timeout_s,
        graceful_timeout_s=settings.graceful_timeout_s,
        max_body_bytes=settings.max_body_bytes,
        cut_off=cut_off,
    )
    return {
        "bind": settings.bind,
        "workers": 1,
        "worker_class": "semif_serve.worker.worker.SemifWorker",
        "threads": settings.max_queue + MANAGEMENT_IN_FLIGHT + SPARE_THREADS,
        "worker_connections": settings.max_connections,
        "timeout": WORKER_HEARTBEAT_TIMEOUT_S,
        "graceful_timeout": settings.graceful_timeout_s + MASTER_GRACE_MARGIN_S,
        "post_fork": lambda arbiter, worker: forked(arbiter, worker, limits),
        "keepalive": 5,
        "sendfile": False,  # the worker's event loop sends every reply (semif_serve/worker/)
        "preload_app": False,
        "accesslog": None,  # semif_serve.access logs one JSON line per request instead
        "errorlog": "-",
        "loglevel": "info",
        "proc_name": "semif-serve",
        "control_socket_disable": True,  # no management socket in $HOME; nothing uses it
        "worker_exit": close_runtime,
    }


def forked(arbiter: Any, worker: Any, limits: ServingLimits) -> None:
    """gunicorn's post_fork hook: `start_worker`, and the worker's heartbeat for the app
    factory, which beats it between the models it replays (gunicorn's master kills a worker
    silent for WORKER_HEARTBEAT_TIMEOUT_S, booting or not)."""
    start_worker(worker, limits)
    app = getattr(arbiter, "app", None)
    if isinstance(app, _Gunicorn):
        app.heartbeat = worker.notify


def start_worker(worker: Any, limits: ServingLimits, environ: Any = os.environ) -> None:
    """gunicorn's post_fork hook, in the new worker before it loads anything: its limits, and
    its threads sharing native_memory.ARENAS malloc heaps (docs/performance.md, "Memory bounded
    by the budget") unless the operator set glibc's own arena maximum."""
    if "MALLOC_ARENA_MAX" not in environ and "arena_max" not in environ.get("GLIBC_TUNABLES", ""):
        native_memory.limit_arenas()
    worker.configure(limits)


@dataclass(frozen=True)
class WorkerEnd:
    """How a worker process ended, as its parent saw it: a signal, or an exit status."""

    pid: int
    signal: int | None = None
    status: int | None = None

    @property
    def abnormal(self) -> bool:
        return self.signal is not None or self.status not in (0, None)

    def describe(self) -> str:
        """`signal 9 SIGKILL`, or `exit status 1`."""
        if self.signal is None:
            return f"exit status {self.status}"
        try:
            name = signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"
        return f"signal {self.signal} {name}"


def worker_end(pid: int, code: int, value: int) -> WorkerEnd:
    """A WorkerEnd from waitid's si_code and si_status (CLD_EXITED: an exit status; CLD_KILLED
    or CLD_DUMPED: the signal)."""
    if code == os.CLD_EXITED:
        return WorkerEnd(pid, status=value)
    return WorkerEnd(pid, signal=value)


class _Arbiter(Arbiter):
    """gunicorn's master, noting how each worker ended before gunicorn reaps it (waitid with
    WNOWAIT leaves the child to gunicorn's own waitpid): the next worker, forked from this
    process, finds it in `app.previous_worker`. gunicorn's child_exit hook gets no status."""

    def start(self) -> None:
        """Listen on SEMIF_BIND first (`listen`), unless systemd or a re-exec handed gunicorn
        its sockets; then gunicorn's start, which logs "Listening at"."""
        if not self.LISTENERS and not {"LISTEN_FDS", "GUNICORN_FD"} & set(os.environ):
            self.LISTENERS = [listen(self.cfg, self.log)]
        super().start()
        self.app.address = bound_address(self.LISTENERS[0].sock.getsockname())

    def reap_workers(self) -> None:
        for pid in list(self.WORKERS) if hasattr(os, "waitid") else ():  # macOS before 3.13
            try:
                ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if ended is not None:
                self.app.previous_worker = worker_end(pid, ended.si_code, ended.si_status)
        super().reap_workers()


def bound_address(name: Any) -> str | None:
    """HOST:PORT of an IP listening socket's name, the port the kernel chose for SEMIF_BIND's
    `:0` included; IPv6 hosts in brackets. None for any other socket (a unix socket systemd
    passed, named by a path or, abstract, by bytes): the ready line then shows SEMIF_BIND."""
    if not isinstance(name, tuple):
        return None
    host, port = name[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Gunicorn(BaseApplication):
    previous_worker: WorkerEnd | None = None  # set by _Arbiter in the master; a fork inherits it
    address: str | None = None  # where the master listens (set by _Arbiter; a fork inherits it)
    heartbeat: Callable[[], None] | None = None  # the worker's, set in it by `forked`

    def __init__(
        self,
        app_factory: Callable[[], Any],
        options: dict[str, Any],
        starting: dict[str, Any] | None = None,
        on_ready: Callable[[str | None], None] = lambda address: None,
    ):
        self._app_factory = app_factory
        self._options = options
        self._starting = starting or {"status": "loading"}
        self._on_ready = on_ready
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        """In the worker: the app, built on a thread while the worker answers (StartingApp)."""
        configure_logging()
        expected, logged = (ConfigError, StartupError), (ModelLoadFailed,)  # by the runtime
        return StartingApp(
            self._app_factory,
            self._starting,
            lambda app: self._on_ready(self.address),
            expected,
            logged,
        )

    def run(self) -> None:  # BaseApplication.run, with _Arbiter
        try:
            _Arbiter(self).run()
        except RuntimeError as error:
            print(f"\nError: {error}\n", file=sys.stderr, flush=True)
            sys.exit(1)


def configure_logging() -> None:
    """Access lines as bare JSON; everything else semif_serve logs with its level and origin."""
    access = logging.getLogger("semif_serve.access")
    access_handler = logging.StreamHandler(sys.stderr)
    access_handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(access_handler)
    access.setLevel(logging.INFO)
    access.propagate = False
    service = logging.getLogger("semif_serve")
    service_handler = logging.StreamHandler(sys.stderr)
    service_handler.setFormatter(
        logging.Formatter("[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s")
    )
    service.addHandler(service_handler)
    service.setLevel(logging.INFO)


def build_runtime(
    settings: Settings,
    engine_factory: Callable[..., Any] | None = None,
    state_file: Path | None = None,
) -> Any:
    """The registry: SEMIF_MODELS_FILE's models, or the one `default` model of SEMIF_MODEL;
    with `state_file`, one that records its management changes there (`ManagementState`).

    Without SEMIF_PARALLEL_SLOTS every engine shares one device queue (INV-2: a fair FIFO
    lock whose waits keep each request's deadline); every engine shares one state-prefix cache
    of SEMIF_PREFIX_CACHE_GIB."""
    from semif_serve.runtime.device import DeviceQueue
    from semif_serve.runtime.specs import default_spec, load_models_file

    if settings.models_file:
        specs, default_id = load_models_file(settings.models_file, settings)
    else:
        specs, default_id = [default_spec(settings)], "default"
    check_alias_targets(settings.model_aliases, [spec.id for spec in specs])
    # Without SEMIF_PARALLEL_SLOTS every model's calls share the device, taken in turn (INV-2).
    shared_lock = DeviceQueue() if settings.parallel_slots is None else None
    # The real engines and their source check; tests' fake factories take any source, and their
    # servers never import torch (engine.boot and the prefix cache do).
    factory, source_check = engine_factory, None
    if factory is None:
        from semif_serve.engine.boot import build_engine, check_source
        from semif_serve.scoring.prefix_cache import GIB, PrefixCache

        prefix_cache = PrefixCache(  # one budget, every model
            int(settings.prefix_cache_gib * GIB),
            checkpoint_tokens=settings.prefix_checkpoint_tokens,
        )

        def factory(spec):
            return build_engine(settings, spec, lock=shared_lock, prefix_cache=prefix_cache)

        def source_check(spec):
            return check_source(settings, spec)

    management = None
    if state_file is not None:
        configuration = configuration_key([dataclasses.asdict(spec) for spec in specs], default_id)
        management = ManagementState.open(state_file, configuration)
    return Runtime(
        settings,
        factory,
        specs,
        default_id,
        source_check=source_check,
        device=shared_lock,
        management=management,
    )


RUNTIME: Any = None  # the process-wide runtime, created in the worker; closed at worker exit


def production_app(
    settings: Settings,
    engine_factory: Callable[..., Any] | None = None,
    previous_worker: WorkerEnd | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> Any:
    """Load the startup models (fail closed), replay the management state (SEMIF_STATE_DIR),
    then build the app. Runs in the worker process. `engine_factory`: tests' fake engines;
    `heartbeat`: the worker's, beaten before each replayed model loads."""
    global RUNTIME
    from semif_serve.http import create_app
    from semif_serve.runtime.service import DecisionService

    state_file = settings.state_dir / STATE_FILE if settings.state_dir else None
    RUNTIME = build_runtime(settings, engine_factory, state_file)
    RUNTIME.start()
    if state_file is not None:
        replay_management(RUNTIME, previous_worker, heartbeat)
    return create_app(DecisionService(RUNTIME, settings), settings)


def replay_management(
    runtime: Runtime,
    previous_worker: WorkerEnd | None,
    heartbeat: Callable[[], None] | None = None,
) -> None:
    """Replay the management state, saying so in one line: a warning naming how the previous
    worker ended when it died (then even with nothing to replay). The replay itself records
    nothing: the file already says it, and a worker killed in the middle leaves it whole (a
    replayed PUT recorded as loaded before its model's replayed unload ran would lose that)."""
    register = partial(runtime.register, record=False)
    unload = partial(runtime.unload, record=False)
    report = runtime.management.replay(register, unload, heartbeat)
    replayed = f"replayed management state ({runtime.management.path}): {report.summary()}"
    if previous_worker is not None and previous_worker.abnormal:
        log.warning(
            "previous worker (pid %d) ended abnormally (%s); %s",
            previous_worker.pid,
            previous_worker.describe(),
            replayed,
        )
    elif report.registered or report.unloaded or report.failed:
        log.info("%s", replayed)


def starting_health(settings: Settings) -> dict[str, Any]:
    from semif_serve.runtime.specs import load_models_file

    files = settings.models_file
    return loading_health(
        load_models_file(files, settings)[1] if files else "default", SEMIF_COMMIT
    )


def announce_ready(
    settings: Settings, note: Callable[[str], str] | None
) -> Callable[[str | None], None]:
    """The worker's `ready` line (the default model, the URL the master listens on: SEMIF_BIND,
    with the kernel's port for `:0`), then `note(address)` on stdout."""

    def ready(address: str | None) -> None:
        address = address or settings.bind
        model = (RUNTIME.default_id, RUNTIME.default_model_info()) if RUNTIME else None
        log.info("%s", ready_line(f"http://{address}", model))
        if note:
            print(note(address), flush=True)

    return ready


def close_runtime(server: Any, worker: Any) -> None:
    """gunicorn's worker_exit hook: after requests drained, stop the runtime and its models."""
    if RUNTIME is not None:
        RUNTIME.close()


def run(
    settings: Settings,
    app_factory: Callable[[], Any] | None = None,
    engine_factory: Callable[..., Any] | None = None,
    ready_note: Callable[[str], str] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; exits non-zero when the worker fails to boot, and with
    EXIT_CUT_OFF when the shutdown grace period cut off requests still in progress.

    SEMIF_STATE_DIR is checked and taken first (a folder another server holds stops this
    one), then SEMIF_BIND is listened on (a ConfigError names either); unset, the management
    state lives in a private folder this process removes when it stops. `engine_factory`: the
    production app over tests' fake engines; `ready_note`: its text for the address listened on
    is printed to stdout each time a worker is ready (`serve --token-file`'s curl example)."""
    master = os.getpid()  # the forked worker returns through here too, with its SystemExit
    folder = own_folder(settings.state_dir) if settings.state_dir else None
    held = lock_folder(folder) if folder is not None else None  # one server per folder
    private = None
    if folder is None and app_factory is None:  # tests' own apps keep no management state
        private = Path(tempfile.mkdtemp(prefix="semif-serve-state-"))
    serving = dataclasses.replace(settings, state_dir=folder or private)
    cut_off = multiprocessing.RawValue("i", 0)  # shared memory, inherited by the forked worker
    try:
        server = _Gunicorn(
            app_factory
            or (
                lambda: production_app(
                    serving, engine_factory, server.previous_worker, server.heartbeat
                )
            ),
            gunicorn_options(settings, cut_off),
            starting_health(settings),
            announce_ready(settings, ready_note),
        )
        server.run()
    except SystemExit as done:
        if done.code in (0, None) and cut_off.value:
            raise SystemExit(EXIT_CUT_OFF) from None
        raise
    finally:
        if private is not None and os.getpid() == master:
            shutil.rmtree(private, ignore_errors=True)
        if held is not None:
            os.close(held)
