"""Run the app under gunicorn: ONE worker process (it owns the model) with gthread threads.

The model loads in the worker, not the master, so CUDA is never initialised before a fork, and
a load or warm-up failure makes gunicorn stop with "Worker failed to boot" (fail closed).
Threads: one per admitted request (SEMIF_MAX_QUEUE) plus spares, so /health and 429 replies are
answered while admitted requests wait for the engine; request heads are read without a thread
(semif_serve/worker.py). gthread's heartbeat comes from the worker's main loop, so a long scorer
call never trips gunicorn's timeout. SIGTERM stops accepting at once and lets in-flight requests
finish within SEMIF_GRACEFUL_TIMEOUT_S; when some were cut off, `run` exits with EXIT_CUT_OFF.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import Any

from gunicorn.app.base import BaseApplication

from semif_serve import native_memory
from semif_serve.config import Settings, check_alias_targets
from semif_serve.worker import EXIT_CUT_OFF, GUNICORN_ERROR_CODES, ServingLimits

__all__ = ["EXIT_CUT_OFF", "GUNICORN_ERROR_CODES", "gunicorn_options", "run"]

SPARE_THREADS = 4  # /health, 429 replies and management while every admitted request waits
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
        "worker_class": "semif_serve.worker.SemifWorker",
        "threads": settings.max_queue + SPARE_THREADS,
        "worker_connections": settings.max_connections,
        "timeout": WORKER_HEARTBEAT_TIMEOUT_S,
        "graceful_timeout": settings.graceful_timeout_s + MASTER_GRACE_MARGIN_S,
        "post_fork": lambda arbiter, worker: start_worker(worker, limits),
        "keepalive": 5,
        "sendfile": False,  # the worker's event loop sends every reply (semif_serve/worker.py)
        "preload_app": False,
        "accesslog": None,  # semif_serve.access logs one JSON line per request instead
        "errorlog": "-",
        "loglevel": "info",
        "proc_name": "semif-serve",
        "control_socket_disable": True,  # no management socket in $HOME; nothing uses it
        "worker_exit": close_runtime,
    }


def start_worker(worker: Any, limits: ServingLimits, environ: Any = os.environ) -> None:
    """gunicorn's post_fork hook, in the new worker before it loads anything: its limits, and
    its threads sharing native_memory.ARENAS malloc heaps (docs/performance.md, "Memory bounded
    by the budget") unless the operator set glibc's own arena maximum."""
    if "MALLOC_ARENA_MAX" not in environ and "arena_max" not in environ.get("GLIBC_TUNABLES", ""):
        native_memory.limit_arenas()
    worker.configure(limits)


class _Gunicorn(BaseApplication):
    def __init__(self, app_factory: Callable[[], Any], options: dict[str, Any]):
        self._app_factory = app_factory
        self._options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self._options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        configure_logging()
        return self._app_factory()


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


def build_runtime(settings: Settings, engine_factory: Callable[..., Any] | None = None) -> Any:
    """The registry: SEMIF_MODELS_FILE's models, or the one `default` model of SEMIF_MODEL.

    Without SEMIF_PARALLEL_SLOTS every engine shares one process-wide lock (INV-2); every
    engine shares one state-prefix cache of SEMIF_PREFIX_CACHE_GIB."""
    import threading

    from semif_serve.boot import build_engine, check_source
    from semif_serve.runtime.registry import Runtime
    from semif_serve.runtime.specs import default_spec, load_models_file
    from semif_serve.scoring.prefix_cache import GIB, PrefixCache

    if settings.models_file:
        specs, default_id = load_models_file(settings.models_file, settings)
    else:
        specs, default_id = [default_spec(settings)], "default"
    check_alias_targets(settings.model_aliases, [spec.id for spec in specs])
    shared_lock = threading.Lock() if settings.parallel_slots is None else None
    prefix_cache = PrefixCache(int(settings.prefix_cache_gib * GIB))  # one budget, every model
    factory = engine_factory or (
        lambda spec: build_engine(settings, spec, lock=shared_lock, prefix_cache=prefix_cache)
    )
    # The real source check goes only with the real engines; tests' fake factories take any source.
    source_check = None if engine_factory else (lambda spec: check_source(settings, spec))
    return Runtime(settings, factory, specs, default_id, source_check=source_check)


RUNTIME: Any = None  # the process-wide runtime, created in the worker; closed at worker exit


def production_app(settings: Settings) -> Any:
    """Load the startup models (fail closed), then build the app. Runs in the worker process."""
    global RUNTIME
    from semif_serve.http import create_app
    from semif_serve.runtime.service import DecisionService

    RUNTIME = build_runtime(settings)
    RUNTIME.start()
    return create_app(DecisionService(RUNTIME, settings), settings)


def close_runtime(server: Any, worker: Any) -> None:
    """gunicorn's worker_exit hook: after requests drained, stop the runtime and its models."""
    if RUNTIME is not None:
        RUNTIME.close()


def run(settings: Settings, app_factory: Callable[[], Any] | None = None) -> None:
    """Serve until SIGTERM/SIGINT; exits non-zero when the worker fails to boot, and with
    EXIT_CUT_OFF when the shutdown grace period cut off requests still in progress."""
    factory = app_factory or (lambda: production_app(settings))
    cut_off = multiprocessing.RawValue("i", 0)  # shared memory, inherited by the forked worker
    try:
        _Gunicorn(factory, gunicorn_options(settings, cut_off)).run()
    except SystemExit as done:
        if done.code in (0, None) and cut_off.value:
            raise SystemExit(EXIT_CUT_OFF) from None
        raise
