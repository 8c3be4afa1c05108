"""The worker's shutdown on SIGTERM: a part of the worker (worker.py).

The listening sockets close at once (new connects are refused), requests inside the app and
replies still being sent get SEMIF_GRACEFUL_TIMEOUT_S to finish, and idle kept-alive connections
STOP_IDLE_LINGER_S to start one last request. When the grace period ends with requests still
inside the app or replies still unsent, each is logged, the master is told how many
(`ServingLimits.cut_off`), and the worker exits with EXIT_CUT_OFF, which `semif-serve serve`
exits with too (semif_serve/server.py).
"""

from __future__ import annotations

import logging
import os
import sys
import time

from semif_serve.worker.replies import STOP_IDLE_LINGER_S

EXIT_CUT_OFF = 5  # the worker's (and `semif-serve serve`'s) status when requests were cut off


class Shutdown:
    """Runs when the worker's event loop ends. Drives the same loop (`watch`, `next_wake`,
    `expire`) until every connection is gone or the grace period ends, then cuts off what is
    left: heads in `reading`, replies being written (`cut_off_replies`), requests inside the app
    (the app's `in_progress`) and lingering closes in `closing`."""

    def shut_down(self) -> None:
        """Refuse new connections at once, let requests finish within the grace period, then
        cut off and report whatever is still inside the app."""
        started = time.monotonic()
        self.set_accept_enabled(False)
        for listener in self.sockets:  # the master closed its copies before signalling us
            listener.close()
        grace_ends = started + self.limits.graceful_timeout_s
        for conn in self.reading:
            limit = grace_ends if conn.head else min(grace_ends, started + STOP_IDLE_LINGER_S)
            self.watch(conn, min(conn.deadline, limit))
        while self.nr_conns > 0 and time.monotonic() < grace_ends:
            self.notify()
            self.wait_for_and_dispatch_events(
                timeout=self.next_wake(min(1.0, grace_ends - time.monotonic()))
            )
            self.expire()
        cut = self.undelivered_at_stop + self.cut_off_replies()
        in_progress = getattr(self.wsgi, "in_progress", None)
        if in_progress is not None:
            cut += in_progress.cut_off()
        if cut:
            self.exit_cut_off(cut)
        for conn in list(self.reading):
            self.stop_reading(conn)
            self.drop(conn)
        for conn in list(self.closing):
            self.end_closing(conn)
        self.tpool.shutdown(wait=False, cancel_futures=True)
        self.poller.close()
        self.method_queue.close()

    def exit_cut_off(self, count: int) -> None:
        """Tell the master how many requests were cut off (inside the app, or their replies
        undelivered) and exit now: the threads still serving some cannot be stopped, and the
        master kills us soon anyway."""
        self.log.error(
            "SEMIF_GRACEFUL_TIMEOUT_S (%ss) ended with %d request(s) in progress or undelivered:"
            " cut off",
            self.limits.graceful_timeout_s,
            count,
        )
        if self.limits.cut_off is not None:
            self.limits.cut_off.value = count
        logging.shutdown()
        sys.stderr.flush()
        os._exit(EXIT_CUT_OFF)
