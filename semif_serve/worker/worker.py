"""The gunicorn worker that owns the model: gthread's thread pool and event loop, with every
client read and write bounded (issues 13 and 21). It is built from one part per job:

- connections.py: accepting and counting connections, at most SEMIF_MAX_CONNECTIONS
  (more wait in the kernel's backlog);
- heads.py: reading each request's head in the event loop, costing no thread, within
  SEMIF_HEADER_TIMEOUT_S;
- handling.py: the request on a thread, its body reads bounded by
  SEMIF_BODY_TIMEOUT_S and SEMIF_MAX_BODY_BYTES (sockets.py);
- replies.py: the reply sent from the event loop within SEMIF_WRITE_TIMEOUT_S, and
  the lingering close;
- shutdown.py: on SIGTERM, the grace period SEMIF_GRACEFUL_TIMEOUT_S and the report
  of what it cut off (EXIT_CUT_OFF);
- starting.py: the replies while the startup models load (/health a 503 `loading`), and the
  worker's boot-error exit when they cannot.

This module holds what the parts share: the limits, where each connection is, its deadline, and
the event loop that runs them all.
"""

from __future__ import annotations

import math
import selectors
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from gunicorn import util as gunicorn_util
from gunicorn.arbiter import Arbiter
from gunicorn.workers.gthread import TConn, ThreadWorker

from semif_serve.worker.connections import ConnectionAccounting, raise_open_file_limit
from semif_serve.worker.handling import RequestHandling
from semif_serve.worker.heads import (
    GUNICORN_ERROR_CODES,
    HeadReading,
    head_ready,
    write_envelope_error,
)
from semif_serve.worker.replies import ReplyLoop
from semif_serve.worker.shutdown import EXIT_CUT_OFF, Shutdown

# semif_serve/server.py configures the worker with these; tests/test_worker.py pins head_ready.
__all__ = ["EXIT_CUT_OFF", "GUNICORN_ERROR_CODES", "SemifWorker", "ServingLimits", "head_ready"]


@dataclass(frozen=True)
class ServingLimits:
    """What the worker enforces, from Settings; `cut_off` is shared with the master process
    (a multiprocessing.RawValue("i")) and receives the number of requests cut off."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    graceful_timeout_s: float = 60.0
    max_body_bytes: int | None = None  # None: no wire-byte budget for bodies
    cut_off: Any = None


class SemifWorker(
    ConnectionAccounting, HeadReading, RequestHandling, ReplyLoop, Shutdown, ThreadWorker
):
    """gthread with bounded reads and writes and a reporting shutdown (see the module docstring).

    A connection is in exactly one place: `reading` (its head, in the event loop), a thread
    (its request), `writing` (its reply, in the event loop) or `closing` (lingering for the
    peer's FIN). Each in `reading`, `writing` or `closing` has a `deadline`; `next_expiry` is the
    soonest, so the loop sweeps only when one is due.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = ServingLimits(graceful_timeout_s=self.cfg.graceful_timeout)
        self.reading: dict[TConn, None] = {}
        self.writing: dict[TConn, None] = {}
        self.closing: dict[TConn, None] = {}
        self.undelivered_at_stop = 0  # replies whose write deadline passed after SIGTERM
        self.next_expiry = math.inf
        self.accept_resumes_at = 0.0

    def configure(self, limits: ServingLimits) -> None:
        """Called from gunicorn's post_fork hook (semif_serve/server.py), before init_process."""
        self.limits = limits

    def init_process(self) -> None:
        gunicorn_util.write_error = write_envelope_error  # this process serves only semif-serve
        raise_open_file_limit(self.worker_connections + 256, self.log)
        super().init_process()

    def run(self) -> None:
        self.poller.register(
            self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks
        )
        while self.alive:
            self.notify()
            self.admit_connections()
            self.wait_for_and_dispatch_events(timeout=self.next_wake(1.0))
            if not self.is_parent_alive() or self.start_failed():
                break
            self.expire()
        self.shut_down()
        if self.start_failed():  # logged by StartingApp; the master stops: "failed to boot"
            sys.exit(Arbiter.WORKER_BOOT_ERROR)

    def start_failed(self) -> bool:
        """Whether the app (semif_serve/worker/starting.py) could not be built."""
        return getattr(self.wsgi, "failed", None) is not None

    # Deadlines ----------------------------------------------------------------------------

    def next_wake(self, most: float) -> float:
        return max(0.0, min(most, self.next_expiry - time.monotonic()))

    def watch(self, conn: TConn, deadline: float) -> None:
        conn.deadline = deadline
        self.next_expiry = min(self.next_expiry, deadline)

    def expire(self) -> None:
        """Close heads, replies and lingering closes past their deadline (a head is closed
        unanswered; a reply's connection is reset and reported)."""
        now = time.monotonic()
        if now < self.next_expiry:
            return
        soonest = math.inf
        for waiting, on_expiry in (
            (self.reading, self.abandon_head),
            (self.writing, partial(self.undelivered, why="SEMIF_WRITE_TIMEOUT_S passed")),
            (self.closing, self.end_closing),
        ):
            for conn in list(waiting):
                if conn.deadline <= now:
                    on_expiry(conn)
                else:
                    soonest = min(soonest, conn.deadline)
        self.next_expiry = soonest
